"""A Hugging Face ``Trainer(report_to=["mlflow"])`` job on a tiny model built from its config (no hub
download), random data, CPU. HF's ``MLflowCallback`` opens (or resumes) the run inside ``train()``.

    python hf_trainer.py plain [--exit N]   trainer.train(), as a user's script
    python hf_trainer.py trainingrun        inside ``with otel_forge.TrainingRun(run_name=...)``
    python hf_trainer.py monitor            inside ``with otel_forge.monitor()``
    python hf_trainer.py raise              trainer.train(), then an exception

``--step-sleep S`` makes each step last S seconds more and print ``step N`` (a job to signal mid-way).
``--fail-rank R`` makes global rank R raise at step 3 (under ``torchrun``: a worker that fails).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

STEPS = 6


class RandomSequences(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(index)
        return {"input_ids": torch.randint(0, 32, (8,), generator=generator), "labels": torch.tensor(index % 2)}


class FailingRank(TrainerCallback):
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == 3 and int(os.environ.get("RANK", "0")) == self.rank:
            raise ValueError(f"rank {self.rank} fails at step 3")


class SlowSteps(TrainerCallback):
    def __init__(self, sleep_s: float) -> None:
        self.sleep_s = sleep_s

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        print(f"step {state.global_step}", flush=True)
        time.sleep(self.sleep_s)


def train(step_sleep_s: float, fail_rank: int | None = None) -> None:
    config = BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    with tempfile.TemporaryDirectory() as output_dir:
        args = TrainingArguments(
            output_dir=output_dir,
            max_steps=STEPS,
            per_device_train_batch_size=4,
            logging_steps=1,
            report_to=["mlflow"],
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
        )
        callbacks: list[TrainerCallback] = [SlowSteps(step_sleep_s)] if step_sleep_s else []
        if fail_rank is not None:
            callbacks.append(FailingRank(fail_rank))
        model = BertForSequenceClassification(config)
        Trainer(model=model, args=args, train_dataset=RandomSequences(), callbacks=callbacks).train()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["plain", "trainingrun", "monitor", "raise"])
    parser.add_argument("--exit", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--fail-rank", type=int, default=None)
    args = parser.parse_args()
    import otel_forge

    around: contextlib.AbstractContextManager = contextlib.nullcontext()
    if args.mode == "trainingrun":
        around = otel_forge.TrainingRun(run_name="hf-in-code", config={"model": "tiny-bert"})
    elif args.mode == "monitor":
        around = otel_forge.monitor(prometheus=False)
    with around:
        print(f"mlflow imported as the block began: {'mlflow' in sys.modules}", flush=True)
        train(args.step_sleep, args.fail_rank)
        if args.mode == "raise":
            raise RuntimeError("after training")
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
