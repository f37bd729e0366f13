"""The environment of an MLflow test: without what would steer an agent behind the test's back."""

from __future__ import annotations

import os

# What would change an agent's behaviour behind a test's back: node ids, run ids, OTel
# endpoints, launcher ranks.
HERMETIC_PREFIXES = ("OTEL_", "MLFLOW_SYSTEM_METRICS_")
HERMETIC_NAMES = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME",
                  "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "GROUP_WORLD_SIZE", "NNODES",
                  "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_JOB_NUM_NODES",
                  "SLURM_NNODES", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
                  "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID")


def hermetic_environ(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment without agent-steering variables, plus ``extra`` (for subprocesses)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(HERMETIC_PREFIXES) and k not in HERMETIC_NAMES}
    env.update(extra or {})
    return env
