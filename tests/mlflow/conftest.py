"""Fixtures of the MLflow tests: a hermetic environment (testkit/hermetic.py), a fresh experiment per
test, and the proxy in front of the session's real server (testkit/proxy.py).

tests/mlflow has no ``__init__.py`` on purpose: ``import mlflow`` must find the real package, and
the helpers here are imported as plain modules (``from otel_points import gauge``).
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from testkit.hermetic import apply_hermetic
from testkit.proxy import MlflowProxy


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A spool, if one is written, lands in the test's own directory.
    apply_hermetic(monkeypatch, http_timeout_s=20, XDG_CACHE_HOME=str(tmp_path / "cache"))


@pytest.fixture
def experiment_id(client) -> str:
    return client.create_experiment(f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def proxy(mlflow_server):
    with MlflowProxy(mlflow_server.uri) as mlflow_proxy:
        yield mlflow_proxy
