"""What monitoring costs the training loop: steps/s against a bare loop, the CPU the training process
spends off the loop's thread, and the ``log-batch`` calls the server gets, for each way of monitoring.

Run:  python -m bench.overhead [--rounds 3] [--seconds 10] [--gpus 8] [--json]

Two loops, each in a fresh ``sys.executable`` process per measurement:

- ``gil``: pure Python holding the GIL (~1 ms a step), the shape of a loop that launches GPU kernels;
- ``torch``: a small MLP trained on CPU (torch, one intra-op thread).

Both log the loss 20 times a second (every 50 ms of the loop), except where the mode logs nothing; the
``-wide`` modes log 500 values per call (10,000 values a second). Modes: ``bare``; MLflow's own
``log_system_metrics=True`` (its sampler thread, nothing logged); MLflow's asynchronous logging
(``log_metrics(..., synchronous=False)``); ``TrainingRun`` sampling only, logging only, and both; and
``otel-forge run -- python LOOP`` (the loop logs through ``TrainingRun``;
the node is sampled by the ``otel-forge run`` process, outside the training process). Every sampler runs
at its default interval (10 s, MLflow's and ours) and sees ``--gpus`` fake NVIDIA GPUs (``tests/fakes``).

Each measurement: the mode is set up (sampler started), the loop warms up ``--warmup`` seconds,
logging as it will in the window, and until the run is open (a ``TrainingRun`` that names no
experiment opens its run at its first value: MLflow imported, the run made and described, ~1.2 s of
CPU on a thread of the training process, which a window that began first would count as logging's
cost; 60 s at most), then runs ``--seconds``. The CPU off the loop from the setup to the window, the
run's opening included, is reported apart. Reported, as the median over ``--rounds`` interleaved rounds (every
mode once per round, the order rotated): steps/s against the bare loop of the same round; the
training process's background CPU per second (its CPU time minus the loop thread's, which a busy
machine does not distort); ``log-batch`` requests per second the tracking server got in the window
(counted by a proxy in front of a real ``mlflow server``, sqlite, one worker).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

LOG_PERIOD_S = 0.05  # the loop logs 20 times a second, whatever its speed
OPEN_WAIT_S = 60.0  # the warmup waits this long at most for the run to be open
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
MODES = (
    "bare",
    "mlflow-system-metrics",
    "mlflow-async",
    "mlflow-async-wide",
    "trainingrun-sampling",
    "trainingrun-logging",
    "trainingrun-logging-wide",
    "trainingrun-both",
    "otel-forge-run",
    "trainingrun-before",
    "trainingrun-before-wide",
)
# The -before modes run TrainingRun as it was before the run journal (issue 30): its in-process
# buffer, worker threads and MLflow client, from this commit, in the same run as today's.
BEFORE_COMMIT = "2949113"
WIDE_KEYS = 500  # values per call in the -wide modes: ~10,000 values a second
LOOPS = ("gil", "torch")

Log = Callable[[float, int], None]


# --- the training process ---------------------------------------------------------------------


def _gil_step() -> Callable[[], float]:
    def step() -> float:
        total = 0
        for i in range(35_000):
            total += i * i
        return total % 97 / 97

    return step


def _torch_step() -> Callable[[], float]:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    inputs, targets = torch.randn(128, 256), torch.randint(0, 10, (128,))

    def step() -> float:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        return float(loss)

    return step


@contextlib.contextmanager
def _monitoring(mode: str) -> Iterator[tuple[Log | None, Callable[[], bool]]]:
    """The mode set up around the loop: what the loop calls to log its loss (None: it logs nothing),
    and whether the run is open yet."""
    if mode == "bare":
        yield None, lambda: True
    elif mode.startswith("mlflow"):
        import mlflow

        with mlflow.start_run(log_system_metrics=mode == "mlflow-system-metrics"):
            if mode.startswith("mlflow-async"):
                yield (
                    lambda loss, step: mlflow.log_metrics(_values(mode, loss), step=step, synchronous=False),
                    lambda: True,
                )
            else:
                yield None, lambda: True
            mlflow.flush_async_logging()
    else:
        from otel_forge import TrainingRun

        with TrainingRun(system_metrics=mode in ("trainingrun-sampling", "trainingrun-both")) as run:
            log = (
                None if mode == "trainingrun-sampling" else (lambda loss, step: run.log(_values(mode, loss), step=step))
            )
            # A TrainingRun that names no experiment opens its run at its first value (or once
            # OTEL_FORGE_EXPERIMENT_WAIT has passed): MLflow imported, the run made and described, on
            # a thread of this process. The window starts once that is done.
            yield log, lambda: run.run_id is not None


def _values(mode: str, loss: float) -> dict[str, float]:
    if mode.endswith("-wide"):
        return {f"layer{i}/grad_norm": loss for i in range(WIDE_KEYS)}
    return {"loss": loss}


def measure(mode: str, loop: str, seconds: float, warmup_s: float) -> dict[str, float]:
    """Run ``loop`` under ``mode`` in this process; what the window cost it."""
    step = _gil_step() if loop == "gil" else _torch_step()
    set_up_at, setup_cpu0, setup_loop0 = time.perf_counter(), time.process_time(), time.thread_time()
    with _monitoring(mode) as (log, opened):
        # The warmup logs as the window does (a run opened at its first value is open before the
        # window), and lasts until the run is open, OPEN_WAIT_S at most.
        warm, now = 0, time.perf_counter()
        deadline, given_up_at, next_log = now + warmup_s, now + OPEN_WAIT_S, now
        while (now := time.perf_counter()) < deadline or (not opened() and now < given_up_at):
            loss = step()
            warm += 1
            if log is not None and now >= next_log:
                log(loss, warm)
                next_log += LOG_PERIOD_S
        started_at, cpu0, loop0, t0 = time.time(), time.process_time(), time.thread_time(), time.perf_counter()
        setup_s, setup_cpu = t0 - set_up_at, (cpu0 - setup_cpu0) - (loop0 - setup_loop0)
        open_in_window = opened()
        steps, logs, next_log, in_log = 0, 0, t0, 0.0
        while (now := time.perf_counter()) - t0 < seconds:
            loss = step()
            steps += 1
            if log is not None and now >= next_log:
                before = time.thread_time()
                log(loss, warm + steps)
                in_log += time.thread_time() - before
                logs, next_log = logs + 1, next_log + LOG_PERIOD_S
        elapsed = now - t0
        cpu, loop_cpu = time.process_time() - cpu0, time.thread_time() - loop0
        ended_at = time.time()
    return {
        "steps_per_s": steps / elapsed,
        "background_cpu_ms_per_s": (cpu - loop_cpu) / elapsed * 1000,
        "log_call_cpu_ms_per_s": in_log / elapsed * 1000,  # on the loop's own thread, inside log()
        "values_per_s": logs * len(_values(mode, 0.0)) / elapsed,
        # Before the window: entering the mode and the warmup, the run's opening included.
        "setup_s": setup_s,
        "setup_background_cpu_s": setup_cpu,
        "opened_before_window": float(open_in_window),
        "started_at": started_at,
        "ended_at": ended_at,
    }


# --- the driver -------------------------------------------------------------------------------


def _child(mode: str, loop: str, args: argparse.Namespace, env: dict[str, str], out: Path) -> dict[str, float]:
    # `-m` puts the working directory first on the path: the package found there is the one measured.
    cwd = out.parent / "before" if mode.startswith("trainingrun-before") else None
    inner = [sys.executable, "-m", "bench.overhead", "--child", mode, loop, str(out)]
    inner += ["--seconds", str(args.seconds), "--warmup", str(args.warmup)]
    command = [sys.executable, "-m", "otel_forge.cli", "run", "--", *inner] if mode == "otel-forge-run" else inner
    subprocess.run(
        command, env=env, cwd=cwd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300
    )
    return json.loads(out.read_text())


def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    from bench._common import REPO_ROOT
    from testkit.gpu_fakes import fake_gpu_env
    from testkit.hermetic import hermetic_environ
    from testkit.mlflow_server import MlflowServer
    from testkit.proxy import MlflowProxy

    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        MlflowServer(Path(tmp)).start() as server,
        MlflowProxy(server.uri) as proxy,
    ):
        env = fake_gpu_env({"count": args.gpus}, base=hermetic_environ())
        env.update(
            MLFLOW_TRACKING_URI=proxy.uri,
            OTEL_FORGE_PROMETHEUS="false",
            PYTHONPATH=os.pathsep.join([str(REPO_ROOT), env["PYTHONPATH"]]),
        )
        if any(mode.startswith("trainingrun-before") for mode in args.modes):
            _extract_before(REPO_ROOT, Path(tmp) / "before")
        for round_index in range(args.rounds):
            shift = round_index % len(args.modes)
            for loop in args.loops:
                for mode in [*args.modes[shift:], *args.modes[:shift]]:
                    result = _child(mode, loop, args, env, Path(tmp) / "result.json")
                    result["log_batch_per_s"], result["delivered_per_s"] = _delivered(proxy, result)
                    results.setdefault((loop, mode), []).append(result)
                    print(
                        f"round {round_index + 1} {loop} {mode}: {result['steps_per_s']:.0f} steps/s", file=sys.stderr
                    )
    return _summary(results, args)


def _extract_before(repo: Path, into: Path) -> None:
    """The package as it was at ``BEFORE_COMMIT``, importable from ``into``."""
    into.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(repo), "archive", BEFORE_COMMIT, "otel_forge"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)


def _delivered(proxy: Any, result: dict[str, float]) -> tuple[float, float]:
    """``log-batch`` requests, and the metric values they carried, per second the server got them
    while the loop was measured."""
    bodies = [body for at, body in proxy.arrivals(LOG_BATCH) if result["started_at"] <= at <= result["ended_at"]]
    seconds = result["ended_at"] - result["started_at"]
    return len(bodies) / seconds, sum(len((body or {}).get("metrics", ())) for body in bodies) / seconds


def _summary(results: dict[tuple[str, str], list[dict[str, float]]], args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for (loop, mode), runs in results.items():
        bare = results[(loop, "bare")]
        loss = [1 - run["steps_per_s"] / base["steps_per_s"] for run, base in zip(runs, bare, strict=True)]
        rows.append(
            {
                "loop": loop,
                "mode": mode,
                "steps_per_s": statistics.median(r["steps_per_s"] for r in runs),
                "steps_lost_pct": 100 * statistics.median(loss),
                "background_cpu_ms_per_s": statistics.median(r["background_cpu_ms_per_s"] for r in runs),
                "log_call_cpu_ms_per_s": statistics.median(r["log_call_cpu_ms_per_s"] for r in runs),
                "values_per_s": statistics.median(r["values_per_s"] for r in runs),
                "log_batch_per_s": statistics.median(r["log_batch_per_s"] for r in runs),
                "delivered_per_s": statistics.median(r["delivered_per_s"] for r in runs),
                "setup_s": statistics.median(r["setup_s"] for r in runs),
                "setup_background_cpu_s": statistics.median(r["setup_background_cpu_s"] for r in runs),
                "opened_before_window": min(r["opened_before_window"] for r in runs) == 1.0,
            }
        )
    return {"rounds": args.rounds, "seconds": args.seconds, "gpus": args.gpus, "rows": rows}


def markdown(summary: dict[str, Any]) -> str:
    lines = [
        f"{summary['rounds']} interleaved rounds of {summary['seconds']:g} s per mode and loop; medians. "
        f"{summary['gpus']} fake GPUs; samplers at their default 10 s interval.",
        "",
        "| loop | mode | steps/s | steps/s lost vs bare | training process CPU off the loop | CPU in `log()` "
        "| values logged/s | `log-batch`/s | values delivered/s | CPU per value (off the loop + in `log()`) "
        "| CPU off the loop before the window (setup, warmup, run opened) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in summary["rows"]:
        lines.append(
            f"| {row['loop']} | {row['mode']} | {row['steps_per_s']:.0f} | {row['steps_lost_pct']:+.1f}% "
            f"| {row['background_cpu_ms_per_s']:.2f} ms/s | {row['log_call_cpu_ms_per_s']:.2f} ms/s "
            f"| {row['values_per_s']:.0f} | {row['log_batch_per_s']:.2f} "
            f"| {row['delivered_per_s']:.0f} | {_per_value(row)} "
            f"| {row['setup_background_cpu_s']:.2f} s in {row['setup_s']:.1f} s |"
        )
    if late := [row["mode"] for row in summary["rows"] if not row["opened_before_window"]]:
        lines += ["", f"The run was not open when the window began (after {OPEN_WAIT_S:g} s) in: {', '.join(late)}."]
    return "\n".join(lines)


def _per_value(row: dict[str, Any]) -> str:
    """The training process's CPU for logging (its threads off the loop, and inside ``log()``) per value logged."""
    if not row["values_per_s"]:
        return ""
    return f"{(row['background_cpu_ms_per_s'] + row['log_call_cpu_ms_per_s']) / row['values_per_s'] * 1000:.1f} µs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per mode (default 10)")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of loop before measuring (default 3)")
    parser.add_argument("--gpus", type=int, default=8, help="fake NVIDIA GPUs every sampler sees (default 8)")
    parser.add_argument("--loops", nargs="+", choices=LOOPS, default=list(LOOPS), help="loops to run (default both)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="modes to run (default all)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--child", nargs=3, metavar=("MODE", "LOOP", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mode, loop, out = args.child
        Path(out).write_text(json.dumps(measure(mode, loop, args.seconds, args.warmup)))
        return
    summary = run_bench(args)
    print(json.dumps(summary, indent=2) if args.json else markdown(summary))


if __name__ == "__main__":
    main()
