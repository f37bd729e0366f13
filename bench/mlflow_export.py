"""System metrics into MLflow: otel_forge's ``MLflowMetricExporter`` vs the path of MLflow's own
``SystemMetricsMonitor``, against a real local tracking server, into ONE run.

Run:  python -m bench.mlflow_export [--windows 100] [--interval 0.1] [--burst-windows 100]
                                    [--hung-seconds 60] [--json]

Setup: a private ``mlflow server`` (testkit.mlflow_server.MlflowServer: sqlite, 127.0.0.1, one worker) and,
in front of it, one counting HTTP proxy per subject (testkit.proxy.MlflowProxy: forwards every
request to the real server and counts it by path), so the REST calls of each subject are counted apart.
One run; otel_forge logs under ``system/ours/``, MLflow's path under ``system/mlflow/`` (node ids).

Subjects (the bench's main thread plays the reader thread of each; hardware collection is NOT timed,
bench/sampling.py measures it):

- ``ours``: otel_forge's cpu, memory, disk, network collectors registered with ``otel_forge.instrument``
  on an SDK ``MeterProvider`` with an ``InMemoryMetricReader``; each window the reader collects
  (untimed) and the bench times ``MLflowMetricExporter.export(metrics_data)`` (samples_per_window=1,
  default queue 64 windows, spool cap 64 MiB, call deadline 30 s): what a
  ``PeriodicExportingMetricReader``'s thread spends in ``export``.
- ``mlflow``: what the loop of ``mlflow.system_metrics.SystemMetricsMonitor.monitor`` does each window
  with samples_before_logging=1, with MLflow's own classes: its CPU, disk and network monitors collect
  (untimed); then, timed: ``MlflowClient(uri).get_run(run_id)`` (its status check, made every sample),
  ``aggregate_metrics``, ``BatchMetricsLogger.record_metrics(metrics, step)`` (which runs its own
  ``flush`` -> synchronous ``log_batch`` whenever its training/logging time ratio says so) and
  ``clear_metrics``; ``finish()``'s final ``flush`` is timed too. No GPU monitor on either side.

Phases:

1. healthy: ``--windows`` windows at ``--interval`` s. Per window: reader-thread wall time (p50/p99/
   max) and CPU time (``time.thread_time``) in the delivery path, REST calls per window by endpoint
   (proxy counts / windows; ours makes one ``get_run`` per exporter, at its first delivery: in the
   warm-up here).
2. burst: ``--burst-windows`` windows back to back from one pre-collected sample: metrics/s delivered
   = metric values that reached the run / wall time of the delivery path (ours: first ``export`` to
   last window delivered; MLflow: the sum of its per-window calls plus the final flush).
3. hung: the server's process group SIGSTOPped for ``--hung-seconds`` while ours exports a window every
   ``--interval`` s; MLflow's loop runs meanwhile in its own thread, as its monitor thread would.
   Reported: ours' reader time per window while hung (first half of the hang; once the queue is full,
   ``export`` writes each window to the spool file on the reader thread), memory (RSS of the process, max
   over the hang minus before; ``tracemalloc`` peak of allocations made in the second half of the hang,
   tracemalloc on for that half only), windows in memory / in the spool / dropped at the end of the hang,
   spool bytes; then SIGCONT, how long ours takes to deliver the backlog, and how many of the hung
   period's windows each subject delivered.

HTTP settings for both: otel_forge's bounded defaults (``MLFLOW_HTTP_REQUEST_TIMEOUT=30``,
``MLFLOW_HTTP_REQUEST_MAX_RETRIES=3``) unless set in the environment.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import shlex
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench._common import percentile, wait_until
from otel_forge.config import MLFLOW_CLIENT_DEFAULTS, ForgeConfig
from testkit.mlflow_server import MlflowServer
from testkit.proxy import MlflowProxy

OURS_COLLECTORS = ("cpu", "memory", "disk", "network")
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
# otel_forge's bounded HTTP defaults (otel_forge/config.py), for both subjects alike.
HTTP_DEFAULTS = {name: value for name, value in MLFLOW_CLIENT_DEFAULTS.items() if name.startswith("MLFLOW_HTTP_")}
GET_RUN = "/api/2.0/mlflow/runs/get"
COUNTED_KEY = "system_memory_usage_megabytes"  # both subjects log it every window: steps are counted on it


@dataclass
class Timings:
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)

    def timed(self, call: Callable[[], Any]) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return call()
        finally:
            self.cpu_s.append(time.thread_time() - cpu)
            self.wall_s.append(time.perf_counter() - wall)

    def summary(self) -> dict[str, float | None]:
        if not self.wall_s:
            return {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None, "cpu_mean_ms": None}
        return {
            "n": len(self.wall_s),
            "p50_ms": percentile(self.wall_s, 0.5) * 1e3,
            "p99_ms": percentile(self.wall_s, 0.99) * 1e3,
            "max_ms": max(self.wall_s) * 1e3,
            "cpu_mean_ms": statistics.fmean(self.cpu_s) * 1e3,
            "sum_s": sum(self.wall_s),
        }


# --- the subjects ------------------------------------------------------------------------------------


class Ours:
    def __init__(self, run_id: str, uri: str, spool_dir: Path, interval_s: float) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader

        import otel_forge
        from otel_forge.mlflow.system_metrics.exporter import MLflowMetricExporter

        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        # The snapshot cache follows the sampling interval, as in the agent (max_age = 0.9 x interval).
        self.instrumentation = otel_forge.instrument(
            self.provider, collectors=list(OURS_COLLECTORS), sampling_interval_s=interval_s
        )
        self.exporter = MLflowMetricExporter(
            run_id,
            tracking_uri=uri,
            node_id="ours",
            samples_per_window=1,
            config=ForgeConfig.resolve(environ={}, spool_dir=str(spool_dir)),
        )
        self.prefix = "system/ours/"
        self.windows = 0

    def collect(self) -> Any:
        return self.reader.get_metrics_data()

    def export(self, data: Any) -> None:
        self.exporter.export(data)
        self.windows += 1

    def pending(self) -> int:
        return self.exporter.worker.pending()

    def close(self) -> None:
        self.exporter.shutdown()
        self.instrumentation.unregister()
        self.provider.shutdown()


class MlflowPath:
    """The per-window work of MLflow's SystemMetricsMonitor loop, with MLflow's own classes."""

    def __init__(self, run_id: str, uri: str) -> None:
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
        from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
        from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor
        from mlflow.utils.autologging_utils import BatchMetricsLogger

        self.run_id, self.uri = run_id, uri
        self.monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        self.logger = BatchMetricsLogger(run_id, tracking_uri=uri)
        self.prefix = "system/mlflow/"
        self.step = 0

    def collect(self) -> None:
        for monitor in self.monitors:
            monitor.collect_metrics()

    def deliver(self) -> bool:
        """Its status check, aggregate, record (+ flush when its rule says), clear. False: run not RUNNING."""
        from mlflow.tracking.client import MlflowClient

        run = MlflowClient(self.uri).get_run(self.run_id)
        if run.info.status != "RUNNING":
            return False
        metrics: dict[str, float] = {}
        for monitor in self.monitors:
            metrics.update(monitor.aggregate_metrics())
        self.logger.record_metrics({self.prefix + k: v for k, v in metrics.items()}, self.step)
        self.step += 1
        for monitor in self.monitors:
            monitor.clear_metrics()
        return True

    def finish(self) -> None:
        self.logger.flush()


class MlflowThread:
    """MLflow's loop on its own thread (during the hang): collect, wait, deliver; it ends on an error,
    as MLflow's monitor thread does."""

    def __init__(self, path: MlflowPath, interval_s: float) -> None:
        self.path, self.interval_s = path, interval_s
        self.stop_event = threading.Event()
        self.windows = 0
        self.samples = 0
        self.timings = Timings()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._loop, name="mlflow-monitor-path", daemon=True)

    def _loop(self) -> None:
        while not self.stop_event.is_set():
            self.path.collect()
            self.samples += 1
            if self.stop_event.wait(self.interval_s):
                return
            try:
                if not self.timings.timed(self.path.deliver):
                    return
            except Exception as error:  # noqa: BLE001 - MLflow's monitor returns here: its thread is over
                self.error = str(error).splitlines()[0][:160]
                return
            self.windows += 1


# --- the phases ---------------------------------------------------------------------------------------


def run_healthy(
    ours: Ours, mlflow_path: MlflowPath, proxies: dict[str, Any], windows: int, interval_s: float
) -> dict[str, Any]:
    for proxy in proxies.values():
        proxy.reset()
    ours_t, mlflow_t = Timings(), Timings()
    started = time.monotonic()
    for i in range(windows):
        delay = started + i * interval_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        data = ours.collect()
        ours_t.timed(lambda: ours.export(data))  # noqa: B023 - called here, in this iteration
        mlflow_path.collect()
        mlflow_t.timed(mlflow_path.deliver)
    finish = Timings()
    finish.timed(mlflow_path.finish)
    drained = wait_until(lambda: ours.pending() == 0, 60)
    counts = {name: proxy.counts() for name, proxy in proxies.items()}
    return {
        "ours": ours_t.summary(),
        "mlflow": mlflow_t.summary(),
        "mlflow_final_flush_ms": finish.wall_s[0] * 1e3,
        "calls": counts,
        "windows": windows,
        "ours_drained": drained,
    }


def run_burst(ours: Ours, mlflow_path: MlflowPath, client: Any, run_id: str, windows: int) -> dict[str, Any]:
    # ours: one sample, exported `windows` times back to back; time until the run holds them all.
    data = ours.collect()
    first_window = ours.windows
    started = time.perf_counter()
    for _ in range(windows):
        ours.export(data)
    wait_until(lambda: ours.pending() == 0, 120, interval_s=0.01)
    ours_s = time.perf_counter() - started
    ours_keys = count_keys(client, run_id, ours.prefix)
    # MLflow: its per-window calls, back to back (a fresh sample before each, untimed), then finish().
    mlflow_t = Timings()
    first_step = mlflow_path.step
    for _ in range(windows):
        mlflow_path.collect()
        mlflow_t.timed(mlflow_path.deliver)
    mlflow_t.timed(mlflow_path.finish)
    mlflow_keys = count_keys(client, run_id, mlflow_path.prefix)
    ours_steps = steps_between(client, run_id, ours.prefix + COUNTED_KEY, first_window, first_window + windows)
    mlflow_steps = steps_between(client, run_id, mlflow_path.prefix + COUNTED_KEY, first_step, first_step + windows)
    return {
        "windows": windows,
        "ours": {
            "keys": ours_keys,
            "seconds": ours_s,
            "steps_delivered": ours_steps,
            "metrics_per_s": ours_steps * ours_keys / ours_s,
        },
        "mlflow": {
            "keys": mlflow_keys,
            "seconds": sum(mlflow_t.wall_s),
            "steps_delivered": mlflow_steps,
            "metrics_per_s": mlflow_steps * mlflow_keys / sum(mlflow_t.wall_s),
        },
    }


def run_hung(
    server: Any,
    ours: Ours,
    mlflow_path: MlflowPath,
    client: Any,
    run_id: str,
    hung_s: float,
    interval_s: float,
    drain_timeout_s: float,
) -> dict[str, Any]:
    process = psutil.Process()
    first_window = ours.windows
    mlflow_first_step = mlflow_path.step
    mlflow_thread = MlflowThread(mlflow_path, interval_s)
    gc.collect()
    rss_before = process.memory_info().rss
    rss_max = rss_before
    threads_max = threading.active_count()
    ours_t, traced_t = Timings(), Timings()
    server.pause()
    mlflow_thread.thread.start()
    started = time.monotonic()
    i = 0
    # First half: reader times untraced; second half: tracemalloc on (it slows every allocation).
    while (elapsed := time.monotonic() - started) < hung_s:
        traced = elapsed >= hung_s / 2
        if traced and not tracemalloc.is_tracing():
            tracemalloc.start()
        delay = started + i * interval_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        data = ours.collect()
        (traced_t if traced else ours_t).timed(lambda: ours.export(data))  # noqa: B023 - called at once
        rss_max = max(rss_max, process.memory_info().rss)
        threads_max = max(threads_max, threading.active_count())
        i += 1
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    worker = ours.exporter.worker
    stats = worker.stats
    at_end = {
        "in_memory": len(worker._outbox._queue),
        "spooled_files": len(ours.exporter.spool),
        "spool_bytes": ours.exporter.spool.size_bytes,
        "spooled_total": stats.spooled,
        "dropped": stats.dropped,
        "delivered": stats.delivered,
        "hung_calls": stats.hung_calls,
        "retried": stats.retried,
    }
    server.resume()
    resumed = time.monotonic()
    mlflow_windows_while_hung, mlflow_samples_while_hung = mlflow_thread.windows, mlflow_thread.samples
    mlflow_step_at_resume = mlflow_path.step
    drained = wait_until(lambda: ours.pending() == 0, drain_timeout_s, interval_s=0.05)
    drain_s = time.monotonic() - resumed
    mlflow_thread.stop_event.set()
    mlflow_thread.thread.join(timeout=120)
    ours_windows = ours.windows - first_window
    ours_delivered = steps_between(client, run_id, ours.prefix + COUNTED_KEY, first_window, first_window + ours_windows)
    mlflow_path.finish()
    mlflow_delivered = steps_between(
        client, run_id, mlflow_path.prefix + COUNTED_KEY, mlflow_first_step, mlflow_step_at_resume
    )
    blocked = max(mlflow_thread.timings.wall_s, default=0.0)
    return {
        "seconds": hung_s,
        "interval_s": interval_s,
        "ours": ours_t.summary(),
        "ours_traced": traced_t.summary(),
        "ours_windows": ours_windows,
        "ours_delivered": ours_delivered,
        "ours_drained": drained,
        "drain_s": drain_s,
        "at_end": at_end,
        "rss_before_mb": rss_before / 2**20,
        "rss_growth_mb": (rss_max - rss_before) / 2**20,
        "tracemalloc_peak_mb": traced_peak / 2**20,
        "threads_max": threads_max,
        "queue_cap": worker._outbox._max_queue,
        "spool_cap_bytes": ours.exporter.spool.max_bytes,
        "mlflow": {
            "samples": mlflow_samples_while_hung,
            "windows": mlflow_windows_while_hung,
            "delivered": mlflow_delivered,
            "longest_call_s": blocked,
            "error": mlflow_thread.error,
            "alive_at_resume": mlflow_thread.error is None,
        },
    }


# --- helpers ------------------------------------------------------------------------------------------


def count_keys(client: Any, run_id: str, prefix: str) -> int:
    return sum(1 for key in client.get_run(run_id).data.metrics if key.startswith(prefix))


def steps_between(client: Any, run_id: str, key: str, first: int, end: int) -> int:
    return len({m.step for m in client.get_metric_history(run_id, key) if first <= m.step < end})


def ms(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1000:
        return f"{value / 1000:.2f} s"
    if value >= 1:
        return f"{value:.1f} ms"
    return f"{value * 1000:.0f} µs"


def per_window(counts: dict[str, int], path: str, windows: int) -> str:
    return f"{counts.get(path, 0) / windows:.2f}"


def render_markdown(r: dict[str, Any]) -> str:
    m, h, b, g = r["machine"], r["healthy"], r["burst"], r["hung"]
    ours_calls, mlflow_calls = h["calls"]["ours"], h["calls"]["mlflow"]
    ho, hm = h["ours"], h["mlflow"]
    lines = [
        f"`{r['command']}`",
        "",
        f"One run on a local `mlflow server` (sqlite, 1 worker), each subject behind its own counting proxy; "
        f"Python {m['python']}, mlflow {m['mlflow']}, opentelemetry-sdk {m['otel_sdk']}, {m['cpus']} CPUs; "
        f"`MLFLOW_HTTP_REQUEST_TIMEOUT={m['http_timeout']}`, `MLFLOW_HTTP_REQUEST_MAX_RETRIES={m['http_retries']}`. "
        f"Reader-thread time in the delivery path per window (collection excluded).",
        "",
        "| | otel_forge `MLflowMetricExporter.export` | MLflow `SystemMetricsMonitor` path |",
        "|---|---:|---:|",
        f"| healthy, {h['windows']} windows at {r['interval_s']:g} s: reader wall p50 / p99 / max | "
        f"{ms(ho['p50_ms'])} / {ms(ho['p99_ms'])} / {ms(ho['max_ms'])} | "
        f"{ms(hm['p50_ms'])} / {ms(hm['p99_ms'])} / {ms(hm['max_ms'])} "
        f"(+ final flush {ms(h['mlflow_final_flush_ms'])}) |",
        f"| healthy: reader CPU per window (mean) | {ms(ho['cpu_mean_ms'])} | {ms(hm['cpu_mean_ms'])} |",
        f"| healthy: REST calls per window (`runs/get` + `runs/log-batch`) | "
        f"{per_window(ours_calls, GET_RUN, h['windows'])} + {per_window(ours_calls, LOG_BATCH, h['windows'])} "
        f"(one `runs/get` per exporter, at its first delivery) | "
        f"{per_window(mlflow_calls, GET_RUN, h['windows'])} + {per_window(mlflow_calls, LOG_BATCH, h['windows'])} |",
        f"| metric keys per window | {b['ours']['keys']} | {b['mlflow']['keys']} |",
        f"| burst of {b['windows']} windows: metrics/s delivered (steps delivered, seconds) | "
        f"{b['ours']['metrics_per_s']:,.0f} ({b['ours']['steps_delivered']}/{b['windows']}, "
        f"{b['ours']['seconds']:.1f} s) | "
        f"{b['mlflow']['metrics_per_s']:,.0f} ({b['mlflow']['steps_delivered']}/{b['windows']}, "
        f"{b['mlflow']['seconds']:.1f} s) |",
        f"| hung {g['seconds']:g} s at {g['interval_s']:g} s: reader wall p50 / p99 / max | "
        f"{ms(g['ours']['p50_ms'])} / {ms(g['ours']['p99_ms'])} / {ms(g['ours']['max_ms'])} "
        f"({g['ours']['n']} windows, first half; second half under tracemalloc: p50 "
        f"{ms(g['ours_traced']['p50_ms'])}) | "
        f"{g['mlflow']['windows']} windows from {g['mlflow']['samples']} samples while hung; longest call "
        f"{g['mlflow']['longest_call_s']:.1f} s |",
        f"| hung: windows of the hung period in the run after SIGCONT | {g['ours_delivered']}/{g['ours_windows']} "
        f"(backlog delivered in {g['drain_s']:.1f} s) | {g['mlflow']['delivered']} "
        f"({'thread alive' if g['mlflow']['alive_at_resume'] else 'thread ended: ' + str(g['mlflow']['error'])}) |",
        f"| hung: memory (RSS growth over the hang / tracemalloc peak, second half) | {g['rss_growth_mb']:.1f} MiB / "
        f"{g['tracemalloc_peak_mb']:.1f} MiB (the whole process: both subjects) | |",
        f"| hung: at the end of the hang | {g['at_end']['in_memory']} windows in memory (cap {g['queue_cap']}), "
        f"{g['at_end']['spooled_files']} in the spool ({g['at_end']['spool_bytes'] / 2**20:.2f} MiB of "
        f"{g['spool_cap_bytes'] / 2**20:.0f} MiB), {g['at_end']['dropped']} dropped, "
        f"{g['at_end']['hung_calls']} hung calls; {g['threads_max']} threads max | |",
    ]
    lines += ["", f"Whole bench: {r['total_s']:.0f} s."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=100, help="healthy-phase windows (default 100)")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between windows (default 0.1)")
    parser.add_argument("--burst-windows", type=int, default=100, help="windows of the burst phase (default 100)")
    parser.add_argument(
        "--hung-seconds", type=float, default=60.0, help="seconds the server is SIGSTOPped (default 60)"
    )
    parser.add_argument("--drain-timeout", type=float, default=120.0, help="seconds to wait for ours' backlog")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["-m", "bench.mlflow_export", *sys.argv[1:]])

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_SYSTEM_METRICS_NODE_ID", "OTEL_FORGE_NODE_ID"):
        os.environ.pop(name, None)
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("otel_forge").setLevel(logging.CRITICAL)  # expected retry/hung warnings while hung

    import mlflow
    import opentelemetry.sdk.version
    from mlflow import MlflowClient

    root = Path(tempfile.mkdtemp(prefix="mlflow-export-"))
    started = time.monotonic()
    server = MlflowServer(root).start()
    proxies = {"ours": MlflowProxy(server.uri), "mlflow": MlflowProxy(server.uri)}
    for proxy in proxies.values():
        # A client that gave up on the hung server resets its connection: not worth a traceback.
        proxy._server.handle_error = lambda request, client_address: None
    ours = None
    try:
        client = MlflowClient(server.uri)
        experiment_id = client.create_experiment("bench-mlflow-export")
        run_id = client.create_run(experiment_id, run_name="mlflow-export").info.run_id
        ours = Ours(run_id, proxies["ours"].uri, root / "spool", args.interval)
        mlflow_path = MlflowPath(run_id, proxies["mlflow"].uri)
        # Warm up both paths (imports, first get_run / connection), outside every measurement.
        for _ in range(3):
            ours.export(ours.collect())
            mlflow_path.collect()
            mlflow_path.deliver()
        mlflow_path.finish()
        wait_until(lambda: ours.pending() == 0, 60)

        healthy = run_healthy(ours, mlflow_path, proxies, args.windows, args.interval)
        burst = run_burst(ours, mlflow_path, client, run_id, args.burst_windows)
        hung = run_hung(server, ours, mlflow_path, client, run_id, args.hung_seconds, args.interval, args.drain_timeout)
        ours.close()
        ours = None
        client.set_terminated(run_id)
        total_s = time.monotonic() - started
    finally:
        if ours is not None:
            ours.close()
        for proxy in proxies.values():
            proxy.close()
        server.stop()

    result = {
        "command": command,
        "interval_s": args.interval,
        "total_s": total_s,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mlflow": mlflow.__version__,
            "otel_sdk": opentelemetry.sdk.version.__version__,
            "http_timeout": os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"],
            "http_retries": os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"],
        },
        "healthy": healthy,
        "burst": burst,
        "hung": hung,
    }
    print(json.dumps(result, indent=2) if args.json else render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
