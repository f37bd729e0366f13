"""A tracking server that hangs (SIGSTOP) when the job starts does not switch MLflow off: the run
opens when the server answers again, and what was logged meanwhile lands in it -- training values,
params, and the system windows sampled from the moment the run was entered. Never a switch to
another store (no ./mlflow.db appears). In-process TrainingRun and ``otel-forge run`` as a process."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

from faultkit import HTTP_TIMEOUT_S
from run_reading import anchor_history

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.hermetic import hermetic_environ

HANG_S = 8.0  # otel-forge run's case: past its 2 s start wait (CMD starts at once, its TrainingRun waits)
STEPS = 300  # one every 0.1 s
JOB_START_HANG_S = 20.0  # TrainingRun's case: past several HTTP timeouts and retries of the open
TRAIN = """
import sys, time
from otel_forge import TrainingRun
with TrainingRun(config={"lr": 0.1}) as run:
    for step in range(100):
        run.log({"loss": 1.0 / (step + 1)}, step)
        time.sleep(0.08)
"""


def _hang_then_answer(server, hang_s: float = HANG_S) -> threading.Thread:  # type: ignore[no-untyped-def]
    server.pause()
    thread = threading.Thread(target=lambda: (time.sleep(hang_s), server.resume()), daemon=True)
    thread.start()
    return thread


def test_trainingrun_opens_when_the_server_answers_and_loses_nothing(
    pausable_server, tmp_path, monkeypatch, caplog
) -> None:
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    config = ForgeConfig.resolve(
        environ={},
        sampling_interval_s=0.3,
        prometheus=False,
        collectors="cpu,memory",
        spool_dir=str(tmp_path / "spool"),
    )
    resumed = _hang_then_answer(pausable_server, JOB_START_HANG_S)
    with TrainingRun(
        {"lr": 0.1},
        tracking_uri=pausable_server.uri,
        experiment="late-server",
        forge_config=config,
        launch_argv=["train.py"],
    ) as run:
        for step in range(STEPS):  # 30 s: the server answers again after 20
            run.log({"loss": float(step)}, step)
            time.sleep(0.1)
    resumed.join()

    assert run.run_id is not None, caplog.text
    assert "logging disabled" not in caplog.text
    client = MlflowClient(pausable_server.uri)
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "loss")) == list(range(STEPS))
    assert client.get_run(run.run_id).data.params == {"lr": "0.1"}
    assert client.get_run(run.run_id).info.status == "FINISHED"
    windows = anchor_history(client, run.run_id)
    assert [m.step for m in windows] == list(range(len(windows)))
    # Sampled from the moment the run was entered: windows from the hang, before the run existed.
    assert windows[0].timestamp < client.get_run(run.run_id).info.start_time - 15_000, windows[0]
    assert not (tmp_path / "mlflow.db").exists()


def test_otel_forge_run_starts_a_python_cmd_as_the_run_opens_and_both_meet_in_one_run(
    pausable_server, tmp_path
) -> None:
    from mlflow import MlflowClient

    env = hermetic_environ(
        {
            "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"),
            "OTEL_FORGE_START_WAIT": "2",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(HTTP_TIMEOUT_S),
        },
        prefixes=("OTEL_", "MLFLOW_"),
    )
    experiment = f"late-{time.time_ns()}"
    resumed = _hang_then_answer(pausable_server)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "otel_forge.cli",
            "run",
            "--tracking-uri",
            pausable_server.uri,
            "--experiment",
            experiment,
            "--no-prometheus",
            "--interval",
            "0.3",
            "--",
            sys.executable,
            "-c",
            TRAIN,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    resumed.join()

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "logging disabled" not in result.stderr, result.stderr
    assert "already writes" not in result.stderr, result.stderr  # the node sampled once, by otel-forge
    # CMD started at once; the outage is said once, by otel-forge run, after its start wait.
    assert result.stderr.count("does not answer") == 1, result.stderr
    assert "does not answer: no answer " in result.stderr, result.stderr  # not "TimeoutError"
    client = MlflowClient(pausable_server.uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.data.tags for r in runs]
    run_id = runs[0].info.run_id
    assert re.search(rf"otel-forge: run {run_id} ", result.stderr), result.stderr  # its own lines: on stderr
    assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(100))
    assert len(anchor_history(client, run_id)) >= 2
    assert client.get_run(run_id).info.status == "FINISHED"
    assert not (tmp_path / "mlflow.db").exists()
