"""Fleet scale: what a job's nodes cost ONE tracking server, otel_forge's agent vs MLflow's own monitor.

Run:  python -m bench.fleet [--nodes 16] [--fleet 2048] [--interval 0.5] [--seconds 60]
                            [--backend sqlite|postgresql|both] [--anchor/--no-anchor] [--json]
      (~3.5 min at these defaults; --backend both about doubles it)

Setup, per subject and backend (a fresh server and a fresh run each, so neither subject pays for the
other's rows): a private ``mlflow server`` on 127.0.0.1 (sqlite: testkit.mlflow_server.MlflowServer, one
worker; postgresql: a PostgreSQL cluster the bench starts with ``initdb``/``pg_ctl`` in a temp dir on a
free 127.0.0.1 port, run as user ``postgres`` when the bench is root, a fresh database per subject,
``mlflow server --workers 4``), warmed up with a few calls into a throwaway run; one counting proxy in
front of it (testkit.proxy.MlflowProxy: forwards every request, keeps its path and JSON body); a run created
with ``MlflowClient``; then K simulated nodes started together, each in its own process group:

- ``otel_forge``: ``python -m otel_forge.cli monitor --run-id RUN --tracking-uri PROXY --node-id node_<i>
  --no-prometheus --collectors cpu,memory,disk,network,process,nvidia --interval <compressed>``,
  ``--samples-per-window`` left at its default, ``MLFLOW_EXPERIMENT_ID`` set as README's "plain way"
  hands it out (so a node never reads the run; MLflow's monitor gets it too and reads the run anyway);
- ``mlflow`` (the anchor): MLflow's ``mlflow.system_metrics.system_metrics_monitor.SystemMetricsMonitor``
  (``node_id=node_<i>``, ``samples_before_logging=1``, sampling interval compressed the same way) in a
  process of its own, until SIGTERM, then ``finish()``.

Every node: 8 fake NVIDIA GPUs (tests/fakes/pynvml.py through ``fake_gpu_env({"count": 8})``; MLflow's GPU
monitor imports the same fake), a hermetic environment (testkit/hermetic.py) plus SLURM's variables of a
job of ``--fleet`` nodes (``SLURM_JOB_NUM_NODES``) in which it is node i, its spool in a temp dir.

Time compression: both tools sample every 10 s by default and log one step per window, a window being
``samples_per_window`` samples (otel_forge's default, read from ``otel-forge doctor --json`` run with the
nodes' environment, since it depends on the job's node count) or 1 sample (MLflow's
``samples_before_logging`` default). The bench samples every ``--interval`` s (0.5 s by default, 20x
faster), so windows come 20x as often. What a window costs the server does not depend on how long it
lasted, so the cost is measured per window and scaled back to the defaults:

    ms per node-minute at defaults = server CPU ms per window x 60 / (10 s x samples_per_window)
    nodes per server core = 60,000 ms / ms per node-minute

One rule of MLflow's depends on time: ``BatchMetricsLogger`` logs once the time between its calls is at
least 10x the time its ``log_batch`` calls took. At 10 s it logs every window; at 0.5 s a slow server
makes it gather several windows per call, which would flatter the anchor. By default (``--anchor-flush
scaled``) the anchor's processes apply the rule to uncompressed time (time between calls x 10 s /
interval); ``--anchor-flush as-is`` leaves MLflow's rule on the compressed clock.

What is measured, per subject and backend:

- server CPU: user + system seconds of the server's process tree (the ``mlflow server`` process, its
  uvicorn workers; with PostgreSQL also the postmaster and its backends), each process counted with its
  reaped children (psutil ``cpu_times``), so exited workers and backends are not lost;
- steady state: after every node's first window and ``--warmup-windows`` more, server CPU over
  ``--seconds`` s divided by the windows (distinct node x step pairs in ``log-batch`` bodies) that
  reached the proxy in that time; ``log-batch`` calls, other calls (e.g. MLflow's ``runs/get`` every
  sample) and metric rows per window are counted by the proxy over the same requests;
- start cost per node: server CPU from the nodes' start until every node's first window was answered,
  less the steady cost of the later windows early nodes delivered meanwhile, divided by K (the raw figure,
  the calls made meanwhile and the server's idle CPU/s, measured before the nodes start, are given apart);
- delivered / expected: windows in the period over K x seconds / window length: a node's timer drift
  (both tools wait one interval after each sample's work), a node that fell behind or stopped;
- lag at the end: at the end of the period, the age of each node's newest window timestamp that reached
  the proxy (max over nodes; a window is stamped at its end; otel_forge spreads each node's delivery
  over the next window, so up to 2 windows is on time);
- windows not delivered: after SIGTERM and the nodes' own drain, read back from the run (the history of
  each node's smallest key, which both tools log every window): steps missing below a node's last step,
  plus windows due before the stop that never came (more than 2 windows, at the pace the node delivered,
  between its newest stored window and the stop); windows otel_forge left in its spools, and error answers,
  are given apart.

Caveats: the proxy opens one upstream connection per request where the clients would keep theirs alive,
a small cost per call for both subjects. The run holds K nodes' keys, not ``--fleet`` nodes': a cost
that grows with the run (MLflow's ``runs/get`` every sample returns every latest metric of the run) is
measured at K. The nodes share the machine with the server: where they saturate its cores, lag and
delivered / expected show it (a note says so), the server's CPU seconds per window much less. The fake
GPUs' values are deterministic and repeat with short periods (tests/fakes/pynvml.py); the host's own
CPU, memory, disk and network values are this machine's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import pwd
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench._common import REPO_ROOT, wait_until
from testkit.gpu_fakes import fake_gpu_env
from testkit.hermetic import hermetic_environ
from testkit.mlflow_server import MlflowServer
from testkit.proxy import MlflowProxy
from testkit.servers import free_port

DEFAULT_INTERVAL_S = 10.0  # otel_forge's and MLflow's default sampling interval
MLFLOW_SAMPLES_BEFORE_LOGGING = 1  # MLflow's default, and what the anchor uses
GPUS = 8
COLLECTORS = "cpu,memory,disk,network,process,nvidia"
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
TAIL_SLACK_WINDOWS = 2  # a node's newest window may be this old at the stop without counting as missing

ANCHOR = r"""
import json, signal, sys, threading
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from mlflow.utils.autologging_utils import BatchMetricsLogger
run_id, uri, node_id = sys.argv[1:4]
interval, time_scale = float(sys.argv[4]), float(sys.argv[5])
if time_scale != 1 and hasattr(BatchMetricsLogger, "_should_flush"):
    # MLflow's rule (flush once the time between calls is 10x the time spent logging) on uncompressed time.
    BatchMetricsLogger._should_flush = (
        lambda self: self.total_training_time * time_scale >= self.total_log_batch_time * 10)
stop = threading.Event()
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
monitor = SystemMetricsMonitor(run_id, sampling_interval=interval, samples_before_logging=1, node_id=node_id,
                               tracking_uri=uri)
print(json.dumps({"monitors": [type(m).__name__ for m in monitor.monitors]}), flush=True)
monitor.start()
stop.wait()
monitor.finish()
"""


# --- the server's CPU ------------------------------------------------------------------------------


def tree_cpu_s(root_pid: int | None) -> float:
    """User + system seconds of a process and its descendants, each with its reaped children."""
    if root_pid is None:
        return 0.0
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            t = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


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


@functools.cache
class Postgres:
    """A throwaway PostgreSQL cluster on 127.0.0.1 (as user ``postgres`` when the bench runs as root)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="fleet-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.pid: int | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    @staticmethod
    def unavailable() -> str | None:
        """Why PostgreSQL cannot run here, else None."""
        missing = [tool for tool in ("initdb", "pg_ctl") if shutil.which(tool) is None]
        if missing:
            return f"{' and '.join(missing)} not on PATH"
        if Postgres.driver() is None:
            return (
                "neither psycopg2 nor psycopg is importable (`pip install psycopg2-binary`): mlflow server "
                "needs one to reach PostgreSQL"
            )
        if os.geteuid() == 0:
            if shutil.which("runuser") is None:
                return "running as root and no runuser to run PostgreSQL as another user"
            try:
                pwd.getpwnam("postgres")
            except KeyError:
                return "running as root and there is no 'postgres' user to run PostgreSQL as"
        return None

    @staticmethod
    def driver() -> str | None:
        """The PostgreSQL driver to name in the store URI (SQLAlchemy 2.1's default is psycopg 3)."""
        return next((name for name in ("psycopg2", "psycopg") if importlib.util.find_spec(name) is not None), None)

    def _run(self, *command: str) -> None:
        done = subprocess.run(
            [*self._as, *command],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
            start_new_session=True,
            cwd=self.root,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{command[0]} failed: {(done.stdout + done.stderr)[-2000:]}")

    def start(self) -> Postgres:
        self._run(
            shutil.which("initdb") or "initdb",
            "-D",
            str(self.data),
            "-U",
            "mlflow",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        options = f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} -c max_connections=200"
        self._run(
            shutil.which("pg_ctl") or "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.root / "postgres.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        return self

    def create_database(self, name: str) -> str:
        """A fresh database; its store URI."""
        driver = self.driver()
        module = importlib.import_module(driver or "psycopg2")
        connection = module.connect(host="127.0.0.1", port=self.port, user="mlflow", dbname="postgres")
        try:
            connection.autocommit = True
            with connection.cursor() as cursor:
                cursor.execute(f"CREATE DATABASE {name}")
        finally:
            connection.close()
        return f"postgresql+{driver}://mlflow@127.0.0.1:{self.port}/{name}"

    def stop(self) -> None:
        if self.pid is not None:
            try:
                self._run(shutil.which("pg_ctl") or "pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")
            except (RuntimeError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
            self.pid = None
        shutil.rmtree(self.root, ignore_errors=True)


# --- what reached the server ---------------------------------------------------------------------------


@dataclass
class NodeLog:
    steps: set[int] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    newest_ms: int = 0  # the newest window timestamp seen


@dataclass
class Call:
    path: str
    rows: int = 0
    windows: frozenset[tuple[str, int]] = frozenset()  # (node, step) pairs in a log-batch body


class Deliveries:
    """Reads the proxy's requests as they arrive: calls by path, rows and windows per node."""

    def __init__(self, proxy: Any) -> None:
        self.proxy = proxy
        self.calls: list[Call] = []
        self.nodes: dict[str, NodeLog] = {}

    def poll(self) -> int:
        """Take in the requests that arrived since the last poll; how many arrived in all."""
        for _, path, body in self.proxy.requests()[len(self.calls) :]:
            self.calls.append(self._take(path, body))
        return len(self.calls)

    def _take(self, path: str, body: Any) -> Call:
        if path != LOG_BATCH or not isinstance(body, dict):
            return Call(path)
        windows = set()
        metrics = body.get("metrics") or []
        for metric in metrics:
            parts = str(metric.get("key", "")).split("/")
            if len(parts) < 3 or parts[0] != "system":
                continue
            node, step, timestamp = parts[1], int(metric.get("step", 0)), int(metric.get("timestamp", 0))
            log = self.nodes.setdefault(node, NodeLog())
            log.steps.add(step)
            log.keys.add(parts[-1])
            log.newest_ms = max(log.newest_ms, timestamp)
            windows.add((node, step))
        return Call(path, len(metrics), frozenset(windows))

    def between(self, start: int, end: int) -> dict[str, Any]:
        calls = self.calls[start:end]
        windows = set().union(*(call.windows for call in calls))
        return {
            "windows": len(windows),
            "rows": sum(call.rows for call in calls),
            "calls": dict(Counter(call.path.rsplit("/mlflow/", 1)[-1] for call in calls)),
        }

    def nodes_with(self, windows: int) -> int:
        return sum(1 for log in self.nodes.values() if len(log.steps) >= windows)

    def keys_per_node(self) -> int:
        return max((len(log.keys) for log in self.nodes.values()), default=0)

    def gpus_seen(self) -> int:
        """GPUs whose metrics reached the run (``gpu_<i>_...`` keys of node_0)."""
        keys = self.nodes["node_0"].keys if "node_0" in self.nodes else set()
        return len({key.split("_")[1] for key in keys if key.startswith("gpu_")})


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


def ours_command(run_id: str, uri: str, i: int, interval_s: float) -> list[str]:
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
        "--interval",
        f"{interval_s:g}",
    ]


def anchor_command(run_id: str, uri: str, i: int, interval_s: float, flush_rule: str) -> list[str]:
    time_scale = DEFAULT_INTERVAL_S / interval_s if flush_rule == "scaled" else 1.0
    return [sys.executable, "-c", ANCHOR, run_id, uri, f"node_{i}", f"{interval_s:g}", f"{time_scale:g}"]


def samples_per_window(args: argparse.Namespace, tmp: Path) -> int:
    """otel_forge's effective default for this job, as ``otel-forge doctor --json`` resolves it."""
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
    return int(json.loads(done.stdout)["config"]["samples_per_window"]["value"])


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


# --- one subject on one backend ----------------------------------------------------------------------


@dataclass
class Context:
    """What every phase shares."""

    args: argparse.Namespace
    spw: int  # otel_forge's effective samples_per_window
    postgres: Postgres | None = None


def window_s(ctx: Context, subject: str) -> float:
    samples = ctx.spw if subject == "otel_forge" else MLFLOW_SAMPLES_BEFORE_LOGGING
    return ctx.args.interval * samples


class BackendUnavailable(RuntimeError):
    """The PostgreSQL-backed server could not be set up: its rows are skipped, the bench goes on."""


def start_server(ctx: Context, backend: str, tmp: Path, subject: str) -> tuple[Any, CpuMeter]:
    (tmp / "server").mkdir()
    if backend == "sqlite":
        server = MlflowServer(tmp / "server").start()
        return server, CpuMeter(server.process.pid)
    assert ctx.postgres is not None
    try:
        uri = ctx.postgres.create_database(f"fleet_{subject}_{uuid.uuid4().hex[:8]}")
        server = MlflowServer(tmp / "server", backend_uri=uri, workers=4).start()
    except Exception as error:  # the driver's own errors too: whatever it is, that backend is out
        raise BackendUnavailable(f"mlflow server on PostgreSQL did not start: {str(error).strip()[-500:]}") from error
    return server, CpuMeter(server.process.pid, ctx.postgres.pid)


def run_phase(ctx: Context, subject: str, backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"fleet-{subject}-") as directory:
        tmp = Path(directory)
        server, meter = start_server(ctx, backend, tmp, subject)
        proxy = MlflowProxy(server.uri)
        proxy._server.handle_error = lambda request, client_address: None  # quiet when a client hangs up
        fleet = Fleet(tmp)
        try:
            return measure(ctx, subject, backend, tmp, server, meter, proxy, fleet)
        finally:
            fleet.stop(5.0)
            proxy.close()
            server.stop()


def measure(
    ctx: Context, subject: str, backend: str, tmp: Path, server: Any, meter: CpuMeter, proxy: Any, fleet: Fleet
) -> dict[str, Any]:
    from mlflow import MlflowClient

    args, k, length_s = ctx.args, ctx.args.nodes, window_s(ctx, subject)
    client = MlflowClient(server.uri)
    experiment_id = client.create_experiment(f"fleet-{subject}")
    run_id = client.create_run(experiment_id, run_name=f"fleet-{subject}").info.run_id
    deliveries = Deliveries(proxy)
    warm_up(client, server.uri)
    idle_before, idle_at = meter.read(), time.monotonic()
    time.sleep(args.idle_seconds)
    idle_ms_per_s = cpu_delta_ms(meter.read(), idle_before)["total"] / (time.monotonic() - idle_at)

    if subject == "otel_forge":
        commands = [ours_command(run_id, proxy.uri, i, args.interval) for i in range(k)]
    else:
        commands = [anchor_command(run_id, proxy.uri, i, args.interval, args.anchor_flush) for i in range(k)]
    job_id = uuid.uuid4().hex[:8]
    started, cpu_start = time.monotonic(), meter.read()
    # As README's "plain way" hands them out: the run and its experiment (so no node reads the run).
    fleet.start(commands, [{**node_env(i, args, job_id, tmp), "MLFLOW_EXPERIMENT_ID": experiment_id} for i in range(k)])
    n_first = wait_windows(deliveries, fleet, proxy, k, 1, 120 + 3 * k)
    start_s, cpu_first = time.monotonic() - started, meter.read()

    wait_windows(deliveries, fleet, proxy, k, 1 + args.warmup_windows, 60 + 5 * args.warmup_windows * length_s)
    n0, cpu0, t0 = deliveries.poll(), meter.read(), time.monotonic()
    time.sleep(args.seconds)
    n1, cpu1, t1 = deliveries.poll(), meter.read(), time.monotonic()
    lags = [time.time() - log.newest_ms / 1e3 for log in deliveries.nodes.values()]
    exited_early = fleet.exited()

    stop_wall = time.time()
    exit_codes = fleet.stop(args.stop_timeout)
    wait_until(lambda: sum(proxy.counts().values()) >= proxy.total(), 30)
    deliveries.poll()
    stored = stored_steps(client, run_id, deliveries)
    period = deliveries.between(n0, n1)
    period_cpu = cpu_delta_ms(cpu1, cpu0)
    start_cpu = cpu_delta_ms(cpu_first, cpu_start)
    return summarize(
        ctx,
        subject,
        backend,
        {
            "period": period,
            "period_s": t1 - t0,
            "period_cpu_ms": period_cpu,
            "start_s": start_s,
            "start_cpu_ms": start_cpu,
            "start_windows": deliveries.between(0, n_first)["windows"],
            "start_calls": deliveries.between(0, n_first)["calls"],
            "idle_ms_per_s": idle_ms_per_s,
            "lags": lags,
            "window_s": length_s,
            "undelivered": undelivered(stored, k, stop_wall, length_s),
            "spooled": spooled(tmp / "spool"),
            "errors": dict(
                Counter(
                    f"{status} {path.rsplit('/mlflow/', 1)[-1]}" for _, _, path, status in proxy.log() if status >= 400
                )
            ),
            "exit_codes": exit_codes,
            "killed": fleet.killed,
            "exited_early": exited_early,
            "keys_per_node": deliveries.keys_per_node(),
            "gpus_seen": deliveries.gpus_seen(),
        },
    )


def wait_windows(deliveries: Deliveries, fleet: Fleet, proxy: Any, k: int, windows: int, timeout_s: float) -> int:
    """Until every node's ``windows``-th window has been answered (the requests that had arrived by then);
    raises if the nodes died or it timed out."""

    def ready() -> bool:
        if len(fleet.exited()) == k:
            raise RuntimeError(f"every node exited; node_0's output:\n{fleet.log_tail(0)}")
        return deliveries.poll() > 0 and deliveries.nodes_with(windows) >= k - len(fleet.exited())

    if not wait_until(ready, timeout_s, 0.05):
        raise RuntimeError(
            f"{k - deliveries.nodes_with(windows)} node(s) had not delivered {windows} window(s) "
            f"after {timeout_s:.0f} s; node_0's output:\n{fleet.log_tail(0)}"
        )
    arrived = deliveries.poll()
    wait_until(lambda: sum(proxy.counts().values()) >= arrived, 10, 0.02)  # answered, not only arrived
    return arrived


def warm_up(client: Any, uri: str, rounds: int = 16) -> None:
    """The calls the nodes make, into a throwaway run, each on a new connection so that every worker of the
    server sees them: the server's first-call costs (imports, compiled queries) are not the nodes' start."""
    run_id = client.create_run(client.create_experiment(f"fleet-warm-up-{uuid.uuid4().hex[:8]}")).info.run_id
    now = int(time.time() * 1000)
    for step in range(rounds):
        metrics = [
            {"key": f"system/warm/key_{i}", "value": float(i + step), "timestamp": now, "step": step} for i in range(50)
        ]
        _call(f"{uri}{LOG_BATCH}", {"run_id": run_id, "metrics": metrics})
        _call(f"{uri}/api/2.0/mlflow/runs/get?run_id={run_id}")
        _call(f"{uri}/api/2.0/mlflow/metrics/get-history?run_id={run_id}&metric_key=system/warm/key_0")


def _call(url: str, body: dict[str, Any] | None = None) -> None:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        response.read()


def stored_steps(client: Any, run_id: str, deliveries: Deliveries) -> dict[str, dict[int, int]]:
    """Per node, step -> timestamp (ms) of what the run holds: the history of the node's smallest key, which
    otel_forge sends every window and MLflow too (it sends every key every window)."""
    stored = {}
    for node, log in deliveries.nodes.items():
        history = client.get_metric_history(run_id, f"system/{node}/{min(log.keys)}")
        stored[node] = {m.step: m.timestamp for m in history}
    return stored


def undelivered(stored: dict[str, dict[int, int]], k: int, stop_wall: float, length_s: float) -> dict[str, int]:
    """Steps missing below each node's last stored step, and windows due before the stop that never came (at
    the node's own pace: a node slower than its interval is late, not dropping)."""
    gaps = tail = 0
    for steps in stored.values():
        if not steps:
            continue
        gaps += max(steps) + 1 - len(steps)
        first, last = min(steps.values()), max(steps.values())
        pace_s = max(length_s, (last - first) / 1e3 / max(1, len(steps) - 1))
        tail += max(0, int((stop_wall - last / 1e3) / pace_s) - TAIL_SLACK_WINDOWS)
    missing_nodes = k - sum(1 for i in range(k) if stored.get(f"node_{i}"))
    return {"gaps": gaps, "tail": tail, "nodes_never_delivered": missing_nodes, "total": gaps + tail}


def spooled(spool_root: Path) -> int:
    """Windows otel_forge's agents left in their spools (undelivered, kept for ``otel-forge replay``)."""
    return sum(1 for _ in spool_root.rglob("*.window.json")) if spool_root.is_dir() else 0


def start_cost(m: dict[str, Any], k: int, per_window_ms: float) -> dict[str, Any]:
    """The one-off cost per node: the start period's CPU less the steady cost of the windows past each node's
    first that early nodes delivered while the last one was starting."""
    later = max(0, m["start_windows"] - k)
    raw = m["start_cpu_ms"]["total"]
    return {
        "seconds": m["start_s"],
        "cpu_ms": m["start_cpu_ms"],
        "windows": m["start_windows"],
        "calls": m["start_calls"],
        "raw_per_node_ms": raw / k,
        "per_node_ms": max(0.0, raw - later * per_window_ms) / k,
    }


def summarize(ctx: Context, subject: str, backend: str, m: dict[str, Any]) -> dict[str, Any]:
    args, period = ctx.args, m["period"]
    spw = ctx.spw if subject == "otel_forge" else MLFLOW_SAMPLES_BEFORE_LOGGING
    windows = max(period["windows"], 1)
    per_window = m["period_cpu_ms"]["total"] / windows
    per_node_minute = per_window * 60 / (DEFAULT_INTERVAL_S * spw)
    calls = period["calls"]
    log_batch = calls.get("runs/log-batch", 0)
    expected = args.nodes * m["period_s"] / m["window_s"]
    return {
        "subject": subject,
        "backend": backend,
        "nodes": args.nodes,
        "fleet": args.fleet,
        "interval_s": args.interval,
        "samples_per_window": spw,
        "window_s": m["window_s"],
        "windows_per_node_minute_at_defaults": 60 / (DEFAULT_INTERVAL_S * spw),
        "measured_s": m["period_s"],
        "windows": period["windows"],
        "server_cpu_ms": m["period_cpu_ms"],
        "cpu_ms_per_window": per_window,
        "cpu_ms_per_window_server": m["period_cpu_ms"]["server"] / windows,
        "cpu_ms_per_window_database": m["period_cpu_ms"]["database"] / windows,
        "ms_per_node_minute": per_node_minute,
        "nodes_per_core": 60_000 / per_node_minute if per_node_minute else None,
        "log_batch_per_window": log_batch / windows,
        "other_calls_per_window": (sum(calls.values()) - log_batch) / windows,
        "calls": calls,
        "rows_per_window": period["rows"] / windows,
        "keys_per_node": m["keys_per_node"],
        "gpus_seen": m["gpus_seen"],
        "delivered_vs_expected": period["windows"] / expected if expected else None,
        "lag_at_end_s": {
            "max": max(m["lags"], default=None),
            "max_windows": max(m["lags"], default=0) / m["window_s"],
            "median": statistics.median(m["lags"]) if m["lags"] else None,
        },
        "undelivered": m["undelivered"],
        "spooled_at_exit": m["spooled"],
        "error_answers": m["errors"],
        "start": start_cost(m, args.nodes, per_window),
        "idle_cpu_ms_per_s": m["idle_ms_per_s"],
        "nodes_exited_early": m["exited_early"],
        "nodes_killed_at_stop": m["killed"],
        "nonzero_exit_codes": [c for c in m["exit_codes"] if c not in (0, -signal.SIGTERM)],
    }


# --- output ------------------------------------------------------------------------------------------


HEADER = (
    "| subject | backend | nodes | samples_per_window | server CPU ms / window | ms / node-minute at defaults "
    "| nodes per server core | log_batch calls / window | rows / window | windows not delivered "
    "| start cost per node (ms CPU) | other calls / window | delivered / expected | lag at end, max (s) |"
)
SATURATED = 0.9  # delivered / expected below this: timer drift at the compressed interval, or a busy machine


def render_markdown(result: dict[str, Any]) -> str:
    m, a = result["machine"], result["settings"]
    flush = (
        "on uncompressed time (one log_batch per window, as at 10 s)"
        if a["anchor_flush"] == "scaled"
        else "on the compressed clock"
    )
    lines = [
        f"`{result['command']}`",
        "",
        (
            f"{a['nodes']} simulated nodes of a {a['fleet']}-node SLURM job, {GPUS} fake NVIDIA GPUs each, "
            f"one run on a "
            f"fresh local `mlflow server` per subject and backend, behind a counting proxy; {m['cpus']} CPUs, Python "
            f"{m['python']}, mlflow {m['mlflow']}, {m['platform']}."
        ),
        (
            f"Time compression: sampling every {a['interval']:g} s instead of {DEFAULT_INTERVAL_S:g} s "
            f"({DEFAULT_INTERVAL_S / a['interval']:g}x faster); otel_forge's samples_per_window (its default for this "
            f"job, from `otel-forge doctor`) = {result['otel_forge_samples_per_window']}, MLflow's "
            f"samples_before_logging = {MLFLOW_SAMPLES_BEFORE_LOGGING}, its BatchMetricsLogger flush rule {flush}. "
            f"Server CPU (server process tree, + PostgreSQL's) is measured per window over {a['seconds']:g} s after "
            f"{a['warmup_windows']} warm-up windows, then scaled: ms per node-minute at defaults = ms per window x 60 "
            f"/ (10 s x samples_per_window); nodes per core = 60,000 / that."
        ),
        "",
        HEADER,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = result["rows"]
    lines += [table_row(row) for row in rows]
    lines += ["", *(note(row) for row in rows if "skipped" not in row)]
    if any(row.get("delivered_vs_expected", 1) < SATURATED for row in rows):
        lines.append(
            f"- Delivered / expected under {SATURATED:.0%}: each tool waits one interval after each "
            f"sample's work (a 0.1 s loop costs 17 % of windows at a 0.5 s interval, 1 % at 10 s), and the "
            f"nodes share this machine's {m['cpus']} CPUs with the server. Lag and delivered / expected "
            f"then describe the compressed run on this machine; the CPU per window stands."
        )
    lines += ["", f"Whole bench: {result['total_s']:.0f} s."]
    return "\n".join(lines)


def table_row(row: dict[str, Any]) -> str:
    if "skipped" in row:
        return f"| {row['subject']} | {row['backend']} | skipped: {row['skipped']} |" + " |" * 11
    lag = row["lag_at_end_s"]
    return (
        f"| {row['subject']} | {row['backend']} | {row['nodes']} | {row['samples_per_window']} "
        f"| {row['cpu_ms_per_window']:.2f} | {row['ms_per_node_minute']:.1f} | {fmt(row['nodes_per_core'], 0)} "
        f"| {row['log_batch_per_window']:.2f} | {row['rows_per_window']:.1f} | {row['undelivered']['total']} "
        f"| {row['start']['per_node_ms']:.1f} | {row['other_calls_per_window']:.2f} "
        f"| {fmt(100 * row['delivered_vs_expected'], 0)} % | {fmt(lag['max'], 2)} "
        f"({lag['max_windows']:.1f} windows) |"
    )


def note(row: dict[str, Any]) -> str:
    start, database = row["start"], ""
    if row["backend"] == "postgresql":
        database = (
            f"; of the CPU per window, mlflow server {row['cpu_ms_per_window_server']:.2f} ms, PostgreSQL "
            f"{row['cpu_ms_per_window_database']:.2f} ms"
        )
    return (
        f"- {row['subject']} / {row['backend']}: {row['windows']} windows in {row['measured_s']:.1f} s (window "
        f"{row['window_s']:g} s); {row['keys_per_node']} keys per node, {row['gpus_seen']} GPUs seen; calls "
        f"{row['calls']}{database}; start {start['seconds']:.1f} s, {start['raw_per_node_ms']:.1f} ms per node "
        f"before taking out {start['windows'] - row['nodes']} later windows, calls {start['calls']}; server idle "
        f"{row['idle_cpu_ms_per_s']:.1f} ms CPU/s; not delivered {row['undelivered']}, "
        f"{row['spooled_at_exit']} left in spools, error answers {row['error_answers'] or 'none'}; "
        f"{len(row['nodes_exited_early'])} node(s) exited early, {row['nodes_killed_at_stop']} killed at stop, "
        f"other exit codes {row['nonzero_exit_codes'] or 'none'}."
    )


def fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


# --- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16, help="simulated nodes, K (default 16)")
    parser.add_argument(
        "--fleet", type=int, default=2048, help="nodes of the simulated job: SLURM_JOB_NUM_NODES (default 2048)"
    )
    parser.add_argument("--interval", type=float, default=0.5, help="compressed sampling interval, s (default 0.5)")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured period per subject, s (default 60)")
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="sqlite")
    parser.add_argument(
        "--anchor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure MLflow's SystemMetricsMonitor (default: yes)",
    )
    parser.add_argument(
        "--anchor-flush",
        choices=("scaled", "as-is"),
        default="scaled",
        help="MLflow's BatchMetricsLogger flush rule on uncompressed time (scaled, default: one "
        "log_batch per window, as at 10 s) or on the compressed clock (as-is)",
    )
    parser.add_argument("--warmup-windows", type=int, default=3, help="windows after the first, not measured")
    parser.add_argument("--idle-seconds", type=float, default=2.0, help="server idle CPU measured before the nodes")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds the nodes get to drain at stop")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    return parser.parse_args(argv)


def run_backend(ctx: Context, backend: str, subjects: list[str]) -> list[dict[str, Any]]:
    """Every subject on one backend; rows that say why where PostgreSQL cannot run here."""
    reason = Postgres.unavailable() if backend == "postgresql" else None
    try:
        if backend == "postgresql" and reason is None:
            ctx.postgres = Postgres()
            reason = start_postgres(ctx.postgres)
        rows = []
        for subject in subjects:
            try:
                rows.append(skipped(subject, backend, reason) if reason else run_phase(ctx, subject, backend))
            except BackendUnavailable as error:
                rows.append(skipped(subject, backend, str(error)))
        return rows
    finally:
        if ctx.postgres is not None:
            ctx.postgres.stop()
            ctx.postgres = None


def start_postgres(postgres: Postgres) -> str | None:
    try:
        postgres.start()
    except (OSError, RuntimeError, subprocess.TimeoutExpired) as error:
        return f"PostgreSQL did not start: {str(error).strip()[-500:]}"
    return None


def skipped(subject: str, backend: str, reason: str) -> dict[str, Any]:
    print(f"note: {subject} on {backend} skipped: {reason}", file=sys.stderr, flush=True)
    return {"subject": subject, "backend": backend, "skipped": reason}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["-m", "bench.fleet", *sys.argv[1:]])
    # SIGTERM and Ctrl-C unwind through every finally, which stops what it started (even where the shell
    # that started the bench ignores SIGINT).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import mlflow

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fleet-doctor-") as directory:
        spw = samples_per_window(args, Path(directory))
    ctx = Context(args, spw)
    subjects = ["otel_forge", "mlflow"] if args.anchor else ["otel_forge"]
    backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    rows = [row for backend in backends for row in run_backend(ctx, backend, subjects)]
    result = {
        "command": command,
        "otel_forge_samples_per_window": spw,
        "total_s": time.monotonic() - started,
        "settings": {
            name: getattr(args, name)
            for name in ("nodes", "fleet", "interval", "seconds", "backend", "anchor", "anchor_flush", "warmup_windows")
        },
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mlflow": mlflow.__version__,
        },
        "rows": rows,
    }
    print(json.dumps(result, indent=2) if args.json else render_markdown(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
