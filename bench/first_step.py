"""What otel_forge adds before a training script's first step, against the bare script and MLflow's own
``start_run``, on a reachable server.

Setup: a private ``mlflow server`` (testkit.mlflow_server.MlflowServer: sqlite, 127.0.0.1, one worker),
warmed by one run of each variant first. Each round starts each variant as a fresh process, in turn,
and takes the wall time from just before its start to its first step (the script prints
``time.time()`` there); the first step is where the block is entered, before any training. Variants:

- ``bare``: the script alone (Python's start, its own imports: none heavy);
- ``mlflow_start_run``: ``import mlflow``, ``set_experiment`` and ``with mlflow.start_run():``;
- ``training_run``: ``with TrainingRun(experiment=...):`` (rank 0: its companion opens the run; the
  block begins at once, and MLflow's import in it would wait for the run, within ``start_wait_s``);
- ``training_run_rank1``: the same block in rank 1 of a torchrun job of 2 (its variables; no run to
  wait for: it journals nothing and samples nothing);
- ``otel_forge_run``: ``otel-forge run -- python bare.py`` (the script starts as the launcher opens the
  run: its MLflow import would wait for it; its node's agent starts once it runs).

Python caches each module's bytecode (``PYTHONDONTWRITEBYTECODE`` is dropped): the warm-up round writes
it, as installing a package does.

Reported: each variant's median over the rounds, and what it adds to ``bare``'s median. The goal
(issue 43) is at most 0.3 s added before the first step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

from bench._common import REPO_ROOT, private_server
from testkit.hermetic import hermetic_environ

FIRST_STEP = "import time; print('first-step', time.time(), flush=True)"

SCRIPTS = {
    "bare": FIRST_STEP,
    "mlflow_start_run": f"""
import mlflow, sys
mlflow.set_experiment(sys.argv[1])
with mlflow.start_run():
    {FIRST_STEP}
""",
    "training_run": f"""
import sys
from otel_forge import TrainingRun
with TrainingRun(experiment=sys.argv[1], system_metrics=False):
    {FIRST_STEP}
""",
}
SCRIPTS["training_run_rank1"] = SCRIPTS["training_run"]  # the same block, under rank 1's variables
SCRIPTS["otel_forge_run"] = SCRIPTS["bare"]  # the bare script, as the launcher's CMD
VARIANTS = tuple(SCRIPTS)
RANK1 = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
         "TORCHELASTIC_RUN_ID": "first-step"}  # fmt: skip


def _command(variant: str, script: Path, experiment: str) -> list[str]:
    if variant == "otel_forge_run":
        cli = shutil.which("otel-forge", path=str(Path(sys.executable).parent)) or "otel-forge"
        return [cli, "run", "--experiment", experiment, "--", sys.executable, str(script), experiment]
    return [sys.executable, str(script), experiment]


def first_step_s(variant: str, uri: str, tmp: Path) -> float:
    """Seconds from just before the variant's process starts to its first step."""
    script = tmp / f"{variant}.py"
    script.write_text(SCRIPTS[variant])
    experiment = f"first-step-{uuid.uuid4().hex[:8]}"
    extra = RANK1 if variant == "training_run_rank1" else {}
    env = hermetic_environ(
        MLFLOW_TRACKING_URI=uri, OTEL_FORGE_SPOOL_DIR=str(tmp / "spool"), PYTHONPATH=str(REPO_ROOT), **extra
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # an installed package's modules start from their bytecode
    began = time.time()
    done = subprocess.run(
        _command(variant, script, experiment), env=env, capture_output=True, text=True, timeout=300, cwd=tmp
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("first-step ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{variant} exited {done.returncode}: {done.stderr[-3000:]}")
    return float(lines[0].split()[1]) - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with private_server() as (tmp, server):
        for variant in VARIANTS:  # warm-up: the server's first calls import what they use; caches fill
            first_step_s(variant, server.uri, tmp)
        rounds: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for _ in range(args.rounds):
            for variant in VARIANTS:  # interleaved: a noisy moment costs every variant alike
                rounds[variant].append(first_step_s(variant, server.uri, tmp))
    medians = {variant: statistics.median(values) for variant, values in rounds.items()}
    if args.json:
        print(json.dumps({"rounds": rounds, "medians": medians, "cpus": os.cpu_count()}, indent=2))
        return 0
    print(f"`python -m bench.first_step --rounds {args.rounds}` ({os.cpu_count()} CPUs)\n")
    print("| variant | first step (s, median) | added to bare (s) | min-max (s) |")
    print("|---|---:|---:|---|")
    for variant in VARIANTS:
        values = rounds[variant]
        added = medians[variant] - medians["bare"]
        print(f"| {variant} | {medians[variant]:.3f} | {added:+.3f} | {min(values):.3f}-{max(values):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
