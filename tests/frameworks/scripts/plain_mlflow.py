"""A loop that knows only ``mlflow.log_metric``, as a user's script, with or without otel_forge in code.

    python plain_mlflow.py [--in-code] [--steps N] [--sleep S] [--exit N] [--raise] [--sys-exit N]
                           [--log-system-metrics]

``--in-code``: the loop inside ``with otel_forge.TrainingRun(run_name="plain-in-code")``; ``--raise``
raises in the loop's block, ``--sys-exit N`` calls ``sys.exit(N)`` in it, ``--exit N`` returns N after it.
``--log-system-metrics``: the loop opens its run with ``mlflow.start_run(log_system_metrics=True)``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import mlflow


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--in-code", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--raise", dest="fail", action="store_true")
    parser.add_argument("--sys-exit", type=int)
    parser.add_argument("--log-system-metrics", action="store_true")
    args = parser.parse_args()
    around: contextlib.AbstractContextManager = contextlib.nullcontext()
    if args.in_code:
        import otel_forge

        around = otel_forge.TrainingRun(run_name="plain-in-code")
    with around:
        if args.log_system_metrics:
            mlflow.start_run(log_system_metrics=True)
        for step in range(args.steps):
            mlflow.log_metric("loss", 1.0 / (step + 1), step=step)
            print(f"step {step}", flush=True)
            time.sleep(args.sleep)
        if args.fail:
            raise RuntimeError("the loop failed")
        if args.sys_exit is not None:
            sys.exit(args.sys_exit)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
