"""A tracking server down for the first minutes of a job that logs thousands of values a second: what
reaches the run, and how long after the server answers.

Run:  python -m bench.outage_start [--down-s 180] [--rate 5000] [--after-s 30] [--fixed] [--json]

Setup (``testkit.outage``, which the fault test ``tests/faults/test_fault_matrix.py`` runs scaled down):
a training job (``TrainingRun``, ``system_metrics=False``, its companion delivering) logs ``--rate``
values a second, 100 per ``log()`` call, into a tracking server whose port refuses connections;
``--down-s`` after its first value a private ``mlflow server`` (sqlite, 127.0.0.1, one worker) starts
on that port; the job logs on until its run has caught up with it (holds all but its last 2 s of
values), then ``--after-s`` more (``--fixed``: ``--after-s`` from the server's first answer, caught up
or not), then leaves its block (the default drain deadline, 10 s).

Reported: values logged (and dropped), the journal's size when the server answered (the backlog on
disk), how long after the server's first answer the backlog was in the run (the run opens first: the
opener retries at most every 10 s) and the run had caught up with the job (the server's throughput,
less the job's rate, clears the backlog), how long after the job's last ``log()`` its last value was, the
job's close, and what the run holds at the end (from the server's database: its values, any (key,
step) held twice) and its status. The outage counted is from the job's first value to the server's
first answer: ``--down-s`` plus the server's own start (several seconds on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from testkit.outage import OutageResult, run_outage


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--down-s", type=float, default=180.0, help="the server starts this long after the first value")
    parser.add_argument("--rate", type=float, default=5000.0, help="values a second the job logs (100 a call)")
    parser.add_argument(
        "--after-s", type=float, default=30.0, help="the job logs on this long once its run has caught up"
    )
    parser.add_argument(
        "--fixed", action="store_true", help="--after-s counts from the server's answer, caught up or not"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    # A SIGTERM ends the bench through its finally blocks: its job's and server's process groups go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as root:
        result = run_outage(
            Path(root), down_s=args.down_s, rate=args.rate, after_s=args.after_s, catch_up=not args.fixed
        )
    report = summary(result)
    report["fixed"] = args.fixed
    report["command"] = "python -m bench.outage_start " + shlex.join(argv if argv is not None else sys.argv[1:])
    report["machine"] = {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()}
    print(json.dumps(report, indent=2) if args.json else render_markdown(report), flush=True)
    return 0 if report["every_value_once"] and result.status == "FINISHED" else 1


def summary(result: OutageResult) -> dict[str, Any]:
    fields = {k: v for k, v in dataclasses.asdict(result).items() if k not in ("stderr", "kept_steps")}
    fields["every_value_once"] = result.in_mlflow == result.logged and result.repeated == 0
    fields["backlog_rate"] = round(result.backlog / result.backlog_in_s) if result.backlog_in_s else None
    fields["warnings"] = [line for line in result.stderr.splitlines() if line.strip()][-5:]
    return fields


def render_markdown(r: dict[str, Any]) -> str:
    def seconds(value: float | None) -> str:
        return "never" if value is None else f"{value:.1f} s"

    m = r["machine"]
    return "\n".join(
        [
            f"`{r['command']}` (Python {m['python']}, {m['cpus']} CPUs)",
            "",
            "| measure | value |",
            "|---|---:|",
            f"| server down (first value to first answer) | {r['down_s']:.1f} s |",
            f"| rate logged | {r['rate']:,.0f} values/s |",
            f"| values logged (log() reported no drop) | {r['logged']:,} |",
            f"| values dropped | {r['dropped']:,} |",
            f"| backlog when the server answered | {r['backlog']:,} values, "
            f"journal {r['journal_bytes'] / 2**20:.1f} MiB |",
            f"| the journal at its largest (every value of the job, until its end is delivered) | "
            f"{r['journal_max_bytes'] / 2**20:.1f} MiB |",
            f"| backlog in the run, after the server answered | {seconds(r['backlog_in_s'])}"
            + (f" ({r['backlog_rate']:,} values/s)" if r["backlog_rate"] else "")
            + " |",
            f"| run caught up with the job (lag <= 2 s), after the server answered | {seconds(r['caught_up_s'])} |",
            f"| job logged on after {'the server answered' if r['fixed'] else 'its run caught up'} | "
            f"{r['after_s']:.0f} s |",
            f"| last value in the run, after the last log() | {seconds(r['last_in_s'])} |",
            f"| the job's close (leaving the block) | {r['close_s']:.1f} s |",
            f"| values in MLflow at the end | {r['in_mlflow']:,} ({r['repeated']} (key, step) twice) |",
            f"| the run's status | {r['status']} |",
            f"| every value once | {'yes' if r['every_value_once'] else 'NO'} |",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
