"""One run per job, the one the code logs to, with the real frameworks users train with: HF
``Trainer(report_to=["mlflow"])``, Lightning's ``MLFlowLogger``, scikit-learn autolog and a plain
``mlflow.log_metric`` loop (tiny models built from configs, random data, CPU), each under
``otel-forge run`` and in code (``TrainingRun`` / ``monitor()``), against the session's real
``mlflow server``. What a user opens in MLflow: one top-level run holding the training metrics
beside ``system/...``, later fits nested in it, the job's final status.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from framework_jobs import (
    FORGE_RUN,
    HF_STEPS,
    SCRIPTS,
    TIMEOUT_S,
    Job,
    job_environ,
    python,
    run_job,
    runs_of,
    steps,
    the_one_run,
)
from run_reading import anchor_steps

SKLEARN_FITS = Path(__file__).resolve().parents[1] / "cli_run" / "scripts" / "sklearn_fits.py"

pytest.importorskip("transformers")
pytest.importorskip("lightning")

# --- HF Trainer --------------------------------------------------------------------------------


# MLflow's own sampler asked for, by its variables, as a user who had it on would: the tests of the
# sampler's stand-down read the same launches as the tests of the run (an HF job is ~15 s of a core).
MLFLOWS_SAMPLER_ON = {"MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "true", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}
HF_STEP_SLEEP = ("--step-sleep", "0.5")  # MLflow's sampler, every second, meets several steps


@pytest.fixture(scope="module")
def hf_under_forge(mlflow_server, tmp_path_factory) -> Job:
    """HF's ``Trainer`` under ``otel-forge run``."""
    command = python(SCRIPTS / "hf_trainer.py", "plain", *HF_STEP_SLEEP)
    return run_job(tmp_path_factory.mktemp("hf"), mlflow_server.uri, command, True, **MLFLOWS_SAMPLER_ON)


@pytest.fixture(scope="module")
def hf_in_trainingrun(mlflow_server, tmp_path_factory) -> Job:
    """HF's ``Trainer`` inside ``with TrainingRun()``, no ``otel-forge run``."""
    command = python(SCRIPTS / "hf_trainer.py", "trainingrun", *HF_STEP_SLEEP)
    return run_job(tmp_path_factory.mktemp("hf"), mlflow_server.uri, command, False, **MLFLOWS_SAMPLER_ON)


def test_hf_trainer_under_otel_forge_run_logs_its_loss_beside_the_system_metrics(hf_under_forge, client) -> None:
    assert hf_under_forge.result.returncode == 0, hf_under_forge.result.stderr
    run = the_one_run(client, hf_under_forge)
    assert run.info.run_id == hf_under_forge.run_id
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id, "loss") == list(range(1, HF_STEPS + 1))
    assert "train_loss" in run.data.metrics
    assert run.info.run_name == "hf_trainer"  # what ran, not a random pair of words
    assert len(runs_of(client, hf_under_forge)) == 1


@pytest.mark.parametrize(
    ("args", "code", "status"),
    [(["plain", "--exit", "3"], 3, "FAILED"), (["raise"], 1, "FAILED")],
    ids=["exit-3", "exception"],
)
def test_hf_trainer_job_that_fails_after_training_ends_its_one_run_failed(
    mlflow_server, client, tmp_path, args, code, status
) -> None:
    # HF's callback ends the run FINISHED at the end of train(); the job's end decides after it.
    job = run_job(tmp_path, mlflow_server.uri, python(SCRIPTS / "hf_trainer.py", *args), True)
    assert job.result.returncode == code, job.result.stderr
    run = the_one_run(client, job)
    assert run.info.status == status
    assert steps(client, run.info.run_id, "loss") == list(range(1, HF_STEPS + 1))


def test_hf_trainer_stopped_by_sigterm_ends_its_one_run_killed(mlflow_server, client, tmp_path) -> None:
    experiment = f"frameworks-{uuid.uuid4().hex[:8]}"
    command = [*FORGE_RUN, "--", *python(SCRIPTS / "hf_trainer.py", "plain", "--step-sleep", "1")]
    with open(tmp_path / "out.txt", "w") as out:
        process = subprocess.Popen(
            command,
            cwd=tmp_path,
            env=job_environ(tmp_path, mlflow_server.uri, experiment),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + TIMEOUT_S
        while "step 3" not in (tmp_path / "out.txt").read_text():
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    job = Job(
        subprocess.CompletedProcess(command, process.returncode, (tmp_path / "out.txt").read_text(), ""), experiment
    )
    run = the_one_run(client, job)
    assert run.info.status == "KILLED"
    assert steps(client, run.info.run_id, "loss")[:2] == [1, 2]


def test_hf_resume_with_mlflow_run_id_continues_the_loss_and_the_system_steps_in_one_run(
    hf_under_forge, mlflow_server, client, tmp_path
) -> None:
    first = hf_under_forge.run_id
    windows_before = anchor_steps(client, first)
    resumed = run_job(
        tmp_path, mlflow_server.uri, python(SCRIPTS / "hf_trainer.py", "plain"), True, MLFLOW_RUN_ID=first
    )
    assert resumed.result.returncode == 0, resumed.result.stderr
    assert resumed.run_id == first
    history = steps(client, first, "loss")
    assert history == sorted(list(range(1, HF_STEPS + 1)) * 2)  # both attempts' curves, in one run
    windows = anchor_steps(client, first)
    assert windows == list(range(len(windows))) and len(windows) > len(windows_before), windows
    assert client.get_run(first).info.status == "FINISHED"
    experiment_id = client.get_run(first).info.experiment_id
    assert len(client.search_runs([experiment_id])) == 1


def test_hf_trainer_in_a_trainingrun_logs_into_it(hf_in_trainingrun, client) -> None:
    job = hf_in_trainingrun
    assert job.result.returncode == 0, job.result.stderr
    # The rank journals only (its companion opens the run); HF's MLflow import, in train(), waits for it.
    assert "mlflow imported as the block began: False" in job.result.stdout
    run = the_one_run(client, job)
    assert run.info.run_name == "hf-in-code"  # the name the script gave
    assert run.info.status == "FINISHED"
    assert run.data.params["model"] == "tiny-bert"  # TrainingRun's config, beside HF's own params
    assert steps(client, run.info.run_id, "loss") == list(range(1, HF_STEPS + 1))
    assert len(runs_of(client, job)) == 1


def test_hf_trainer_in_monitor_samples_into_the_run_hf_opens(mlflow_server, client, tmp_path) -> None:
    # monitor() is entered before HF opens its run (inside train()): no crash, the run gets the node.
    job = run_job(tmp_path, mlflow_server.uri, python(SCRIPTS / "hf_trainer.py", "monitor"), False)
    assert job.result.returncode == 0, job.result.stderr
    assert "ConfigError" not in job.result.stderr
    run = the_one_run(client, job)
    assert steps(client, run.info.run_id, "loss") == list(range(1, HF_STEPS + 1))
    assert "system/cpu_utilization_percentage" in run.data.metrics


# --- one sampler per node --------------------------------------------------------------------------


def _points_per_step(client: Any, run_id: str, key: str) -> collections.Counter:
    return collections.Counter(m.step for m in client.get_metric_history(run_id, key))


@pytest.mark.parametrize("launch", ["otel-forge-run", "trainingrun"])
def test_mlflows_own_sampler_stands_down_and_says_so(hf_under_forge, hf_in_trainingrun, client, launch) -> None:
    # Both launched with MLflow's sampler on (MLFLOWS_SAMPLER_ON); the module's tests share them.
    job = {"otel-forge-run": hf_under_forge, "trainingrun": hf_in_trainingrun}[launch]
    assert job.result.returncode == 0, job.result.stderr
    said = [line for line in job.result.stderr.splitlines() if "MLflow's own system-metrics logging" in line]
    assert len(said) == 1, job.result.stderr
    run = the_one_run(client, job)
    doubled = _points_per_step(client, run.info.run_id, "system/cpu_utilization_percentage")
    assert [step for step, n in doubled.items() if n > 1] == [], doubled


@pytest.mark.parametrize("forge", [True, False], ids=["otel-forge-run", "trainingrun"])
def test_mlflows_monitor_asked_for_in_code_stands_down_and_says_so(mlflow_server, client, tmp_path, forge) -> None:
    args = ["--steps", "20", "--sleep", "0.2", "--log-system-metrics", *([] if forge else ["--in-code"])]
    job = run_job(tmp_path, mlflow_server.uri, python(SCRIPTS / "plain_mlflow.py", *args), forge)
    assert job.result.returncode == 0, job.result.stderr
    said = [line for line in job.result.stderr.splitlines() if "MLflow's own system-metrics monitor of run" in line]
    assert len(said) == 1, job.result.stderr
    run = the_one_run(client, job)
    doubled = _points_per_step(client, run.info.run_id, "system/cpu_utilization_percentage")
    assert [step for step, n in doubled.items() if n > 1] == [], doubled
    assert steps(client, run.info.run_id, "loss") == list(range(20))


# --- Lightning -----------------------------------------------------------------------------------


@pytest.mark.parametrize("forge", [True, False], ids=["otel-forge-run", "trainingrun"])
def test_lightning_with_the_job_run_line_logs_into_the_one_run(mlflow_server, client, tmp_path, forge) -> None:
    script = python(SCRIPTS / "lightning_fit.py", "job-run")
    command = script if forge else [sys.executable, "-c", _IN_TRAININGRUN.format(script=script[1:])]
    job = run_job(tmp_path, mlflow_server.uri, command, forge)
    assert job.result.returncode == 0, job.result.stderr
    if not forge:  # MLFlowLogger(run_id=otel_forge.job_run_id()) waits for the run the companion opens
        assert "mlflow imported as the block began: False" in job.result.stdout
    run = the_one_run(client, job)
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 5
    assert client.get_experiment_by_name("lightning_logs") is None or not client.search_runs(
        [client.get_experiment_by_name("lightning_logs").experiment_id],
        f"tags.mlflow.parentRunId = '{run.info.run_id}'",
    )


_IN_TRAININGRUN = """
import runpy, sys
import otel_forge
sys.argv = {script!r}
with otel_forge.TrainingRun():
    print(f"mlflow imported as the block began: {{'mlflow' in sys.modules}}", flush=True)
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_lightning_default_logger_lands_elsewhere_and_the_job_says_so_as_it_opens(
    mlflow_server, client, tmp_path
) -> None:
    job = run_job(tmp_path, mlflow_server.uri, python(SCRIPTS / "lightning_fit.py", "default"), True)
    assert job.result.returncode == 0, job.result.stderr
    lines = job.result.stderr.splitlines()
    warned = [i for i, line in enumerate(lines) if "lightning_logs" in line and "job_run_id" in line]
    assert len(warned) == 1, job.result.stderr  # once: not again at the job's end
    assert warned[0] < lines.index("fit ended"), job.result.stderr  # as its run opens, before training
    elsewhere = client.search_runs(
        [client.get_experiment_by_name("lightning_logs").experiment_id],
        f"tags.mlflow.parentRunId = '{job.run_id}'",
    )
    assert len(elsewhere) == 1


def test_lightning_default_logger_is_the_job_run_where_no_experiment_is_named(mlflow_server, client, tmp_path) -> None:
    """Nothing names the experiment but the script: Lightning's logger names its own (``lightning_logs``),
    so its run is the job's, holding the node's charts beside the loss, with no line to add."""
    env = job_environ(tmp_path, mlflow_server.uri, "unused")
    del env["MLFLOW_EXPERIMENT_NAME"]
    result = subprocess.run(
        [*FORGE_RUN, "--", *python(SCRIPTS / "lightning_fit.py", "default")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0 and "WARNING" not in result.stderr, result.stderr
    run = client.get_run(Job(result, "lightning_logs").run_id)
    assert client.get_experiment(run.info.experiment_id).name == "lightning_logs"
    assert run.info.status == "FINISHED" and "system/cpu_utilization_percentage" in run.data.metrics
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 5


# --- scikit-learn autolog and a plain mlflow.log_metric loop, in code ----------------------------


def test_sklearn_autolog_in_a_trainingrun_first_fit_is_its_run_the_others_nested(
    mlflow_server, client, tmp_path
) -> None:
    job = run_job(tmp_path, mlflow_server.uri, [sys.executable, str(SKLEARN_FITS), "trainingrun"], False)
    assert job.result.returncode == 0, job.result.stderr
    run = the_one_run(client, job)
    assert run.info.run_name == "ridge-in-code"
    assert run.data.params["alpha"] == "0.1"
    nested = [r for r in runs_of(client, job) if r.data.tags.get("mlflow.parentRunId") == run.info.run_id]
    assert sorted(r.data.params["alpha"] for r in nested) == ["1.0", "10.0"]


@pytest.mark.parametrize(
    ("args", "code", "status"),
    [
        ([], 0, "FINISHED"),
        (["--raise"], 1, "FAILED"),
        (["--sys-exit", "0"], 0, "FINISHED"),
        (["--sys-exit", "3"], 3, "FAILED"),
    ],
    ids=["success", "exception", "sys-exit-0", "sys-exit-3"],
)
def test_plain_mlflow_loop_in_a_trainingrun_is_its_one_run_with_the_jobs_status(
    mlflow_server, client, tmp_path, args, code, status
) -> None:
    # MLflow's exit handler would end the run FINISHED after an exception: the job's status stays.
    job = run_job(tmp_path, mlflow_server.uri, python(SCRIPTS / "plain_mlflow.py", "--in-code", *args), False)
    assert job.result.returncode == code, job.result.stderr
    run = the_one_run(client, job)
    assert run.info.status == status
    assert run.info.run_name == "plain-in-code"
    assert steps(client, run.info.run_id, "loss") == list(range(5))
    assert len(runs_of(client, job)) == 1


def test_plain_mlflow_loop_stopped_by_sigterm_under_otel_forge_run_is_killed(mlflow_server, client, tmp_path) -> None:
    experiment = f"frameworks-{uuid.uuid4().hex[:8]}"
    command = [*FORGE_RUN, "--", *python(SCRIPTS / "plain_mlflow.py", "--steps", "100", "--sleep", "0.2")]
    process = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=job_environ(tmp_path, mlflow_server.uri, experiment),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith("step 3"):
            break
    os.kill(process.pid, signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    run = the_one_run(client, Job(subprocess.CompletedProcess(command, process.returncode, stdout, stderr), experiment))
    assert run.info.status == "KILLED"
    assert steps(client, run.info.run_id, "loss")[:4] == [0, 1, 2, 3]
