"""Faults of a real (private) tracking server: SIGSTOP (hung) and SIGKILL (down).

A transient error while resuming disables logging instead of forking the run's history; a hung
server during the training loop never slows ``log()``, and everything logged arrives after SIGCONT.
"""

from __future__ import annotations

import logging
import time

import pytest
from socket_io import SocketIO
from trun_helpers import unique

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.hermetic import fail_fast_http
from testkit.servers import wait_for


@pytest.fixture
def short_http(monkeypatch):
    """MLflow's HTTP client gives up fast: no retries, a 2 s timeout (a hung call ends, on its thread)."""
    fail_fast_http(monkeypatch, 2)


def _client(server):
    from mlflow import MlflowClient

    return MlflowClient(server.uri)


def _logs(run: TrainingRun, steps: range, socket_io: SocketIO, pause_s: float = 0.0) -> None:
    """``run.log`` for each step, each call watched for socket I/O on this (the training) thread."""
    log = socket_io.watched(run.log)
    for step in steps:
        log({"loss": float(step), "lr": 1.0 / (step + 1)}, step=step)
        if pause_s:
            time.sleep(pause_s)


@pytest.mark.parametrize("fault, by", [("pause", "experiment id"), ("kill", "experiment name")])
def test_transient_error_on_resume_waits_for_the_run_instead_of_forking(
    fault, by, killable_server, short_http, socket_io, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.WARNING, logger="otel_forge")
    monkeypatch.chdir(tmp_path)
    client = _client(killable_server)
    experiment = unique("faults")
    experiment_id = client.create_experiment(experiment)
    existing = client.create_run(experiment_id, run_name="existing").info.run_id
    client.log_metric(existing, "loss", 1.0, step=0)
    client.set_terminated(existing)

    getattr(killable_server, fault)()
    try:
        run = TrainingRun(
            {"lr": 0.1},
            tracking_uri=killable_server.uri,
            run_id=existing,
            system_metrics=False,
            experiment=experiment_id if by == "experiment id" else experiment,
            launch_argv=["train.py"],
            init_deadline_s=15,
            end_deadline_s=5,
            forge_config=ForgeConfig.resolve(call_deadline_s=1, drain_deadline_s=2, spool_dir=str(tmp_path / "spool")),
        )
        assert run.start(timeout_s=3) is False  # not open yet: it goes on trying in the background
        _logs(run, range(1, 51), socket_io)
    finally:
        killable_server.resume() if fault == "pause" else killable_server.start()
    _logs(run, range(51, 61), socket_io)  # the server is back: the resume goes on
    wait_for(lambda: run.run_id is not None, 30, 0.1, "the run to resume once the server answers")
    run.close()
    # log() only queued: no call talked to the server on the training thread.
    assert (socket_io.watched_calls, socket_io.operations) == (60, 0)

    runs = client.search_runs([experiment_id])
    assert [r.info.run_id for r in runs] == [existing]  # no fork: the same run, resumed
    assert runs[0].info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(existing, "loss")) == list(range(61))
    assert "MLflow logging disabled" not in caplog.text


def test_hung_server_never_blocks_log_and_loses_nothing(pausable_server, short_http, tmp_path, monkeypatch, socket_io):
    monkeypatch.chdir(tmp_path)
    experiment = unique("hung")
    run = TrainingRun(
        {"lr": 0.1},
        tracking_uri=pausable_server.uri,
        experiment=experiment,
        system_metrics=False,
        launch_argv=["train.py"],
        end_deadline_s=30,
        forge_config=ForgeConfig.resolve(call_deadline_s=1, drain_deadline_s=60),
    )
    try:
        assert run.start()
        _logs(run, range(10), socket_io)
        pausable_server.pause()
        try:
            stopped_at = time.monotonic()
            _logs(run, range(10, 130), socket_io, pause_s=0.02)  # ~2.5 s of a hung server
            while time.monotonic() - stopped_at < 3.5:
                time.sleep(0.05)
        finally:
            pausable_server.resume()
        _logs(run, range(130, 140), socket_io)
    finally:
        run.close()
    assert (socket_io.watched_calls, socket_io.operations) == (140, 0)  # log() never waited on the server

    client = _client(pausable_server)
    data = client.get_run(run.run_id)
    assert data.info.status == "FINISHED"
    assert data.data.params == {"lr": "0.1"}
    loss = client.get_metric_history(run.run_id, "loss")
    assert sorted((m.step, m.value) for m in loss) == [(s, float(s)) for s in range(140)]  # none lost, none twice
    lr = client.get_metric_history(run.run_id, "lr")
    assert sorted(m.step for m in lr) == list(range(140))
