"""Fixtures of the MLflow tests: a hermetic environment, a client of the session's real server,
a fresh experiment per test, and the counting proxy (tests/mlflow/proxies.py).

tests/mlflow has no ``__init__.py`` on purpose: ``import mlflow`` must find the real package, and
the helpers here are imported as plain modules (``from proxies import CountingProxy``).
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hermetic import HERMETIC_NAMES, HERMETIC_PREFIXES  # noqa: E402
from proxies import CountingProxy  # noqa: E402


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(os.environ):
        if name.startswith(HERMETIC_PREFIXES) or name in HERMETIC_NAMES:
            monkeypatch.delenv(name)
    # A dead or failing server must fail one call fast: our own worker retries, not MLflow's
    # HTTP layer (whose defaults would hide an outage inside one call for minutes).
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    # A spool, if one is written, lands in the test's own directory.
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def client(mlflow_server):
    from mlflow import MlflowClient

    return MlflowClient(mlflow_server.uri)


@pytest.fixture
def experiment_id(client) -> str:
    return client.create_experiment(f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def proxy(mlflow_server):
    with CountingProxy(mlflow_server.uri) as counting:
        yield counting
