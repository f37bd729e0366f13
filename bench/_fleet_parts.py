"""What both modes of ``bench.fleet`` share: the tracking server and its CPU, PostgreSQL, what reached the
server (read from the counting proxy), the simulated nodes and their processes."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import REPO_ROOT, tree_cpu_s
from testkit.gpu_fakes import fake_gpu_env
from testkit.hermetic import hermetic_environ
from testkit.mlflow_server import MlflowServer
from testkit.postgres import Postgres
from testkit.proxy import MlflowProxy

DEFAULT_INTERVAL_S = 10.0  # otel_forge's and MLflow's default sampling interval
GPUS = 8
COLLECTORS = "cpu,memory,disk,network,process,nvidia"
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
# The tag an agent's first call into a run carries: which host node <id>'s keys sample (a node run's
# keys name no node, so this tells the bench which node a node run is before any read).
NODE_HOST_TAG = re.compile(r"otel_forge\.node\.(.+)\.host")


# --- the server's CPU ------------------------------------------------------------------------------


@dataclass
class CpuMeter:
    """The CPU seconds of the tracking server's process tree and of its database's (PostgreSQL)."""

    server_pid: int
    database_pid: int | None = None

    def read(self) -> dict[str, float]:
        server, database = tree_cpu_s(self.server_pid), tree_cpu_s(self.database_pid)
        return {"server": server, "database": database, "total": server + database}


def cpu_delta_ms(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: (after[name] - before[name]) * 1e3 for name in after}


# --- servers ----------------------------------------------------------------------------------------


# --- what reached the server ---------------------------------------------------------------------------


@dataclass
class NodeLog:
    """One node's windows as they reached the server. ``run_id`` and ``prefix``: where its keys are (the
    job's run and ``system/<node>/``, or the node's own run and ``system/``)."""

    run_id: str
    prefix: str
    steps: set[int] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)  # without the prefix
    newest_ms: int = 0  # the newest window timestamp seen

    @property
    def anchor(self) -> str:
        """The node's smallest key, in every window it sends (otel_forge and MLflow alike)."""
        return self.prefix + min(self.keys)


@dataclass
class Call:
    path: str
    rows: int = 0
    windows: frozenset[tuple[str, int]] = frozenset()  # (node, step) pairs in a log-batch body


class Deliveries:
    """Reads the proxy's requests as they arrive: calls by path, rows and windows per node.

    A node's keys are ``system/<node>/<key>`` in the job's run, or ``system/<key>`` in the node's own
    run, which the tag of the agent's first call there names (``otel_forge.node.<node>.host``)."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.calls: list[Call] = []
        self.nodes: dict[str, NodeLog] = {}
        self.run_nodes: dict[str, str] = {}  # a node run's id -> its node

    def poll(self) -> int:
        """Take in the requests that arrived since the last poll; how many arrived in all."""
        for _, path, body in self.proxy.requests()[len(self.calls) :]:
            self.calls.append(self._take(path, body))
        return len(self.calls)

    def _take(self, path: str, body: Any) -> Call:
        if path != LOG_BATCH or not isinstance(body, dict):
            return Call(path)
        run_id = str(body.get("run_id", ""))
        for tag in body.get("tags") or []:
            if found := NODE_HOST_TAG.fullmatch(str(tag.get("key", ""))):
                self.run_nodes.setdefault(run_id, found.group(1))
        windows = set()
        metrics = body.get("metrics") or []
        for metric in metrics:
            parts = str(metric.get("key", "")).split("/")
            if len(parts) < 2 or parts[0] != "system":
                continue
            if len(parts) == 2:  # a node run's system/<key>
                node, prefix = self.run_nodes.get(run_id, run_id), "system/"
            else:
                node, prefix = parts[1], f"system/{parts[1]}/"
            step, timestamp = int(metric.get("step", 0)), int(metric.get("timestamp", 0))
            log = self.nodes.setdefault(node, NodeLog(run_id, prefix))
            log.steps.add(step)
            log.keys.add(str(metric["key"])[len(prefix) :])
            log.newest_ms = max(log.newest_ms, timestamp)
            windows.add((node, step))
        return Call(path, len(metrics), frozenset(windows))

    def between(self, start: int, end: int | None = None) -> dict[str, Any]:
        calls = self.calls[start:end]
        windows = set().union(*(call.windows for call in calls))
        return {
            "windows": len(windows),
            "rows": sum(call.rows for call in calls),
            "calls": dict(Counter(short_path(call.path) for call in calls)),
        }

    def nodes_with(self, windows: int) -> int:
        return sum(1 for log in self.nodes.values() if len(log.steps) >= windows)

    def keys_per_node(self) -> int:
        return max((len(log.keys) for log in self.nodes.values()), default=0)

    def gpus_seen(self) -> int:
        """GPUs whose metrics reached the server (``gpu_<i>_...`` keys), the most of any node."""
        return max(
            (len({key.split("_")[1] for key in log.keys if key.startswith("gpu_")}) for log in self.nodes.values()),
            default=0,
        )


def short_path(path: str) -> str:
    """``runs/log-batch`` for ``/api/2.0/mlflow/runs/log-batch``."""
    return path.rsplit("/mlflow/", 1)[-1]


def stored_steps(client: Any, deliveries: Deliveries) -> dict[str, dict[int, int]]:
    """Per node, step -> timestamp (ms) of what the server holds: the history of the node's anchor key."""
    return {
        node: {m.step: m.timestamp for m in client.get_metric_history(log.run_id, log.anchor)}
        for node, log in deliveries.nodes.items()
    }


def error_answers(proxy: Any) -> dict[str, int]:
    return dict(Counter(f"{status} {short_path(path)}" for _, _, path, status in proxy.log() if status >= 400))


def spooled(spool_root: Path) -> int:
    """Windows otel_forge's agents left in their spools (undelivered, kept for ``otel-forge replay``)."""
    return sum(1 for _ in spool_root.rglob("*.window.json")) if spool_root.is_dir() else 0


# --- the nodes -----------------------------------------------------------------------------------------


def node_env(i: int, args: argparse.Namespace, job_id: str, tmp: Path) -> dict[str, str]:
    """Hermetic, 8 fake GPUs, SLURM's variables of node i of a ``--fleet``-node job, its own spool."""
    env = hermetic_environ(
        {
            "PYTHONPATH": str(REPO_ROOT),
            "TMPDIR": str(tmp),
            "OTEL_FORGE_SPOOL_DIR": str(tmp / "spool"),
            "SLURM_JOB_ID": job_id,
            "SLURM_STEP_ID": "0",
            "SLURM_JOB_NUM_NODES": str(args.fleet),
            "SLURM_NNODES": str(args.fleet),
            "SLURM_NTASKS": str(args.fleet),
            "SLURM_NODEID": str(i),
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": "0",
        }
    )
    return fake_gpu_env({"count": GPUS}, base=env)


def ours_command(run_id: str, uri: str, i: int, interval_s: float | None) -> list[str]:
    """``otel-forge monitor`` of node i; ``interval_s`` None: the default interval (not passed)."""
    interval = [] if interval_s is None else ["--interval", f"{interval_s:g}"]
    return [
        sys.executable,
        "-m",
        "otel_forge.cli",
        "monitor",
        "--run-id",
        run_id,
        "--tracking-uri",
        uri,
        "--node-id",
        f"node_{i}",
        "--no-prometheus",
        "--collectors",
        COLLECTORS,
        *interval,
    ]


def doctor(args: argparse.Namespace, tmp: Path) -> dict[str, int]:
    """otel_forge's effective ``samples_per_window`` and ``node_runs_above`` for this job, as ``otel-forge
    doctor --json`` resolves them with node 0's environment."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_forge.cli",
            "doctor",
            "--json",
            "--no-prometheus",
            "--collectors",
            COLLECTORS,
            "--interval",
            f"{args.interval:g}",
            "--node-id",
            "node_0",
        ],
        env=node_env(0, args, "doctor", tmp),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"otel-forge doctor failed: {done.stderr[-2000:]}")
    config = json.loads(done.stdout)["config"]
    return {name: int(config[name]["value"]) for name in ("samples_per_window", "node_runs_above")}


class Fleet:
    """K node processes, each in its own process group, output to a log file each."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.processes: list[subprocess.Popen] = []
        self.killed = 0

    def start(self, commands: list[list[str]], envs: list[dict[str, str]]) -> None:
        for i, (command, env) in enumerate(zip(commands, envs, strict=False)):
            with open(self.tmp / f"node_{i}.log", "wb") as log:
                self.processes.append(
                    subprocess.Popen(
                        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO_ROOT
                    )
                )

    def exited(self) -> list[int]:
        return [i for i, process in enumerate(self.processes) if process.poll() is not None]

    def log_tail(self, i: int) -> str:
        return (self.tmp / f"node_{i}.log").read_text(errors="replace")[-2000:]

    def cpu_s(self) -> float:
        """User + system seconds of the live nodes' process trees (each with its reaped children)."""
        return sum(tree_cpu_s(process.pid) for process in self.processes if process.poll() is None)

    def messages(self, most: int = 8) -> dict[str, int]:
        """The agents' warnings and errors (lines of their output that say WARNING, ERROR or Traceback),
        numbers and ids blanked so that the nodes' lines count together: the most frequent."""
        lines: Counter[str] = Counter()
        for i in range(len(self.processes)):
            for line in (self.tmp / f"node_{i}.log").read_text(errors="replace").splitlines():
                if any(word in line for word in ("WARNING", "ERROR", "Traceback")):
                    lines[re.sub(r"[0-9a-f]{32}|\d+", "#", line)[:300]] += 1
        return dict(lines.most_common(most))

    def _signal(self, process: subprocess.Popen, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)

    def stop(self, timeout_s: float) -> list[int]:
        """SIGTERM every group, wait for their drain, SIGKILL what is left; the exit codes."""
        for process in self.processes:
            if process.poll() is None:
                self._signal(process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.killed += 1
                self._signal(process, signal.SIGKILL)  # its group: the node and anything it started
        for process in self.processes:
            process.wait(30)
        return [process.returncode for process in self.processes]


# --- the server ------------------------------------------------------------------------------------


class BackendUnavailable(RuntimeError):
    """The PostgreSQL-backed server could not be set up: its rows are skipped, the bench goes on."""


def start_postgres(postgres: Postgres) -> str | None:
    """Start the cluster; why it did not, else None."""
    try:
        postgres.start()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        return f"PostgreSQL did not start: {str(error).strip()[-500:]}"
    return None


def start_server(
    backend: str, tmp: Path, name: str, postgres: Postgres | None, pg_workers: int
) -> tuple[MlflowServer, CpuMeter]:
    """A fresh ``mlflow server`` (sqlite: one worker; postgresql: a fresh database, ``pg_workers``) and the
    meter of its CPU."""
    (tmp / "server").mkdir()
    if backend == "sqlite":
        server = MlflowServer(tmp / "server").start()
        assert server.process is not None
        return server, CpuMeter(server.process.pid)
    assert postgres is not None
    try:
        uri = postgres.create_database(f"fleet_{name}_{uuid.uuid4().hex[:8]}")
        server = MlflowServer(tmp / "server", backend_uri=uri, workers=pg_workers).start()
    except Exception as error:  # the driver's own errors too: whatever it is, that backend is out
        raise BackendUnavailable(f"mlflow server on PostgreSQL did not start: {str(error).strip()[-500:]}") from error
    assert server.process is not None
    return server, CpuMeter(server.process.pid, postgres.pid)


def server_messages(server: MlflowServer, most: int = 6) -> dict[str, int]:
    """The server's errors (lines of its output that name an exception or an error code), numbers and ids
    blanked: the most frequent."""
    log = server.root / "server.log"
    lines: Counter[str] = Counter()
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        if re.search(r"Error|Exception|error_code|Traceback", line):
            lines[re.sub(r"[0-9a-f]{32}|\d+", "#", line.strip())[:300]] += 1
    return dict(lines.most_common(most))


def reaped_cpu_s() -> float:
    """User + system seconds of this process's children it has waited for (their reaped children included)."""
    times = os.times()
    return times.children_user + times.children_system


def counting_proxy(uri: str) -> MlflowProxy:
    """testkit's counting proxy in front of ``uri``, quiet when a client hangs up."""
    proxy = MlflowProxy(uri)
    proxy._server.handle_error = lambda request, client_address: None  # type: ignore[method-assign]
    return proxy


def warm_up(client: Any, uri: str, rounds: int = 16) -> None:
    """The calls the nodes make, into a throwaway run, each on a new connection so that every worker of the
    server sees them: the server's first-call costs (imports, compiled queries) are not the nodes' start."""
    experiment_id = client.create_experiment(f"fleet-warm-up-{uuid.uuid4().hex[:8]}")
    run_id = client.create_run(experiment_id).info.run_id
    now = int(time.time() * 1000)
    for step in range(rounds):
        metrics = [
            {"key": f"system/warm/key_{i}", "value": float(i + step), "timestamp": now, "step": step} for i in range(50)
        ]
        call(f"{uri}{LOG_BATCH}", {"run_id": run_id, "metrics": metrics})
        call(f"{uri}/api/2.0/mlflow/runs/get?run_id={run_id}")
        call(f"{uri}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=system/warm/key_0")
        search = f"tags.`mlflow.parentRunId` = '{run_id}' AND tags.`otel_forge.node.id` = 'node_{step}'"
        call(f"{uri}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id], "filter": search})


def call(url: str, body: dict[str, Any] | None = None) -> bytes:
    """One REST call on a new connection; the answer's body."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return bytes(response.read())
