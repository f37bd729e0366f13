"""Resuming a run (``TrainingRun(run_id=...)``) against a real tracking server: nothing recorded
again, steps already logged are skipped, and a deleted run falls back to a fresh one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from trun_helpers import unique

from otel_forge.mlflow.training.training_run import TrainingRun


def _training_run(server, experiment, **kwargs) -> TrainingRun:
    kwargs.setdefault("launch_argv", ["train.py"])
    return TrainingRun(tracking_uri=server.uri, experiment=experiment, system_metrics=False, **kwargs)


def _snapshot(client, run_id: str, tmp_path: Path) -> tuple:
    run = client.get_run(run_id)
    config_json = Path(client.download_artifacts(run_id, "config.json", str(tmp_path / unique("dl")))).read_text()
    artifacts = sorted((f.path, f.file_size) for f in client.list_artifacts(run_id))
    return dict(run.data.params), dict(run.data.tags), artifacts, json.loads(config_json)


def test_resume_writes_nothing_again(mlflow_server, client, experiment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "first.toml").write_text("lr = 0.1\n")
    (tmp_path / "second.toml").write_text("lr = 0.9\n")
    with _training_run(
        mlflow_server,
        experiment,
        config={"lr": 0.1, "model": {"dim": 8}},
        run_name="resumable",
        description="first",
        tags={"phase": "one"},
        launch_argv=["train.py", "first.toml"],
    ) as first:
        first.log({"loss": 1.0}, step=0)
    before = _snapshot(client, first.run_id, tmp_path)
    assert before[0] == {"lr": "0.1", "model.dim": "8"}
    assert client.get_run(first.run_id).info.status == "FINISHED"

    resumed = _training_run(
        mlflow_server,
        experiment,
        run_id=first.run_id,
        config={"lr": 0.9, "model": {"dim": 16}, "new_key": 1},
        run_name="other-name",
        description="second",
        tags={"phase": "two", "extra": "x"},
        launch_argv=["train.py", "second.toml"],
    )
    try:
        assert resumed.start()
        assert resumed.run_id == first.run_id
        assert client.get_run(first.run_id).info.status == "RUNNING"
        resumed.log({"loss": 0.5}, step=1)
    finally:
        resumed.close()

    after_run = client.get_run(first.run_id)
    assert after_run.info.status == "FINISHED"
    assert after_run.info.run_name == "resumable"
    assert _snapshot(client, first.run_id, tmp_path) == before
    assert [(m.step, m.value) for m in client.get_metric_history(first.run_id, "loss")] == [(0, 1.0), (1, 0.5)]
    assert len(client.search_runs([after_run.info.experiment_id])) == 1


def test_resume_creates_no_experiment(mlflow_server, client, experiment):
    experiment_id = client.create_experiment(experiment)
    existing = client.create_run(experiment_id).info.run_id
    elsewhere = unique("never-created")
    with _training_run(mlflow_server, elsewhere, run_id=existing) as resumed:
        resumed.log({"loss": 1.0}, step=0)
    assert resumed.run_id == existing
    assert [m.value for m in client.get_metric_history(existing, "loss")] == [1.0]
    assert client.get_experiment_by_name(elsewhere) is None


def test_resume_skips_steps_already_logged(mlflow_server, client, experiment):
    with _training_run(mlflow_server, experiment) as first:
        for step in range(10):
            first.log({"train/loss": float(step), "lr": 0.1}, step=step)
    with _training_run(mlflow_server, experiment, run_id=first.run_id) as resumed:
        for step in range(5, 15):
            resumed.log({"train/loss": 100.0 + step, "lr": 0.2}, step=step)
    history = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "train/loss"))
    assert history == [(s, float(s)) for s in range(10)] + [(s, 100.0 + s) for s in range(10, 15)]
    lr = sorted((m.step, m.value) for m in client.get_metric_history(first.run_id, "lr"))
    assert lr == [(s, 0.1) for s in range(10)] + [(s, 0.2) for s in range(10, 15)]


def test_a_run_id_that_never_existed_is_an_error_not_a_new_run(mlflow_server, client, experiment, caplog):
    caplog.set_level(logging.WARNING, logger="otel_forge")
    experiment_id = client.create_experiment(experiment)
    mistyped = "0123456789abcdef0123456789abcdef"
    with _training_run(mlflow_server, experiment, run_id=mistyped, config={"lr": 0.1}) as run:
        assert not run.start()
        run.log({"loss": 2.0}, step=0)
    assert run.run_id is None and client.search_runs([experiment_id]) == []
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and mistyped in r.getMessage()]
    assert len(warned) == 1 and "does not exist" in warned[0], caplog.text


@pytest.mark.parametrize("how", ["deleted", "never-existed"])
def test_a_gone_run_falls_back_to_a_new_run(how, mlflow_server, client, experiment, caplog):
    caplog.set_level(logging.WARNING, logger="otel_forge")
    experiment_id = client.create_experiment(experiment)
    if how == "deleted":
        gone = client.create_run(experiment_id).info.run_id
        client.log_metric(gone, "loss", 1.0, step=0)
        client.delete_run(gone)
    else:
        gone = "0123456789abcdef0123456789abcdef"
    # A deleted run is replaced; an id that never existed only when asked to (else it is a typo).
    with _training_run(
        mlflow_server, experiment, run_id=gone, config={"lr": 0.1}, create_if_missing=how == "never-existed"
    ) as run:
        run.log({"loss": 2.0}, step=0)
    assert run.run_id is not None and run.run_id != gone
    fresh = client.get_run(run.run_id)
    assert fresh.info.status == "FINISHED"
    assert fresh.data.params == {"lr": "0.1"}  # a new run records its metadata
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "loss")] == [(0, 2.0)]
    assert [r.info.run_id for r in client.search_runs([experiment_id])] == [run.run_id]
    gone_warnings = [r for r in caplog.records if r.levelno == logging.WARNING and gone in r.getMessage()]
    assert len(gone_warnings) == 1 and "starting a new run" in gone_warnings[0].getMessage(), caplog.text
    if how == "deleted":
        assert client.get_run(gone).info.lifecycle_stage == "deleted"
        assert [m.value for m in client.get_metric_history(gone, "loss")] == [1.0]
