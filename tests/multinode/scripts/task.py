"""One task of a simulated job: trains for a while through TrainingRun, MLflow's own API, or neither.

Its rank and node come from the harness's arguments (each launcher names them differently).
``--fail-node N --exit-code C``: the tasks of node N exit C. ``--orphan-s S``: leave behind a child
that resumes the run with ``mlflow.start_run()`` and exits S seconds later (MLflow's atexit ends
the run FINISHED then). ``--fail-first-attempt R``: under torchrun ``--max-restarts``, rank R exits 1
half way through the first attempt only; ``--log-attempt``: each step also logs ``attempt`` (torchrun's
restart count), so what a retry logged can be told apart. ``--wait-run S``: the ``TrainingRun`` task
leaves its block only once its run is open (S seconds at most), where the run opens late.
``--until PATH``: the task that neither logs nor fails trains until PATH exists (120 s at most), not
``--seconds``: a test ends the job once what it waits for has happened.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

UNTIL_AT_MOST_S = 120.0

ORPHAN = """
import sys, time, mlflow
mlflow.start_run()
time.sleep(float(sys.argv[1]))
"""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("trainingrun", "mlflow", "none"), default="none")
    # Under a real torchrun every worker gets the same arguments: its place comes from torchrun's variables.
    parser.add_argument("--rank", type=int, default=os.environ.get("RANK"))
    parser.add_argument("--node", type=int, default=os.environ.get("GROUP_RANK"))
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument(
        "--node-seconds", action="append", default=[], metavar="N:S", help="node N trains S seconds instead"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--first-step", type=int, default=0)
    parser.add_argument("--fail-node", type=int)
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--raise-on-node", type=int, help="node N's tasks raise inside the TrainingRun")
    parser.add_argument("--orphan-s", type=float)
    parser.add_argument("--fail-first-attempt", type=int, metavar="RANK")
    parser.add_argument("--log-attempt", action="store_true")
    parser.add_argument("--wait-run", type=float, default=0.0)
    parser.add_argument("--until", type=Path, metavar="PATH")
    parser.add_argument("launch_config", nargs="?")
    args = parser.parse_args()
    per_node = {int(node): float(s) for node, s in (item.split(":") for item in args.node_seconds)}
    seconds = per_node.get(args.node, args.seconds)
    steps = range(args.first_step, args.first_step + args.steps)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    fails_now = args.fail_first_attempt == args.rank and attempt == 0
    if args.api == "trainingrun":
        from otel_forge import TrainingRun

        with TrainingRun(config={"lr": 0.1, "model": {"dim": 8}}) as run:
            for step in steps:
                values = {"loss": 1.0 / (step + 1), **({"attempt": attempt} if args.log_attempt else {})}
                run.log(values, step)
                time.sleep(seconds / args.steps)
                if fails_now and step == args.first_step + args.steps // 2:
                    sys.exit(1)
            if args.raise_on_node == args.node:
                raise RuntimeError(f"node {args.node} diverged")
            opened_by = time.monotonic() + args.wait_run
            while run.run_id is None and time.monotonic() < opened_by:
                time.sleep(0.1)
    elif args.api == "mlflow" and args.rank == 0:
        import mlflow

        with mlflow.start_run():
            for step in steps:
                mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
                time.sleep(seconds / args.steps)
    elif args.until is not None:
        until = time.monotonic() + UNTIL_AT_MOST_S
        while not args.until.exists() and time.monotonic() < until:
            time.sleep(0.1)
    else:
        time.sleep(seconds)
    if args.orphan_s is not None:
        subprocess.Popen([sys.executable, "-c", ORPHAN, str(args.orphan_s)])
    return args.exit_code if args.fail_node in (None, args.node) else 0


if __name__ == "__main__":
    sys.exit(main())
