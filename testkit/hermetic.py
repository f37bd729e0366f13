"""The hermetic environment of a test: without what would steer an agent, a run or MLflow's client
behind the test's back (OTel endpoints, node ids, run and tracking settings, launcher ranks).

``apply_hermetic(monkeypatch, ...)`` cleans this process's environment for one test (a conftest's
autouse fixture calls it); ``hermetic_environ(...)`` is the same environment for a subprocess.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

# OTel settings (otel-forge's own OTEL_FORGE_* among them) and MLflow's system-metrics settings.
HERMETIC_PREFIXES = ("OTEL_", "MLFLOW_SYSTEM_METRICS_")
TRACKING_VARS = ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME")
LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
    "GROUP_WORLD_SIZE",
    "NNODES",
    "SLURM_JOB_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURM_NTASKS",
    "SLURM_JOB_NUM_NODES",
    "SLURM_NNODES",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_RANK",
    "PMI_SIZE",
    "MPI_LOCALRANKID",
    "PALS_LOCAL_RANKID",
    # Kubernetes: what makes a process a pod of a job (otel_forge.kubernetes), and torchrun's PET_*
    # defaults that a PyTorchJob's pods carry.
    "KUBERNETES_SERVICE_HOST",
    "JOB_COMPLETION_INDEX",
    "JOBSET_NAME",
    "PET_NNODES",
    "PET_NODE_RANK",
    "PET_NPROC_PER_NODE",
    "PET_RDZV_ID",
    "PET_RDZV_ENDPOINT",
    "PET_MASTER_ADDR",
)


def steers(name: str, prefixes: tuple[str, ...] = HERMETIC_PREFIXES) -> bool:
    """Whether variable ``name`` would steer an agent or a run (``prefixes``: which prefixes do)."""
    return name.startswith(prefixes) or name in TRACKING_VARS or name in LAUNCHER_VARS


def hermetic_environ(
    extra: Mapping[str, str] | None = None, *, prefixes: tuple[str, ...] = HERMETIC_PREFIXES, **more: str
) -> dict[str, str]:
    """This process's environment without steering variables, unbuffered, plus ``extra`` and ``more``
    (for a subprocess)."""
    env = {name: value for name, value in os.environ.items() if not steers(name, prefixes)}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    env.update(more)
    return env


def apply_hermetic(
    monkeypatch: pytest.MonkeyPatch,
    *,
    prefixes: tuple[str, ...] = HERMETIC_PREFIXES,
    http_timeout_s: int | None = None,
    **setenv: str,
) -> None:
    """Remove the steering variables from this process's environment for one test.

    With ``http_timeout_s``, MLflow's client makes one attempt per request with that timeout: a dead
    or failing server fails one call fast, and otel-forge's own worker does the retrying (MLflow's
    HTTP defaults would hide an outage inside one call for minutes). ``setenv``: more variables to set.
    """
    for name in list(os.environ):
        if steers(name, prefixes):
            monkeypatch.delenv(name)
    if http_timeout_s is not None:
        fail_fast_http(monkeypatch, http_timeout_s)
    for name, value in setenv.items():
        monkeypatch.setenv(name, value)


def fail_fast_http(monkeypatch: pytest.MonkeyPatch, timeout_s: int) -> None:
    """MLflow's client, for one test: one attempt per request, ``timeout_s`` each."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", str(timeout_s))
