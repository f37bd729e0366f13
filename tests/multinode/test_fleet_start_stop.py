"""A big job's first and last minute, against a real ``mlflow server`` on PostgreSQL (as docs/fleet.md
deploys a fleet's server; bench/fleet.py measures sqlite too, and a 2,048-node job's run on sqlite is
tests/mlflow/test_job_run_opens.py's): 32 real ``otel-forge monitor`` agents of a 2,048-node SLURM job
(node runs, 120 s windows, 8 fake GPUs each), each its own process group, started together, stopped
together (SIGTERM), then the next job's agent started on the same machine, as the next job on those
nodes would start.

- the start: within 30 s every node run exists and holds a window, or, on a slower machine, within
  the time the cores left to the test need for its own CPU (the agents', the server's) and 10 s
  (here 32 agents spend 40-69 CPU-seconds before every window is in: MLflow's client is ~1 s of
  each). The cores left are the machine's less what other processes used meanwhile (the other test
  worker's, the hypervisor's steal on a VM), so the test runs beside the others;
- the stop: within 90 s of it every node's last window is in its node run (from the closing agents or
  the next one), every node run FINISHED with windows 0..n-1, no window left in a spool;
- the server's CPU per node-minute from the start to the last window in is printed (3 minutes of a
  node's life are mostly its start and stop: the steady state's figure is bench/fleet.py's).

The agents and the server share this machine's cores: the figures are the bench's (bench/fleet.py
--at-defaults); here they bound what a user sees."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from mlflow import MlflowClient

from bench._common import tree_cpu_s
from bench._fleet_parts import node_env, ours_command, spooled
from testkit.mlflow_server import MlflowServer
from testkit.postgres import Postgres
from testkit.proxy import LOG_BATCH, MlflowProxy

UPDATE_RUN = "/api/2.0/mlflow/runs/update"

AGENTS, FLEET = 32, 2048
START_S, STOP_S = 30.0, 90.0
HOLD_S = 30.0  # from the start to the stop: past the start bound, and a last window after it
PARENT_TAG, NODE_TAG = "mlflow.parentRunId", "otel_forge.node.id"


@pytest.fixture
def server(tmp_path) -> Iterator[tuple[MlflowServer, list[int]]]:
    """A fresh server on PostgreSQL, 4 workers, as docs/fleet.md deploys one: (the server, the pids
    whose process trees are its CPU)."""
    (tmp_path / "server").mkdir()
    if (why := Postgres.unavailable()) is not None:
        pytest.fail(f"PostgreSQL is needed here ({why}); ./run-tests installs it")
    postgres = Postgres().start()
    try:
        uri = postgres.create_database(f"fleet_{uuid.uuid4().hex[:8]}")
        with MlflowServer(tmp_path / "server", backend_uri=uri, workers=4) as server:
            yield server, [server.process.pid, postgres.pid]
    finally:
        postgres.stop()


def test_a_big_jobs_first_and_last_windows(server, tmp_path) -> None:
    mlflow_server, pids = server
    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment(f"fleet-{uuid.uuid4().hex[:8]}")
    job_run = client.create_run(experiment_id, run_name="fleet-job").info.run_id
    job = argparse.Namespace(fleet=FLEET)
    envs = [{**node_env(i, job, "job-1", tmp_path), "MLFLOW_EXPERIMENT_ID": experiment_id} for i in range(AGENTS)]
    # The test watches what the server accepted through a proxy: its own reads would cost the server CPU.
    proxy = MlflowProxy(mlflow_server.uri)
    cpu_before = sum(tree_cpu_s(pid) for pid in pids)

    cores = CoresLeft([os.getpid(), pids[1]])
    started = time.monotonic()
    agents = [_start(ours_command(job_run, proxy.uri, i, None), env, tmp_path / f"node_{i}.log")
              for i, env in enumerate(envs)]  # fmt: skip
    try:
        first = _wait(lambda: len({body["run_id"] for body in proxy.accepted(LOG_BATCH)}) >= AGENTS, START_S + 60)
        agents_cpu_s, (ours_s, cores_left) = sum(tree_cpu_s(agent.pid) for agent in agents), cores.used()
        bound_s = max(START_S, ours_s / cores_left + 10)
        assert first is not None and first - started <= bound_s, (first and first - started, bound_s, _logs(tmp_path))
        print(f"every node run held a window {first - started:.1f} s after the start (the agents' CPU then "
              f"{agents_cpu_s:.1f} s, the test's {ours_s:.1f} s, {cores_left:.2f} cores left to it)")  # fmt: skip
        time.sleep(max(0.0, started + HOLD_S - time.monotonic()))
    finally:
        stopped = time.monotonic()
        for agent in agents:
            os.killpg(agent.pid, signal.SIGTERM)
        codes = [agent.wait(STOP_S) for agent in agents]
    assert codes == [0] * AGENTS, _logs(tmp_path)

    # The next job on these nodes: its agent delivers what the closing ones could not.
    next_env = {**node_env(0, job, "job-2", tmp_path), "MLFLOW_EXPERIMENT_ID": experiment_id}
    next_run = client.create_run(experiment_id, run_name="next-job").info.run_id
    next_agent = _start(ours_command(next_run, proxy.uri, 0, None), next_env, tmp_path / "next.log")
    try:
        done = _wait(lambda: _finished(proxy) >= AGENTS and not spooled(tmp_path / "spool"), STOP_S)
        cpu_ms = (sum(tree_cpu_s(pid) for pid in pids) - cpu_before) * 1000
    finally:
        os.killpg(next_agent.pid, signal.SIGTERM)
        next_agent.wait(STOP_S)
        proxy.close()
    assert done is not None and done - stopped <= STOP_S, (_statuses(client, experiment_id, job_run), _logs(tmp_path))

    runs = _node_runs(client, experiment_id, job_run)
    assert sorted(runs) == sorted(f"node_{i}" for i in range(AGENTS))
    for node, run in runs.items():
        history = client.get_metric_history(
            run.info.run_id, min(k for k in run.data.metrics if k.startswith("system/"))
        )
        steps = sorted(m.step for m in history)
        assert run.info.status == "FINISHED" and steps == list(range(len(steps))) and len(steps) >= 2, (node, steps)
    per_node_minute = cpu_ms / (AGENTS * (done - started) / 60)
    print(f"server CPU {cpu_ms:.0f} ms, {per_node_minute:.1f} ms per node-minute")


class CoresLeft:
    """The CPU the process trees of ``roots`` used since this was made, and the cores left to them
    meanwhile: the machine's, less what other processes used (the kernel's counters: no other
    process is looked at)."""

    def __init__(self, roots: list[int]) -> None:
        self._roots = roots
        self._began = (time.monotonic(), _machine_busy_s(), self._ours_s())

    def used(self) -> tuple[float, float]:
        """(CPU seconds used by the trees, cores left to them), since this was made."""
        began_at, busy_before, ours_before = self._began
        ours_s = self._ours_s() - ours_before
        others_s = max(_machine_busy_s() - busy_before - ours_s, 0.0)
        cores = float(os.cpu_count() or 1)
        return ours_s, max(cores - others_s / max(time.monotonic() - began_at, 1e-3), 0.5)

    def _ours_s(self) -> float:
        return sum(tree_cpu_s(pid) for pid in self._roots)


def _machine_busy_s() -> float:
    """The CPU seconds the cores spent busy since boot, or taken by the hypervisor (steal)."""
    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(done: Any, timeout_s: float) -> float | None:
    """When ``done()`` first held (time.monotonic()), polling every second; None after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if done():
            return time.monotonic()
        time.sleep(1.0)
    return None


def _node_runs(client: MlflowClient, experiment_id: str, job_run: str) -> dict[str, Any]:
    found = client.search_runs([experiment_id], f"tags.`{PARENT_TAG}` = '{job_run}'", max_results=1000)
    return {run.data.tags.get(NODE_TAG): run for run in found}


def _finished(proxy: MlflowProxy) -> int:
    """Node runs the server ended FINISHED (the next job's agent's own run is not ended yet)."""
    return len({body["run_id"] for body in proxy.accepted(UPDATE_RUN) if body.get("status") == "FINISHED"})


def _statuses(client: MlflowClient, experiment_id: str, job_run: str) -> dict[str, str]:
    return {node: run.info.status for node, run in _node_runs(client, experiment_id, job_run).items()}


def _logs(directory: Path) -> str:
    """The agents' warnings, for a failure's message."""
    lines = [
        f"{log.name}: {line}"
        for log in sorted(directory.glob("*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "WARNING" in line or "Error" in line
    ]
    return "\n".join(lines[-40:])
