"""No credential from the tracking URI reaches a log line, a tag, a param or ``tracking_entry()``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.proxy import LOG_BATCH, MlflowProxy
from testkit.servers import wait_for

SECRET = "s3cret"


def _with_userinfo(uri: str) -> str:
    return uri.replace("http://", f"http://alice:{SECRET}@")


def _leaks(records: list[logging.LogRecord]) -> list[str]:
    lines = [record.getMessage() for record in records]
    lines += [f"{record.exc_text or ''}{record.stack_info or ''}" for record in records]
    return [line for line in lines if SECRET in line]


def _open_log_close(uri: str, experiment: str, tmp_path: Path) -> tuple[TrainingRun, dict | None]:
    run = TrainingRun(
        {"lr": 0.1, "data": {"url": f"https://bob:{SECRET}@data.example.com/x"}},
        tracking_uri=uri,
        experiment=experiment,
        run_name="cred-run",
        system_metrics=False,
        register_checkpoints=True,
        launch_argv=["train.py"],
    )
    try:
        assert run.start()  # the server ignores basic auth: the run opens
        run.log({"loss": 1.0}, step=0)
        run.register_checkpoint(1, tmp_path)
        wait_for(lambda: "model_id" in (run.checkpoint_fields(1) or {}), 30, 0.05)
        entry = run.tracking_entry()
    finally:
        run.close()
    return run, entry


def test_credentials_in_the_uri_reach_no_log_tag_param_or_entry(
    mlflow_server, client, experiment, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.DEBUG)  # every logger, every level
    caplog.set_level(logging.DEBUG, logger="urllib3")  # even if an earlier in-process CLI test quieted it
    monkeypatch.chdir(tmp_path)
    run, entry = _open_log_close(_with_userinfo(mlflow_server.uri), experiment, tmp_path)
    assert entry == {
        "backend": "mlflow",
        "run_id": run.run_id,
        "experiment": experiment,
        "tracking_uri": mlflow_server.uri,
    }
    assert SECRET not in json.dumps(entry)
    data = client.get_run(run.run_id)
    assert data.info.status == "FINISHED"
    assert data.data.params["data.url"] == "https://***@data.example.com/x"
    assert not [(k, v) for k, v in {**data.data.params, **data.data.tags}.items() if SECRET in k or SECRET in v]
    assert len(caplog.records) > 5  # the capture worked (urllib3 logs every request at DEBUG)
    assert _leaks(caplog.records) == []


def test_credentials_do_not_reach_stdout(mlflow_server, experiment, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", raising=False)
    _open_log_close(_with_userinfo(mlflow_server.uri), experiment, tmp_path)
    captured = capfd.readouterr()
    assert SECRET not in captured.out + captured.err


def test_a_delivery_failure_does_not_log_the_credentials(
    mlflow_server, experiment, tmp_path, monkeypatch, caplog, capfd
):
    caplog.set_level(logging.DEBUG)
    said: list[str] = []  # the delivery's lines: its companion process writes them to our stderr

    def heard(text: str) -> bool:
        said.append(capfd.readouterr().err)
        return text in "".join(said)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with MlflowProxy(mlflow_server.uri) as proxy:
        run = TrainingRun(
            tracking_uri=_with_userinfo(proxy.uri),
            experiment=experiment,
            system_metrics=False,
            launch_argv=["train.py"],
            forge_config=ForgeConfig.resolve(drain_deadline_s=1),
        )
        try:
            assert run.start()
            proxy.fail_paths.add(LOG_BATCH)  # the server answers 500: delivery is retried, a warning said
            run.log({"loss": 1.0}, step=0)
            wait_for(lambda: heard("retrying"), 15, 0.05)
        finally:
            run.close()
    assert _leaks(caplog.records) == []
    heard("")
    assert "retrying" in "".join(said) and SECRET not in "".join(said)
