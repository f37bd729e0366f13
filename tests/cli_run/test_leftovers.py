"""What a job's agents could not deliver at their stop reaches MLflow without a command: the next
otel-forge process on the node delivers it in the background, and ends the node runs.

Against a real ``mlflow server`` behind the counting proxy: agents of a job with node runs, while the
server fails every call, one stopped (SIGTERM: its last window kept) and one SIGKILLed (no last
window); then the server answers, and two agents of the next job start on the same machine at once."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from run_reading import anchor_steps

from otel_forge.mlflow.leftovers import LeftoverDelivery
from testkit.hermetic import fail_fast_http, hermetic_environ
from testkit.proxy import LOG_BATCH, MlflowProxy, Mode
from testkit.servers import REPO_ROOT, free_port, wait_for

PARENT_TAG, NODE_TAG = "mlflow.parentRunId", "otel_forge.node.id"


def _agent(run_id: str, experiment_id: str, uri: str, node: str, root: Path) -> subprocess.Popen[str]:
    env = hermetic_environ(
        {"OTEL_FORGE_SPOOL_DIR": str(root), "OTEL_FORGE_NODE_RUNS_ABOVE": "0", "OTEL_FORGE_DRAIN_DEADLINE": "1",
         "MLFLOW_EXPERIMENT_ID": experiment_id, "PYTHONPATH": str(REPO_ROOT)},
        prefixes=("OTEL_", "MLFLOW_"),
    )  # fmt: skip
    command = [sys.executable, "-m", "otel_forge.cli", "monitor", "--run-id", run_id, "--tracking-uri", uri,
               "--interval", "0.3", "--no-prometheus", "--collectors", "cpu,memory", "--node-id", node]  # fmt: skip
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _windows(root: Path, node: str) -> int:
    return len(_window_files(root, node))


def _window_files(root: Path, node: str) -> list[Path]:
    return [file for spool in root.glob(f"*-{node}-*") for file in spool.glob("*.window.json")]


def _steps_kept(root: Path, node: str) -> list[int]:
    """The steps of the windows the node's spool keeps (its first step is 0: nothing was delivered)."""
    return sorted({json.loads(file.read_text())["index"] for file in _window_files(root, node)})


def _node_runs(client: Any, experiment_id: str, job_run: str) -> dict[str, Any]:
    found = client.search_runs([experiment_id], f"tags.`{PARENT_TAG}` = '{job_run}'")
    return {run.data.tags.get(NODE_TAG): run for run in found}


def test_the_next_agent_on_the_node_delivers_what_stopped_agents_left(mlflow_server, client, tmp_path):
    root = tmp_path / "spool"
    experiment_id = client.create_experiment(f"leftovers-{tmp_path.name}")
    job_run = client.create_run(experiment_id).info.run_id
    with MlflowProxy(mlflow_server.uri) as proxy:
        proxy.set_mode(Mode.ERROR_500)
        stopped, killed = (
            _agent(job_run, experiment_id, proxy.uri, node, root) for node in ("node_stopped", "node_killed")
        )
        wait_for(lambda: min(_windows(root, n) for n in ("node_stopped", "node_killed")) >= 3, 60, 0.1, "spooled")
        killed.send_signal(signal.SIGKILL)
        stopped.send_signal(signal.SIGTERM)
        _, stderr = stopped.communicate(timeout=60)
        killed.wait(10)
        assert stopped.returncode == 0 and "were not delivered" in stderr, stderr
        left = {node: _steps_kept(root, node) for node in ("node_stopped", "node_killed")}

        proxy.set_mode(Mode.PASS)
        proxy.reset()  # from here on, what reaches the server
        # The next job's agents on this machine, started together: each spool is delivered once.
        next_agents = [_agent(job_run, experiment_id, proxy.uri, node, root) for node in ("node_next_0", "node_next_1")]
        try:
            wait_for(lambda: not any(_windows(root, n) for n in left), 90, 0.2, "the leftovers delivered")
            wait_for(
                lambda: _ended(client, experiment_id, job_run, left),
                30,
                0.2,
                lambda: f"the node runs ended: {_statuses(client, experiment_id, job_run)}",
            )
        finally:
            for agent in next_agents:
                agent.send_signal(signal.SIGTERM)
            for agent in next_agents:
                agent.communicate(timeout=60)

    runs = _node_runs(client, experiment_id, job_run)
    assert runs["node_stopped"].info.status == "FINISHED"  # its last window, kept at the stop, ends it
    assert runs["node_killed"].info.status == "KILLED"  # no last window: its agent died
    for node, kept in left.items():
        assert anchor_steps(client, runs[node].info.run_id) == kept == list(range(len(kept))), node
    # Nothing sent twice: each value of the left nodes reached the server once.
    left_runs = {runs[node].info.run_id for node in left}
    sent = [
        (body["run_id"], metric["key"], metric["step"])
        for _, _, body in proxy.requests(LOG_BATCH)
        if body["run_id"] in left_runs
        for metric in body.get("metrics", [])
    ]
    assert sent and len(sent) == len(set(sent))


def _ended(client: Any, experiment_id: str, job_run: str, nodes: dict[str, int]) -> bool:
    runs = _node_runs(client, experiment_id, job_run)
    return all(node in runs and runs[node].info.status != "RUNNING" for node in nodes)


def _statuses(client: Any, experiment_id: str, job_run: str) -> dict[str, str]:
    return {node: run.info.status for node, run in _node_runs(client, experiment_id, job_run).items()}


LEAVE_A_JOURNAL = """
from otel_forge import ForgeConfig, TrainingRun
with TrainingRun(tracking_uri={uri!r}, experiment="gone", system_metrics=False,
                 forge_config=ForgeConfig.resolve(start_wait_s=0)) as run:
    run.log({{"loss": 1.0}}, step=0)
"""


def test_a_spool_whose_server_is_gone_is_kept_quietly_by_every_later_start(tmp_path, caplog, monkeypatch):
    """The process that could not deliver says so once (a WARNING with the replay command); a later
    process's background delivery that fails again says so at INFO only, so a user's every later job
    does not warn about a server that is gone."""
    root, dead = tmp_path / "spool", f"http://127.0.0.1:{free_port()}"
    fail_fast_http(monkeypatch, 5)
    env = hermetic_environ(
        {"OTEL_FORGE_SPOOL_DIR": str(root), "OTEL_FORGE_DELIVERY_PATIENCE": "1", "PYTHONPATH": str(REPO_ROOT)},
    )
    first = subprocess.run(
        [sys.executable, "-c", LEAVE_A_JOURNAL.format(uri=dead)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert first.returncode == 0 and "WARNING" in first.stderr and "otel-forge replay" in first.stderr, first.stderr
    (journal,) = root.glob("journal-*")

    caplog.set_level(logging.INFO, logger="otel_forge")
    LeftoverDelivery(root, "next-job", spread_s=0.0).start()
    wait_for(lambda: "is kept" in caplog.text, 60, 0.1, lambda: f"the leftover tried: {caplog.text}")
    ours = [record for record in caplog.records if record.name.startswith("otel_forge")]
    assert [record for record in ours if record.levelno >= logging.WARNING] == [], caplog.text
    assert journal.exists() and f"{journal} is kept (" in caplog.text
