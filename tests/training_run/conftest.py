"""Fixtures for the TrainingRun tests: a client on the session server, isolation of the env."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from trun_helpers import unique

# Launcher, run and MLflow variables that would change what a TrainingRun does.
_ISOLATED_ENV = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID",
                 "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "NODE_RANK", "NNODES",
                 "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID",
                 "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID",
                 "PALS_LOCAL_RANKID", "OTEL_FORGE_NODE_ID", "MLFLOW_SYSTEM_METRICS_NODE_ID",
                 "OTEL_FORGE_CALL_DEADLINE", "OTEL_FORGE_DRAIN_DEADLINE", "OTEL_FORGE_QUEUE_SIZE")


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    for name in _ISOLATED_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.uri)


@pytest.fixture
def experiment():
    """A fresh experiment name per test, so runs can be counted."""
    return unique("trun")
