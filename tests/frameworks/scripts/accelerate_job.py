"""An HF accelerate job: a tiny linear model, gloo on the CPU, ``init_trackers(PROJECT, config=CONFIG)``
and the loss logged each step through accelerate's MLflow tracker, as a user's script does.

    python accelerate_job.py plain          accelerate alone (under ``otel-forge run``, or nothing)
    python accelerate_job.py trainingrun    inside ``with otel_forge.TrainingRun(config=CONFIG)``, every rank
    python accelerate_job.py repeat N       ``trainingrun`` N times, each a job of its own (``OTEL_FORGE_JOB_ID``);
                                            rank 0 prints the run's params as each block begins

Launch it once, or in 2 processes (``accelerate launch --multi_gpu --cpu --num_processes 2``).
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator

PROJECT = "proj"
CONFIG = {"lr": 0.05, "batch_size": 4, "model": "tiny-linear"}
STEPS = 5


def train(accelerator: Accelerator) -> None:
    """One job's training: its trackers opened, the loss logged, its trackers finished (the process
    group stays for the next repetition: ``end_training`` ends it)."""
    accelerator.trackers = []  # init_trackers adds to the last job's
    accelerator.init_trackers(PROJECT, config=CONFIG)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=CONFIG["lr"])
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    for step in range(STEPS):
        loss = model(torch.randn(CONFIG["batch_size"], 4, generator=generator)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.log({"loss": loss.item()}, step=step)
    for tracker in accelerator.trackers:
        tracker.finish()


def say_params_at_entry(run_id: str | None) -> None:
    """What the run holds when the block begins: the config's params are in before accelerate logs
    the same ones (MLflow fails one of two writers inserting a param at once)."""
    import mlflow

    params = mlflow.MlflowClient().get_run(run_id).data.params if run_id else {}
    print(f"params at entry: {','.join(sorted(k for k in params if k in CONFIG))}", flush=True)


def main(mode: str, repeat: int = 1) -> None:
    accelerator = Accelerator(cpu=True, log_with="mlflow")
    if mode == "plain":
        train(accelerator)
        # Both ranks leave the process group together: one destroying gloo's group while its peer
        # still ends its tracker aborted in torch's C++ ("terminate called without an active
        # exception", SIGABRT) about one run in five here, with or without this stop's changes.
        accelerator.wait_for_everyone()
        accelerator.end_training()
        return
    from otel_forge import TrainingRun

    job = os.environ.get("TORCHELASTIC_RUN_ID", "single")
    for i in range(repeat):
        if repeat > 1:
            os.environ["OTEL_FORGE_JOB_ID"] = f"{job}-{i}"
            print(f"repetition {i}", flush=True)
        with TrainingRun(config=CONFIG) as run:
            if accelerator.is_main_process:
                say_params_at_entry(run.run_id)
            train(accelerator)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 1)
