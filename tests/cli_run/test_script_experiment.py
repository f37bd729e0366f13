"""The job's run is in the experiment the script names, where nothing outside the script names one
(no ``--experiment``, no ``MLFLOW_EXPERIMENT_*``): accelerate's ``init_trackers`` project,
``mlflow.set_experiment``, ``TrainingRun(experiment=...)``, in code as under ``otel-forge run``; a
script that names none gets ``otel-forge``; ``--experiment`` wins; a replay opens the run where the
job would have. No empty experiment is left behind.

Against the session's real ``mlflow server``; each script names an experiment of its own test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from testkit.hermetic import hermetic_environ
from testkit.servers import REPO_ROOT, free_port

FORGE_RUN = [sys.executable, "-m", "otel_forge.cli", "run", "--no-prometheus", "--interval", "0.3"]
SYSTEM = "system/cpu_utilization_percentage"

ACCELERATE = """
import time
from accelerate import Accelerator
accelerator = Accelerator(log_with="mlflow")
accelerator.init_trackers({project!r}, config={{"lr": 0.1}})
for step in range(4):
    accelerator.log({{"loss": 1.0 / (step + 1)}}, step=step)
    time.sleep(0.4)
accelerator.end_training()
"""

SET_EXPERIMENT = """
import time
import mlflow
mlflow.set_experiment({experiment!r})
with mlflow.start_run():
    for step in range(4):
        mlflow.log_metric("loss", float(step), step=step)
        time.sleep(0.4)
"""

TRAINING_RUN = """
from otel_forge import TrainingRun
with TrainingRun(experiment={experiment!r}, config={{"lr": 0.2}}) as run:
    for step in range(4):
        run.log({{"loss": float(step)}}, step=step)
"""

BARE_TRAINING_RUN_AROUND_ACCELERATE = """
from accelerate import Accelerator
from otel_forge import TrainingRun
with TrainingRun(config={{"lr": 0.3}}) as run:
    accelerator = Accelerator(log_with="mlflow")
    accelerator.init_trackers({project!r}, config={{"batch": 4}})
    for step in range(4):
        accelerator.log({{"loss": 1.0 / (step + 1)}}, step=step)
        run.log({{"mine": float(step)}}, step=step)
    accelerator.end_training()
"""

ASKS_FOR_THE_RUN = """
import otel_forge
print("asked", otel_forge.job_run_id(), flush=True)
"""

ASKS_IN_A_TRAINING_RUN = """
import otel_forge
with otel_forge.TrainingRun() as run:
    print("asked", otel_forge.job_run_id(), run.run_id, flush=True)
"""

NO_MLFLOW = """
import sys, time
time.sleep(3)
print("cmd done", flush=True)
print("cmd done", file=sys.stderr, flush=True)
"""


def _environ(tmp_path: Path, uri: str, **extra: str) -> dict[str, str]:
    own = {"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"), "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO_ROOT)}
    return hermetic_environ({**own, **extra}, prefixes=("OTEL_", "MLFLOW_"))


def _script(tmp_path: Path, text: str, **names: str) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text.format(**names)))
    return path


def _run(command: list[str], tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    return result


def _runs(client: Any, experiment: str) -> list[Any]:
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    return client.search_runs([found.experiment_id])


def _the_jobs_run(client: Any, experiment: str, source: str = "train.py") -> Any:
    (run,) = _runs(client, experiment)
    assert run.info.status == "FINISHED" and run.data.tags.get("mlflow.source.name") == source, run
    return run


def _unique(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:8]}"


def _forge_run(case: str, *options: str) -> list[str]:
    """``otel-forge run`` of ``train.py``, its run tagged with the test's ``case``."""
    return [*FORGE_RUN, "--tag", f"case={case}", *options, "--", sys.executable, "train.py"]


def _runs_of(client: Any, case: str, experiment: str = "otel-forge") -> list[Any]:
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id], f"tags.`case` = '{case}'") if found else []


@pytest.mark.parametrize(
    ("script", "names"),
    [(ACCELERATE, "project"), (SET_EXPERIMENT, "experiment"), (TRAINING_RUN, "experiment")],
    ids=["accelerate-init-trackers", "mlflow-set-experiment", "trainingrun-experiment"],
)
def test_the_job_run_is_in_the_experiment_the_script_names(mlflow_server, client, tmp_path, script, names):
    experiment = _unique("named")
    _script(tmp_path, script, **{names: experiment})
    result = _run(_forge_run(experiment), tmp_path, _environ(tmp_path, mlflow_server.uri))

    run = _the_jobs_run(client, experiment)
    # otel-forge run's own lines are on its stderr; its stdout is CMD's.
    assert f"in experiment {experiment} at" in result.stderr, result.stderr
    assert "otel-forge: run " not in result.stdout, result.stdout
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2, 3]
    assert SYSTEM in run.data.metrics  # the node, sampled by otel-forge run, is in the same run
    assert run.data.tags["case"] == experiment  # described by otel-forge run
    assert _runs_of(client, experiment) == []


def test_a_trainingrun_in_code_opens_in_the_project_accelerate_names(mlflow_server, client, tmp_path):
    project = _unique("proj")
    _script(tmp_path, BARE_TRAINING_RUN_AROUND_ACCELERATE, project=project)
    _run([sys.executable, "train.py"], tmp_path, _environ(tmp_path, mlflow_server.uri))

    run = _the_jobs_run(client, project)
    assert {"loss", "mine"} <= set(run.data.metrics) and {"lr", "batch"} <= set(run.data.params)
    assert SYSTEM in run.data.metrics


def test_a_script_that_names_no_experiment_gets_the_default_while_it_runs(mlflow_server, client, tmp_path):
    case = _unique("no-mlflow")
    _script(tmp_path, NO_MLFLOW)
    env = _environ(tmp_path, mlflow_server.uri, OTEL_FORGE_EXPERIMENT_WAIT="0.5")
    result = _run(_forge_run(case), tmp_path, env)

    # The run opened while CMD still ran (its hardware is there from its first seconds): its line, on
    # otel-forge's stderr, comes before CMD's last line on the same stderr (CMD inherits it).
    assert "in experiment otel-forge at" not in result.stdout and "cmd done" in result.stdout, result.stdout
    assert result.stderr.index("in experiment otel-forge at") < result.stderr.index("cmd done"), result.stderr
    (run,) = _runs_of(client, case)
    assert run.info.status == "FINISHED" and SYSTEM in run.data.metrics


def test_the_experiment_given_to_otel_forge_run_wins(mlflow_server, client, tmp_path):
    given, project = _unique("given"), _unique("proj")
    _script(tmp_path, ACCELERATE, project=project)
    _run(_forge_run(given, "--experiment", given), tmp_path, _environ(tmp_path, mlflow_server.uri))

    run = _the_jobs_run(client, given)
    assert "loss" in run.data.metrics and SYSTEM in run.data.metrics
    assert client.get_experiment_by_name(project) is None  # accelerate takes MLFLOW_EXPERIMENT_NAME: none made


def test_a_replay_opens_the_run_in_the_experiment_the_script_named(mlflow_server, client, tmp_path):
    experiment, dead = _unique("replayed"), f"http://127.0.0.1:{free_port()}"
    _script(tmp_path, TRAINING_RUN, experiment=experiment)
    env = _environ(tmp_path, dead, OTEL_FORGE_START_WAIT="1", OTEL_FORGE_DRAIN_DEADLINE="1")
    job = subprocess.run(
        _forge_run(experiment), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert job.returncode == 0 and "otel-forge replay" in job.stderr, job.stderr[-3000:]
    assert "WARNING" not in job.stderr, job.stderr  # said once at the start, once at the end
    (job_dir,) = (tmp_path / "spool").glob("run-*")

    replayed = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "replay", str(job_dir), "--tracking-uri", mlflow_server.uri],
        env=env, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr[-3000:]
    run = _the_jobs_run(client, experiment)
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2, 3]
    assert run.data.params["lr"] == "0.2" and run.data.tags["case"] == experiment
    assert _runs_of(client, experiment) == []


@pytest.mark.parametrize("forge", [True, False], ids=["otel-forge-run", "in-code"])
def test_asking_for_the_job_run_opens_it_in_the_default_experiment(mlflow_server, client, tmp_path, forge):
    """Lightning's ``MLFlowLogger(run_id=otel_forge.job_run_id())`` needs the run before any is open."""
    case = _unique("asked")
    _script(tmp_path, ASKS_FOR_THE_RUN if forge else ASKS_IN_A_TRAINING_RUN)
    command = _forge_run(case) if forge else [sys.executable, "train.py"]
    result = _run(command, tmp_path, _environ(tmp_path, mlflow_server.uri))

    (asked,) = [line.split()[1:] for line in result.stdout.splitlines() if line.startswith("asked")]
    run = client.get_run(asked[0])
    assert client.get_experiment(run.info.experiment_id).name == "otel-forge"
    assert asked == [run.info.run_id] * len(asked)  # the TrainingRun's own run, in code
    if forge:
        assert f"otel-forge: run {run.info.run_id} in experiment otel-forge" in result.stderr, result.stderr
        assert "otel-forge: run " not in result.stdout, result.stdout
        assert run.data.tags["case"] == case
