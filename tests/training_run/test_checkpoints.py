"""Checkpoints as external logged models on a real tracking server: found or created, one per
(run, step), also across a resume; ``checkpoint_fields`` answers from memory."""

from __future__ import annotations

from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.proxy import MlflowProxy
from testkit.servers import wait_for


def _models(client, experiment_id: str, name: str):
    return client.search_logged_models(experiment_ids=[experiment_id], filter_string=f"name = '{name}'")


def test_register_checkpoint_once_per_step(mlflow_server, client, experiment, tmp_path):
    checkpoint = tmp_path / "ckpt-100"
    checkpoint.mkdir()
    (checkpoint / "weights.bin").write_bytes(b"\0" * 16)
    with MlflowProxy(mlflow_server.uri) as proxy:
        run = TrainingRun(
            tracking_uri=proxy.uri,
            experiment=experiment,
            run_name="ckpt-run",
            system_metrics=False,
            register_checkpoints=True,
            launch_argv=["train.py"],
        )
        try:
            assert run.checkpoint_fields(100) is None  # not open yet: no fields, no I/O
            assert proxy.total() == 0
            assert run.start()
            requests = proxy.total()
            assert run.checkpoint_fields(100) == {"model_name": "ckpt-run-step-100"}
            assert proxy.total() == requests  # from memory
            run.register_checkpoint(100, checkpoint)
            run.register_checkpoint(100, checkpoint)  # again: still one model
            fields = wait_for(
                lambda: "model_id" in (run.checkpoint_fields(100) or {}) and run.checkpoint_fields(100), 30, 0.05
            )
            requests = proxy.total()
            assert run.checkpoint_fields(100) == fields
            assert proxy.total() == requests
            run.register_checkpoint(100, checkpoint)  # known: not even queued
            assert proxy.total() == requests
        finally:
            run.close()
    experiment_id = client.get_run(run.run_id).info.experiment_id
    models = _models(client, experiment_id, "ckpt-run-step-100")
    assert [m.model_id for m in models] == [fields["model_id"]]
    model = models[0]
    assert fields["model_name"] == model.name == "ckpt-run-step-100"
    assert model.source_run_id == run.run_id
    assert model.tags["mlflow.model.isExternal"] == "true"
    assert model.tags["otel_forge.checkpoint.step"] == "100"
    assert model.tags["otel_forge.checkpoint.path"] == str(checkpoint)
    assert str(model.status).endswith("READY")

    # A fresh process resuming the same run registers the same step: the model is found, not duplicated.
    with TrainingRun(
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        run_id=run.run_id,
        system_metrics=False,
        register_checkpoints=True,
        launch_argv=["train.py"],
    ) as resumed:
        assert resumed.start()
        resumed.register_checkpoint(100, checkpoint)
        resumed.register_checkpoint(200, checkpoint)
        again = wait_for(
            lambda: (
                "model_id" in (resumed.checkpoint_fields(100) or {})
                and "model_id" in (resumed.checkpoint_fields(200) or {})
                and resumed.checkpoint_fields(100)
            ),
            30,
            0.05,
        )
    assert again == fields
    assert [m.model_id for m in _models(client, experiment_id, "ckpt-run-step-100")] == [fields["model_id"]]
    (step_200,) = _models(client, experiment_id, "ckpt-run-step-200")
    # Each the run's output at its step, once: the run page lists them under "Logged models".
    outputs = client.get_run(run.run_id).outputs.model_outputs
    assert sorted((o.step, o.model_id) for o in outputs) == [(100, fields["model_id"]), (200, step_200.model_id)]


def test_checkpoints_off_by_default(mlflow_server, client, experiment, tmp_path):
    with TrainingRun(
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        run_name="no-ckpt",
        system_metrics=False,
        launch_argv=["train.py"],
    ) as run:
        assert run.start()
        run.register_checkpoint(1, tmp_path)
        assert run.checkpoint_fields(1) is None
    experiment_id = client.get_run(run.run_id).info.experiment_id
    assert client.search_logged_models(experiment_ids=[experiment_id]) == []
