"""Fleet scale: what a job's nodes cost ONE tracking server; real agent processes, each a node of a job.

Run:  python -m bench.fleet --at-defaults [--nodes 32] [--fleet 2048] [--minutes 5]
                            [--backend sqlite|postgresql|both] [--old-layout-keys 20000] [--no-pages] [--json]
      (~9 min per backend at these defaults; the issue-24 measurement)
      python -m bench.fleet [--nodes 16] [--fleet 2048] [--interval 0.5] [--seconds 60]
                            [--backend sqlite|postgresql|both] [--anchor/--no-anchor] [--json]
      (the compressed comparison with MLflow's monitor: ~3.5 min at these defaults; --backend both about
      doubles it)

Both modes start K real ``otel-forge monitor`` processes (``--nodes``), each node i of a simulated SLURM job
of ``--fleet`` nodes (``SLURM_JOB_NUM_NODES``), each in its own process group, with 8 fake NVIDIA GPUs
(tests/fakes/pynvml.py through ``fake_gpu_env({"count": 8})``), a hermetic environment
(testkit/hermetic.py) and its spool in a temp dir, against a private ``mlflow server`` behind a counting
proxy (both below). A job of more than ``node_runs_above`` nodes (8 by default; read from ``otel-forge
doctor --json`` with node 0's environment, as ``samples_per_window`` is) logs each node into a run of its
own under the job's run (``system/<key>``; the tag of each agent's first call there names the node); a
smaller one logs ``system/<node>/<key>`` into the job's run. The bench reads both.

At defaults (``--at-defaults``), per backend: a fresh server, warmed up; the job's run created as a
standalone ``otel-forge monitor --run-id`` meets it, ``MlflowClient().create_run("0")`` (MLflow's default
experiment) and NO ``MLFLOW_EXPERIMENT_ID`` given to the agents; the server's idle CPU over
``--idle-seconds`` (30: CPU times come in 10 ms ticks, a dozen processes' worth); then the K agents
started together at the defaults (no ``--interval``: 10 s; ``samples_per_window`` the job's default: 12
past 1,024 nodes, 120 s windows), in real time for ``--minutes``
(5). MLflow's monitor is not run in this mode (the compressed mode keeps it). Measured:

- server CPU (user + system seconds of the server's process tree, + PostgreSQL's, as below) read at the
  agents' start and every minute after it; per phase, ms per node-minute = CPU ms / (K x minutes):
  minute 0-1 (the agents' start: imports, first samples; an agent calls the server first when its first
  window is due), minutes 1-4 (the issue's figure: each node's first window, with the node run's
  ``runs/search`` and ``runs/create`` and every key new to the run, then the windows after it),
  the steady state (from the first whole minute after every node's first window reached the server, to
  the end; where none is left, as with 120 s windows in 5 minutes, the last minute, said so) and the
  stop (SIGTERM to every agent, until the proxy answered their last calls: each node's last window and
  the ``runs/update`` that ends its run); the server's idle CPU is not taken out (it is given apart;
  issue 32's whole-run goal is judged per node-minute of the ``--fleet``-node job the K agents stand for:
  the server's CPU above its idle per agent, plus its idle shared by the job's nodes, as a server sized
  for the job idles alike for K nodes and for 2,048; the figure with the idle charged to the K agents
  alone is printed beside it);
  the calls by path that arrived in each phase (no ``runs/get`` is expected); the agents' own CPU
  (their process trees; at the stop, what the reaped agents spent less what they had spent before),
  which shares the 2 cores with the server;
- completeness, after the stop: the node runs found as a reader finds them (``search_runs`` on
  ``tags.`mlflow.parentRunId` = '<job run>'``), one per node; in each, the history of its anchor key (its
  smallest ``system/`` key, in every window) holds steps 0..n-1, every step that reached the proxy,
  a last window that ends at most one interval (+2 s) before the stop, and the run ended FINISHED;
  windows left in the agents' spools, error answers and exit codes apart;
- sizes: keys (``system/`` ones apart), params and tags of the job's run and of a node run (the one
  with the most windows, node_0's of those), and ``runs/get`` of each (on a new connection, one
  unmeasured call, then the median wall of 3, and the answer's bytes). The job's run holds no node's
  keys, so its size at ``--fleet`` nodes is the one measured. For the layout before node runs (every
  node's keys in the job's run), a run of ``--old-layout-keys`` keys (20,000) is built
  (``system/node_<n>/<key>`` with that node run's own keys, node after node, ``--old-layout-steps``
  steps each) and timed the same way; ``runs/get`` per key is the slope between the node run and that
  run, and the job's run of ``--fleet`` x a node's keys is extrapolated along it;
- the run pages, on the first backend (``--pages``, default on): MLflow's UI in headless Chromium
  (bench/run_page.py's browser and probe: /usr/bin/chromium, /usr/bin/chromedriver, selenium): the job's
  run's Overview (shown once it heads its metrics table "Metrics (<keys>)"), the node run's System
  metrics tab (drawn once a chart card has a plotly line), and both tabs of the old layout's run (the
  largest run the bench builds); the time from the navigation's start, page load included, within
  ``--page-timeout`` s.

The agents share the machine's cores with the server: the server's CPU is its own processes' CPU time,
but where the agents' start saturates the cores, the server's calls wait, and the minute they fall in
may shift.

The compressed mode (the default) compares otel_forge's agent with MLflow's own monitor per window:

Setup, per subject and backend (a fresh server and a fresh run each, so neither subject pays for the
other's rows): a private ``mlflow server`` on 127.0.0.1 (sqlite: testkit.mlflow_server.MlflowServer, one
worker; postgresql: a PostgreSQL cluster the bench starts with ``initdb``/``pg_ctl`` in a temp dir on a
free 127.0.0.1 port, run as user ``postgres`` when the bench is root, a fresh database per subject,
through ``--pg-driver`` (psycopg 3 by default, as docs/fleet.md advises), ``mlflow server --workers``
``--pg-workers``, 4 as docs/fleet.md advises),
warmed up with a few calls into a throwaway run; one counting proxy in front of it (testkit.proxy.MlflowProxy:
forwards every request, keeps its path and JSON body); a run created with ``MlflowClient``; then K simulated
nodes started together, each in its own process group:

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
- windows not delivered: after SIGTERM and the nodes' own drain, read back from where each node logs
  (its node run, or the job's run: the history of the node's smallest key, which both tools log every
  window): steps missing below a node's last step,
  plus windows due before the stop that never came (more than 2 windows, at the pace the node delivered,
  between its newest stored window and the stop); windows otel_forge left in its spools, and error answers,
  are given apart.

Caveats: the proxy opens one upstream connection per request where the clients would keep theirs alive,
a small cost per call for both subjects. MLflow's monitor logs every node into the job's run, which
then holds K nodes' keys, not ``--fleet`` nodes': a cost that grows with the run (its ``runs/get`` every
sample returns every latest metric of the run) is measured at K. The nodes share the machine with the
server: where they saturate its cores, lag and delivered / expected show it (a note says so), the
server's CPU seconds per window much less. The fake GPUs' values are deterministic and repeat with
short periods (tests/fakes/pynvml.py); the host's own CPU, memory, disk and network values are this
machine's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import _fleet_defaults
from bench._common import REPO_ROOT, wait_until
from bench._fleet_parts import (
    DEFAULT_INTERVAL_S,
    GPUS,
    BackendUnavailable,
    CpuMeter,
    Deliveries,
    Fleet,
    Postgres,
    counting_proxy,
    cpu_delta_ms,
    doctor,
    error_answers,
    node_env,
    ours_command,
    spooled,
    start_postgres,
    start_server,
    stored_steps,
    warm_up,
)

MLFLOW_SAMPLES_BEFORE_LOGGING = 1  # MLflow's default, and what the anchor uses
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


# --- the compressed mode: one subject on one backend ------------------------------------------------


def anchor_command(run_id: str, uri: str, i: int, interval_s: float, flush_rule: str) -> list[str]:
    time_scale = DEFAULT_INTERVAL_S / interval_s if flush_rule == "scaled" else 1.0
    return [sys.executable, "-c", ANCHOR, run_id, uri, f"node_{i}", f"{interval_s:g}", f"{time_scale:g}"]


@dataclass
class Context:
    """What every phase shares."""

    args: argparse.Namespace
    spw: int  # otel_forge's effective samples_per_window
    postgres: Postgres | None = None


def window_s(ctx: Context, subject: str) -> float:
    samples = ctx.spw if subject == "otel_forge" else MLFLOW_SAMPLES_BEFORE_LOGGING
    return ctx.args.interval * samples


def run_phase(ctx: Context, subject: str, backend: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"fleet-{subject}-") as directory:
        tmp = Path(directory)
        server, meter = start_server(backend, tmp, subject, ctx.postgres, ctx.args.pg_workers)
        proxy = counting_proxy(server.uri)
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
    stored = stored_steps(client, deliveries)
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
            "errors": error_answers(proxy),
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
    parser.add_argument(
        "--at-defaults",
        action="store_true",
        help="real time at otel_forge's defaults (10 s interval, the job's samples_per_window), otel_forge only, "
        "measured minute by minute for --minutes (default: the compressed comparison with MLflow's monitor)",
    )
    parser.add_argument("--nodes", type=int, help="simulated nodes, K (default 16; 32 with --at-defaults)")
    parser.add_argument(
        "--fleet", type=int, default=2048, help="nodes of the simulated job: SLURM_JOB_NUM_NODES (default 2048)"
    )
    parser.add_argument("--backend", choices=("sqlite", "postgresql", "both"), default="sqlite")
    parser.add_argument(
        "--pg-driver",
        choices=("psycopg", "psycopg2"),
        help="the server's PostgreSQL driver (default: psycopg 3 where installed, as docs/fleet.md advises)",
    )
    parser.add_argument(
        "--pg-workers",
        type=int,
        default=4,
        help="the PostgreSQL-backed server's workers (default 4, as docs/fleet.md advises; sqlite's has 1)",
    )
    parser.add_argument(
        "--idle-seconds",
        type=float,
        help="server idle CPU measured before the nodes, s (default 2; 30 with --at-defaults)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        help="seconds the nodes get to drain at stop (default 30; 90 with --at-defaults, the next agent's included)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--save", type=Path, help="also write the result as JSON to this file")
    compressed = parser.add_argument_group("the compressed mode")
    compressed.add_argument("--interval", type=float, default=0.5, help="compressed sampling interval, s (default 0.5)")
    compressed.add_argument("--seconds", type=float, default=60.0, help="measured period per subject, s (default 60)")
    compressed.add_argument(
        "--anchor",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure MLflow's SystemMetricsMonitor (default: yes)",
    )
    compressed.add_argument(
        "--anchor-flush",
        choices=("scaled", "as-is"),
        default="scaled",
        help="MLflow's BatchMetricsLogger flush rule on uncompressed time (scaled, default: one "
        "log_batch per window, as at 10 s) or on the compressed clock (as-is)",
    )
    compressed.add_argument("--warmup-windows", type=int, default=3, help="windows after the first, not measured")
    defaults = parser.add_argument_group("--at-defaults")
    defaults.add_argument("--minutes", type=int, default=5, help="minutes the agents run (default 5)")
    defaults.add_argument(
        "--old-layout-keys",
        type=int,
        default=20_000,
        help="keys of the run of the old layout built to price runs/get per key (default 20000; 0: none)",
    )
    defaults.add_argument(
        "--experiment-runs",
        type=int,
        help="node runs made in the experiment where each of a node's calls is costed alone (default: --fleet; "
        "0: not costed)",
    )
    defaults.add_argument("--old-layout-steps", type=int, default=2, help="steps per key of that run (default 2)")
    defaults.add_argument(
        "--pages",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open the run pages in headless Chromium, on the first backend (default: yes)",
    )
    defaults.add_argument("--page-timeout", type=float, default=60.0, help="seconds a page gets to draw (default 60)")
    args = parser.parse_args(argv)
    if args.at_defaults:
        args.interval, args.anchor = DEFAULT_INTERVAL_S, False
    args.nodes = args.nodes or (32 if args.at_defaults else 16)
    args.stop_timeout = args.stop_timeout or (90.0 if args.at_defaults else 30.0)
    args.experiment_runs = args.fleet if args.experiment_runs is None else args.experiment_runs
    args.idle_seconds = args.idle_seconds if args.idle_seconds is not None else (30.0 if args.at_defaults else 2.0)
    args.backends = ["sqlite", "postgresql"] if args.backend == "both" else [args.backend]
    args.pg_driver = args.pg_driver or Postgres.driver()
    return args


def on_backend(ctx: Context, backend: str, measure_one: Any, names: list[str]) -> list[dict[str, Any]]:
    """``measure_one(name)`` for each name on one backend (with PostgreSQL: a cluster started for them, stopped
    after); rows that say why where PostgreSQL cannot run here."""
    reason = Postgres.unavailable() if backend == "postgresql" else None
    try:
        if backend == "postgresql" and reason is None:
            ctx.postgres = Postgres(ctx.args.pg_driver)
            reason = start_postgres(ctx.postgres)
        rows = []
        for name in names:
            try:
                rows.append(skipped(name, backend, reason) if reason else measure_one(name))
            except BackendUnavailable as error:
                rows.append(skipped(name, backend, str(error)))
        return rows
    finally:
        if ctx.postgres is not None:
            ctx.postgres.stop()
            ctx.postgres = None


def at_defaults(ctx: Context, backend: str, subject: str) -> dict[str, Any]:
    return {"subject": subject, **_fleet_defaults.measure_backend(ctx.args, backend, ctx.postgres, ctx.spw)}


def skipped(subject: str, backend: str, reason: str) -> dict[str, Any]:
    print(f"note: {subject} on {backend} skipped: {reason}", file=sys.stderr, flush=True)
    return {"subject": subject, "backend": backend, "skipped": reason}


def commit() -> str:
    """The checkout the agents ran: HEAD's short hash, "+" where otel_forge/ differs from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO_ROOT)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "otel_forge"], capture_output=True, text=True, cwd=REPO_ROOT
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "") or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["-m", "bench.fleet", *sys.argv[1:]])
    # SIGTERM and Ctrl-C unwind through every finally, which stops what it started (even where the shell
    # that started the bench ignores SIGINT).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import mlflow

    started, load_before = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="fleet-doctor-") as directory:
        job = doctor(args, Path(directory))
    ctx = Context(args, job["samples_per_window"])
    rows = []
    for backend in args.backends:
        if args.at_defaults:
            rows += on_backend(ctx, backend, functools.partial(at_defaults, ctx, backend), ["otel_forge"])
        else:
            subjects = ["otel_forge", "mlflow"] if args.anchor else ["otel_forge"]
            rows += on_backend(ctx, backend, functools.partial(run_phase, ctx, backend=backend), subjects)
    settings = ["nodes", "fleet", "interval", "backend", "pg_driver", "pg_workers", "idle_seconds"]
    settings += (
        ["minutes", "old_layout_keys", "old_layout_steps", "experiment_runs", "pages", "page_timeout"]
        if args.at_defaults
        else ["seconds", "anchor", "anchor_flush", "warmup_windows"]
    )
    result = {
        "command": command,
        "mode": "at-defaults" if args.at_defaults else "compressed",
        "samples_per_window": ctx.spw,
        "otel_forge_samples_per_window": ctx.spw,
        "node_runs_above": job["node_runs_above"],
        "load_before": load_before,
        "total_s": time.monotonic() - started,
        "settings": {name: getattr(args, name) for name in settings},
        "commit": commit(),
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mlflow": mlflow.__version__,
        },
        "rows": rows,
    }
    if args.save:
        args.save.write_text(json.dumps(result, indent=2, default=str))
    if args.json:
        print(json.dumps(result, indent=2, default=str), flush=True)
    else:
        render = _fleet_defaults.render_markdown if args.at_defaults else render_markdown
        print(render(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
