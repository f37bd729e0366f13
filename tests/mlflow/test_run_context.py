"""``LaunchedRunContext``, through MLflow's own registry (the ``mlflow.run_context_provider`` entry
point): ``mlflow.parentRunId`` = the launched run for a run started with no run active, nothing while
the launched run is still opening, outside ``otel-forge run``, or for what MLflow tags inside a run.
"""

from __future__ import annotations

import logging

import pytest

LAUNCHED_RUN_ENV = "OTEL_FORGE_LAUNCHED_RUN_ID"
LAUNCHED = "0123456789abcdef0123456789abcdef"


def _context_tags() -> dict[str, str]:
    from mlflow.tracking.context.registry import resolve_tags

    return resolve_tags()


def test_the_provider_is_registered_through_mlflows_entry_point() -> None:
    from mlflow.tracking.context.registry import _run_context_provider_registry

    from otel_forge.mlflow.training.run_context import LaunchedRunContext

    assert any(isinstance(provider, LaunchedRunContext) for provider in _run_context_provider_registry)


def test_under_otel_forge_run_a_new_run_gets_the_launched_run_as_parent(monkeypatch) -> None:
    monkeypatch.setenv(LAUNCHED_RUN_ENV, LAUNCHED)

    tags = _context_tags()

    assert tags["mlflow.parentRunId"] == LAUNCHED
    assert tags["mlflow.source.type"] == "LOCAL"  # MLflow's own providers still answer


def test_outside_otel_forge_run_no_parent() -> None:
    assert "mlflow.parentRunId" not in _context_tags()


def test_while_the_launched_run_is_still_opening_no_parent_said_once_at_debug(monkeypatch, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="otel_forge")
    monkeypatch.setenv(LAUNCHED_RUN_ENV, "pending")

    from otel_forge.mlflow.training.run_context import LaunchedRunContext

    assert "mlflow.parentRunId" not in _context_tags()
    caplog.clear()
    provider = LaunchedRunContext()  # a fresh one: the registry's may have said it in an earlier test
    asked = [provider.in_context(), provider.in_context()]

    assert asked == [False, False]
    said = [r for r in caplog.records if r.name == "otel_forge.mlflow.training.run_context"]
    assert [r.levelno for r in said] == [logging.DEBUG], said


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_runs_started_inside_a_run_keep_mlflows_parent(mlflow_server, client, experiment_id, monkeypatch) -> None:
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    outer = client.create_run(experiment_id).info.run_id  # stands for the launched run
    monkeypatch.setenv(LAUNCHED_RUN_ENV, outer)

    with mlflow.start_run(experiment_id=experiment_id) as fit:
        inside = _context_tags()  # what MLflow resolves for a logged model or dataset of this run
        with mlflow.start_run(nested=True) as nested:
            pass

    assert client.get_run(fit.info.run_id).data.tags["mlflow.parentRunId"] == outer
    assert client.get_run(nested.info.run_id).data.tags["mlflow.parentRunId"] == fit.info.run_id
    assert "mlflow.parentRunId" not in inside
