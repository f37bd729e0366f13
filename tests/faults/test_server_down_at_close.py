"""The tracking server dies before a TrainingRun's last metrics and its end are delivered: they are
kept in a spool, and ``otel-forge replay`` delivers every value and then ends the run with its real
status (the run does not stay RUNNING)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from pathlib import Path

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.hermetic import hermetic_environ


def _kept(capfd) -> tuple[str, str]:  # type: ignore[no-untyped-def]
    """The one warning that names a kept journal, and its path: the delivery's line (the companion
    process writes it to our stderr)."""
    err = capfd.readouterr().err
    kept = [line for line in err.splitlines() if "otel-forge replay" in line]
    assert len(kept) == 1, err
    return kept[0], re.search(r"otel-forge replay (\S+)", kept[0]).group(1)  # type: ignore[union-attr]


def _replay(path: str, timeout_s: float = 180) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "replay", path],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=hermetic_environ(),
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert result.returncode == 0, (result.stdout, result.stderr)
    return result


def test_metrics_left_at_close_are_replayed_and_the_run_ended(server, tmp_path, caplog, capfd, monkeypatch) -> None:
    from mlflow import MlflowClient

    from otel_forge.cli import main

    caplog.set_level(logging.WARNING, logger="otel_forge")
    config = ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path / "spool"), drain_deadline_s=1.0)
    run = TrainingRun(
        {"lr": 0.1},
        tracking_uri=server.uri,
        experiment="down-at-close",
        system_metrics=False,
        forge_config=config,
        launch_argv=["train.py"],
    )
    with run:
        for step in range(30):
            run.log({"loss": float(step)}, step)
            time.sleep(0.02)
        time.sleep(1.0)  # the first 30 are delivered
        server.kill()
        for step in range(30, 200):
            run.log({"loss": float(step)}, step)
        run.log({"loss": 0.0}, step=-1)
    message, path = _kept(capfd)
    assert "metric value(s) and the run's end of run" in message
    monkeypatch.setenv("OTEL_FORGE_SPOOL_DIR", str(tmp_path / "spool"))
    assert main(["doctor", "--collectors", "cpu"]) == 0
    doctor = capfd.readouterr().out
    assert f"run {run.run_id} " in doctor and "run end FINISHED, not delivered yet" in doctor, doctor

    server.start()
    result = _replay(path)

    assert re.search(r"delivered \d+ metric value\(s\) to run \w+ and ended it FINISHED", result.stdout)
    client = MlflowClient(server.uri)
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "loss")) == list(range(200))
    assert client.get_run(run.run_id).info.status == "FINISHED"
    assert client.get_run(run.run_id).data.tags["otel_forge.log.rejected"] == "1"
    assert not (tmp_path / "spool").exists() or not any((tmp_path / "spool").iterdir())


def test_what_describes_the_run_is_kept_too_and_replayed(server, tmp_path, caplog, capfd) -> None:
    from mlflow import MlflowClient

    caplog.set_level(logging.WARNING, logger="otel_forge")
    launch = tmp_path / "train.toml"
    launch.write_text('[optim]\nlr = 0.1\npassword = "hunter2"\n')
    config = ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path / "spool"), drain_deadline_s=0.5)
    big = {f"layer_{i:04d}": i for i in range(3000)}  # 30 calls of params
    run = TrainingRun(
        big,
        tracking_uri=server.uri,
        experiment="describe-at-close",
        system_metrics=False,
        forge_config=config,
        launch_argv=["train.py", str(launch)],
    )
    assert run.start()
    server.kill()  # most of what describes the run is still queued
    run.log({"loss": 1.0}, 0)
    run.close()
    _, path = _kept(capfd)
    assert "hunter2" not in "".join(p.read_text() for p in (tmp_path / "spool").rglob("*.json"))

    server.start()
    _replay(path)

    client = MlflowClient(server.uri)
    data = client.get_run(run.run_id).data
    assert len(data.params) == 3000 and data.metrics == {"loss": 1.0}
    assert data.tags["otel_forge.described"] == "true"
    uploaded = Path(client.download_artifacts(run.run_id, "train.toml", str(tmp_path / "dl")))
    assert 'password = "***"' in uploaded.read_text()
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_a_job_that_ends_before_the_server_ever_answers_is_replayed_into_a_new_run(
    server, tmp_path, caplog, capfd
) -> None:
    from mlflow import MlflowClient

    caplog.set_level(logging.WARNING, logger="otel_forge")
    server.kill()  # down for the whole job
    config = ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path / "spool"), drain_deadline_s=1.0)
    with TrainingRun(
        {"lr": 0.1},
        tracking_uri=server.uri,
        experiment="never-answered",
        system_metrics=False,
        forge_config=config,
        launch_argv=["train.py"],
    ) as run:
        for step in range(50):
            run.log({"loss": float(step)}, step)
    assert run.run_id is None
    message, path = _kept(capfd)
    assert "50 metric value(s)" in message

    server.start()
    _replay(path)

    client = MlflowClient(server.uri)
    [opened] = client.search_runs([client.get_experiment_by_name("never-answered").experiment_id])
    assert sorted(m.step for m in client.get_metric_history(opened.info.run_id, "loss")) == list(range(50))
    assert opened.data.params == {"lr": "0.1"} and opened.info.status == "FINISHED"
