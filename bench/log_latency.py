"""Latency of one ``TrainingRun.log()`` call vs ``mlflow.log_metrics(synchronous=True/False)``,
with a healthy tracking server and with a hung one (SIGSTOP).

Run:  python -m bench.log_latency [--calls 10000] [--sync-calls 300] [--hung-sync-calls 2] [--json]

Setup: a private ``mlflow server`` (testkit.mlflow_server.MlflowServer: sqlite, 127.0.0.1, one worker),
ONE run opened by ``otel_forge.TrainingRun`` (``system_metrics=False``: only the training loop's calls are
measured). MLflow's fluent API attaches to the same run (``mlflow.start_run(run_id=...)``). Every subject
logs the same two metrics per call (``loss``, ``lr``) at step = call index, under its own key prefix,
so what each delivered can be counted in the run afterwards.

Subjects, each timed per call with ``time.perf_counter_ns`` (wall time in the calling thread):

- ``TrainingRun.log``: ``run.log({...}, step=i)`` (otel_forge: enqueue on the delivery worker);
- ``log_metrics sync``: ``mlflow.log_metrics({...}, step=i, synchronous=True)`` (one REST call);
- ``log_metrics async``: ``mlflow.log_metrics({...}, step=i, synchronous=False)`` (MLflow's async queue).

Phases: healthy server, then the server's process group SIGSTOPped (it accepts connections and never
answers), then SIGCONT and a drain. A synchronous call to a hung server blocks until the HTTP timeout,
so that row makes only ``--hung-sync-calls`` calls with ``MLFLOW_HTTP_REQUEST_TIMEOUT`` =
``--http-timeout`` s and no retries (MLflow's defaults, 120 s x 7 retries, would block for many minutes);
the synchronous healthy row makes ``--sync-calls`` calls (10 to 50 ms each). "delivered" is what the run
holds for that subject once the server is back and TrainingRun's queue has drained (``--drain-timeout``).
MLflow's async queue sends one ``log_batch`` per call (~60 calls/s on 2 cores): the bench does not wait
for it (that would take minutes); the footnote says how much it had delivered when the counting ran.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._common import percentile, wait_until
from testkit.mlflow_server import MlflowServer


@dataclass
class Row:
    subject: str
    phase: str
    prefix: str
    calls: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    errors: int = 0
    delivered: int | None = None
    note: str = ""

    def stats(self) -> dict[str, float | None]:
        if not self.latencies_ns:
            return {"p50_us": None, "p99_us": None, "max_us": None, "mean_us": None}
        ordered = sorted(self.latencies_ns)
        return {
            "p50_us": percentile(ordered, 0.50) / 1e3,
            "p99_us": percentile(ordered, 0.99) / 1e3,
            "max_us": ordered[-1] / 1e3,
            "mean_us": sum(ordered) / len(ordered) / 1e3,
        }


def timed_calls(row: Row, calls: int, call: Callable[[int], Any]) -> None:
    """``call(i)`` for i in range(calls), each timed; exceptions counted, not raised."""
    perf = time.perf_counter_ns
    latencies = row.latencies_ns
    for i in range(calls):
        started = perf()
        try:
            call(i)
        except Exception:  # noqa: BLE001 - a failed synchronous call still took its time
            latencies.append(perf() - started)
            row.errors += 1
            continue
        latencies.append(perf() - started)
    row.calls += calls


def format_us(value: float | None) -> str:
    if value is None:
        return "-"
    if value >= 1e6:
        return f"{value / 1e6:.2f} s"
    if value >= 1e3:
        return f"{value / 1e3:.1f} ms"
    return f"{value:.1f} µs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--calls", type=int, default=10_000, help="calls per non-blocking subject and phase (default 10000)"
    )
    parser.add_argument("--sync-calls", type=int, default=300, help="synchronous calls, healthy server (default 300)")
    parser.add_argument("--hung-sync-calls", type=int, default=2, help="synchronous calls, hung server (default 2)")
    parser.add_argument(
        "--http-timeout",
        type=float,
        default=5.0,
        help="MLFLOW_HTTP_REQUEST_TIMEOUT in seconds for this bench (default 5)",
    )
    parser.add_argument(
        "--hung-seconds",
        type=float,
        default=10.0,
        help="how long the server stays SIGSTOPped for TrainingRun (default 10)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for TrainingRun's queue to drain (default 60)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    args = parser.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["-m", "bench.log_latency", *sys.argv[1:]])

    # One attempt per call, a short timeout: a synchronous call to a hung server blocks this long.
    os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = f"{args.http_timeout:g}"
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        os.environ.pop(name, None)
    os.environ["OTEL_FORGE_SPOOL_DIR"] = tempfile.mkdtemp(prefix="log-latency-spool-")

    import logging

    import mlflow
    from mlflow import MlflowClient

    import otel_forge

    logging.basicConfig(level=logging.ERROR)  # MLflow's async errors while hung: one line each, not tracebacks
    root = Path(tempfile.mkdtemp(prefix="log-latency-"))
    started = time.monotonic()
    server = MlflowServer(root).start()
    rows: list[Row] = []
    try:
        mlflow.set_tracking_uri(server.uri)
        run = otel_forge.TrainingRun(
            tracking_uri=server.uri,
            experiment="bench-log-latency",
            run_name="log-latency",
            system_metrics=False,
            handle_sigterm=False,
        )
        if not run.start():
            raise SystemExit("the run did not open")
        worker = run._worker
        mlflow.start_run(run_id=run.run_id)

        def ours(prefix: str) -> Callable[[int], None]:
            return lambda i: run.log({f"{prefix}/loss": 1.0 / (i + 1), f"{prefix}/lr": 0.001}, step=i)

        def fluent(prefix: str, synchronous: bool) -> Callable[[int], Any]:
            return lambda i: mlflow.log_metrics(
                {f"{prefix}/loss": 1.0 / (i + 1), f"{prefix}/lr": 0.001}, step=i, synchronous=synchronous
            )

        def measure(
            subject: str, phase: str, prefix: str, calls: int, call: Callable[[int], Any], note: str = ""
        ) -> Row:
            row = Row(subject, phase, prefix, note=note)
            gc.collect()
            timed_calls(row, calls, call)
            rows.append(row)
            return row

        # Warm-up outside the measured rows (first-call imports, connection setup).
        timed_calls(Row("warm", "warm", "warm"), 20, ours("warm_ours"))
        timed_calls(Row("warm", "warm", "warm"), 5, fluent("warm_sync", True))
        timed_calls(Row("warm", "warm", "warm"), 20, fluent("warm_async", False))
        mlflow.flush_async_logging()
        wait_until(lambda: worker.pending() == 0, args.drain_timeout)
        logging.getLogger("mlflow.utils.async_logging").setLevel(logging.CRITICAL)  # one line per failed call

        # --- otel_forge: healthy, then hung for --hung-seconds, then a bounded drain ---
        measure("`TrainingRun.log`", "healthy", "ours_healthy", args.calls, ours("ours_healthy"))
        drain_started = time.monotonic()
        wait_until(lambda: worker.pending() == 0, args.drain_timeout)
        ours_drain_s = time.monotonic() - drain_started
        healthy_drops = run._metrics.dropped
        server.pause()
        hung_started = time.monotonic()
        measure("`TrainingRun.log`", "hung (SIGSTOP)", "ours_hung", args.calls, ours("ours_hung"))
        time.sleep(max(0.0, args.hung_seconds - (time.monotonic() - hung_started)))
        hung_s = time.monotonic() - hung_started
        server.resume()
        resumed = time.monotonic()
        wait_until(lambda: worker.pending() == 0, args.drain_timeout)
        drain_after_hang_s = time.monotonic() - resumed

        # --- MLflow's fluent API, same run: healthy, then hung again (as long as its calls take) ---
        measure("`log_metrics` sync", "healthy", "sync_healthy", args.sync_calls, fluent("sync_healthy", True))
        measure("`log_metrics` async", "healthy", "async_healthy", args.calls, fluent("async_healthy", False))
        server.pause()
        mlflow_hung_started = time.monotonic()
        measure("`log_metrics` async", "hung (SIGSTOP)", "async_hung", args.calls, fluent("async_hung", False))
        measure(
            "`log_metrics` sync",
            "hung (SIGSTOP)",
            "sync_hung",
            args.hung_sync_calls,
            fluent("sync_hung", True),
            note=f"timeout {args.http_timeout:g} s, no retry",
        )
        server.resume()
        stats = worker.stats
        run.close()
        client = MlflowClient(server.uri)
        for row in rows:
            row.delivered = len(client.get_metric_history(run.run_id, f"{row.prefix}/loss"))
        async_rows = [row for row in rows if "async" in row.subject]
        async_delivered = sum(row.delivered or 0 for row in async_rows)
        async_window_s = time.monotonic() - mlflow_hung_started
        for row in async_rows:
            row.delivered = None  # still in MLflow's queue: reported in the footnote, not per row
        total_s = time.monotonic() - started
    finally:
        # Stopping the server first lets MLflow's async queue fail fast instead of sending the rest.
        logging.getLogger("mlflow").setLevel(logging.CRITICAL)
        server.stop()

    result = {
        "command": command,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "mlflow": mlflow.__version__,
        },
        "http_timeout_s": args.http_timeout,
        "hung_s": hung_s,
        "total_s": total_s,
        "ours_drain_healthy_s": ours_drain_s,
        "async_delivered": async_delivered,
        "async_calls": sum(row.calls for row in async_rows),
        "async_window_s": async_window_s,
        "drain_after_hang_s": drain_after_hang_s,
        "ours_buffer_capacity": run._metrics.max_values,
        "ours_dropped_healthy": healthy_drops,
        "ours_stats": {
            "delivered": stats.delivered,
            "retried": stats.retried,
            "dropped": stats.dropped + run._metrics.dropped,
            "hung_calls": stats.hung_calls,
        },
        "rows": [
            {
                "subject": r.subject,
                "phase": r.phase,
                "calls": r.calls,
                "errors": r.errors,
                "delivered": r.delivered,
                "note": r.note,
                **r.stats(),
            }
            for r in rows
        ],
    }
    print(json.dumps(result, indent=2) if args.json else render_markdown(result), flush=True)
    return 0


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"`{result['command']}`",
        "",
        f"Wall time per call in the calling thread, Python {m['python']}, mlflow {m['mlflow']}, {m['cpus']} CPUs; "
        f"a local `mlflow server` (sqlite, 1 worker); 2 metrics per call; hung = server SIGSTOPped (for "
        f"{result['hung_s']:.0f} s around TrainingRun's calls); `MLFLOW_HTTP_REQUEST_TIMEOUT="
        f"{result['http_timeout_s']:g}`, no retries.",
        "",
        "| subject | server | calls | p50 | p99 | max | errors | steps delivered |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        delivered = "-" if r["delivered"] is None else f"{r['delivered']}/{r['calls']}"
        note = f" ({r['note']})" if r["note"] else ""
        lines.append(
            f"| {r['subject']}{note} | {r['phase']} | {r['calls']} | {format_us(r['p50_us'])} | "
            f"{format_us(r['p99_us'])} | {format_us(r['max_us'])} | {r['errors']} | {delivered} |"
        )
    s = result["ours_stats"]
    lines += [
        "",
        f"TrainingRun buffers up to {result['ours_buffer_capacity']} metric values and sends them in `log_batch` "
        f"calls of up to 1000 ({s['delivered']} worker calls in all). Dropped: {result['ours_dropped_healthy']} "
        f"while healthy, {s['dropped']} in all; "
        f"retried {s['retried']}, hung calls {s['hung_calls']}; its queue drained in "
        f"{result['ours_drain_healthy_s']:.1f} s after the healthy phase, {result['drain_after_hang_s']:.1f} s after "
        f"the hang. MLflow's async queue (unbounded, one `log_batch` per call) had delivered "
        f"{result['async_delivered']} of its {result['async_calls']} calls {result['async_window_s']:.0f} s after "
        f"its hang began; the bench does not wait for the rest. Whole bench: {result['total_s']:.0f} s.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    code = main()
    sys.stderr.flush()
    # MLflow's atexit hook would send every call still in its async queue (to a stopped server): skip it.
    os._exit(code)
