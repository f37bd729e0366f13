"""A Lightning ``Trainer`` with its ``MLFlowLogger``, on a tiny model and random data, CPU.

    python lightning_fit.py job-run    MLFlowLogger(run_id=otel_forge.job_run_id()): the documented line
    python lightning_fit.py default    MLFlowLogger() as most scripts have it: its own run, in lightning_logs
    python lightning_fit.py autolog    mlflow.pytorch.autolog() and the job-run line (it logs the model)

``--ddp``: Lightning's DDP on the CPU (gloo), 2 processes: Lightning starts rank 1 itself, running this
script again.

``MLFlowLogger`` creates its run with ``MlflowClient.create_run`` in its own experiment and ignores
``MLFLOW_RUN_ID`` and any active run: only its ``run_id=`` argument puts it in the job's run.
"""

from __future__ import annotations

import os
import sys

import lightning
import torch
from lightning.pytorch.loggers import MLFlowLogger

import otel_forge

STEPS = 5


class Regression(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        features, target = batch
        loss = torch.nn.functional.mse_loss(self.layer(features), target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(mode: str, ddp: bool) -> None:
    if mode == "autolog":
        import mlflow

        mlflow.pytorch.autolog()
    features = torch.randn(40, 4)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(features, features.sum(1, keepdim=True)))
    run_id = otel_forge.job_run_id() if mode in ("job-run", "autolog") else None
    logger = MLFlowLogger(run_id=run_id, tracking_uri=os.environ.get("MLFLOW_TRACKING_URI"))
    trainer = lightning.Trainer(
        max_steps=STEPS,
        logger=logger,
        log_every_n_steps=1,
        accelerator="cpu",
        **({"strategy": "ddp", "devices": 2} if ddp else {}),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression(), data)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # A rank that exits with gloo's threads still up may abort ("terminate called without an
        # active exception") while rank 0 still logs: torch's own advice is to tear the group down.
        torch.distributed.destroy_process_group()
    print("fit ended", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], "--ddp" in sys.argv[2:])
