"""A training script that knows nothing of otel_forge: it calls mlflow.log_metric.

    otel-forge run -- python examples/train_plain_mlflow.py --steps 30

makes one job in the experiment: the run otel-forge opens holds the node's system metrics, git
state and the launch command; the run MLflow starts for this script's first mlflow.log_metric is
its child (mlflow.parentRunId), holding the script's loss and params. A script that starts a run
per fit (mlflow.start_run, autologging) gets one child per fit, all in the same job.
"""

from __future__ import annotations

import argparse
import random

import mlflow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--exit-code", type=int, default=0)
    args = parser.parse_args()
    loss = 1.0
    for step in range(args.steps):
        loss *= random.uniform(0.85, 0.99)
        mlflow.log_metric("loss", loss, step=step)
    mlflow.log_param("steps", args.steps)
    raise SystemExit(args.exit_code)


if __name__ == "__main__":
    main()
