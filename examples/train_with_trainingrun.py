"""A small training loop that logs through otel_forge.TrainingRun (plain Python, NumPy if present).

    otel-forge run -- python examples/train_with_trainingrun.py --steps 50
or simply
    python examples/train_with_trainingrun.py --steps 50

then `mlflow ui` in the same folder shows the run: loss, params, git state and system metrics.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import otel_forge


@dataclass
class Optimizer:
    lr: float = 0.05
    momentum: float = 0.9


@dataclass
class TrainConfig:
    steps: int = 50
    batch_size: int = 32
    optimizer: Optimizer = field(default_factory=Optimizer)
    layers: list[int] = field(default_factory=lambda: [16, 16])
    checkpoint_every: int = 25


def train_step(weight: float, config: TrainConfig) -> tuple[float, float]:
    """One step of fitting y = 3x with noisy gradient descent: (new weight, loss)."""
    xs = [random.uniform(-1, 1) for _ in range(config.batch_size)]
    grad = sum(2 * (weight * x - 3 * x) * x for x in xs) / len(xs)
    weight -= config.optimizer.lr * grad
    loss = sum((weight * x - 3 * x) ** 2 for x in xs) / len(xs)
    return weight, loss


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    config = TrainConfig(steps=args.steps)
    checkpoints = Path(tempfile.mkdtemp(prefix="checkpoints-"))
    with otel_forge.TrainingRun(
        config=config,
        run_name="example-trainingrun",
        description="otel_forge example",
        tags={"example": "trainingrun"},
        register_checkpoints=True,
    ) as run:
        weight = 0.0
        for step in range(config.steps):
            weight, loss = train_step(weight, config)
            run.log({"train/loss": loss, "train/weight": weight, "train/lr": config.optimizer.lr}, step=step)
            if (step + 1) % config.checkpoint_every == 0:
                directory = checkpoints / f"step-{step}"
                directory.mkdir()
                (directory / "weight.txt").write_text(repr(weight))
                run.register_checkpoint(step, directory)
    # A server that never answered: the run is made when `otel-forge replay` delivers what was kept.
    where = run.run_id or f"'{run.run_name}' in experiment {run.experiment}, once otel-forge replay delivers it"
    print(f"final loss {loss:.5f} (log10 {math.log10(loss + 1e-12):.1f}); MLflow run {where}")


if __name__ == "__main__":
    main()
