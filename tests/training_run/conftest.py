"""Fixtures for the TrainingRun tests: isolation of the env (testkit/hermetic.py), a fresh experiment
name per test (the client of the session server is tests/conftest.py's)."""

from __future__ import annotations

import pytest
from trun_helpers import unique

from testkit.hermetic import apply_hermetic


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch):
    """No launcher, run, MLflow or otel-forge variable changes what a TrainingRun does."""
    apply_hermetic(monkeypatch)


@pytest.fixture
def experiment():
    """A fresh experiment name per test, so runs can be counted."""
    return unique("trun")
