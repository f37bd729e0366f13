"""What ``otel-forge run`` hands its command, and what a ``TrainingRun`` makes its process's run:
one record written and read in one module (``LaunchedRun``), and the run name that says what ran."""

from __future__ import annotations

from otel_forge.mlflow.training.launched_run import LaunchedRun, launched_run_id, make_process_run
from otel_forge.mlflow.training.run_description import script_stem, source_name
from otel_forge.mlflow.training.run_source import RunOrigin, RunSource


def test_an_open_run_is_handed_as_mlflow_run_id_with_its_experiment_and_read_back_whole() -> None:
    handed = LaunchedRun(
        RunSource(RunOrigin.LAUNCHER, "r1", adds_description=True),
        tracking_uri="http://127.0.0.1:5000",
        experiment_id="7",
        experiment="llm",
        sampled_node="host/node_0",
    )
    env = handed.environ()
    # MLflow resumes MLFLOW_RUN_ID at the command's first start_run; HF sets the experiment first.
    assert env["MLFLOW_RUN_ID"] == "r1" and env["MLFLOW_EXPERIMENT_NAME"] == "llm"
    assert env["MLFLOW_EXPERIMENT_ID"] == "7"
    read = LaunchedRun.from_environ(env)
    assert read is not None and read.source == handed.source
    assert (read.run_id, read.tracking_uri, read.experiment_id, read.sampled_node, read.described) == (
        "r1",
        "http://127.0.0.1:5000",
        "7",
        "host/node_0",
        True,
    )
    # MLflow consumes MLFLOW_RUN_ID at that first start_run: the job's run is still known.
    del env["MLFLOW_RUN_ID"]
    assert launched_run_id(env) == "r1"


def test_a_pending_run_is_found_by_job_key_and_has_no_run_id() -> None:
    env = LaunchedRun(
        RunSource(RunOrigin.LAUNCHER), experiment="llm", job_key="slurm-12.0", sampled_node="h/"
    ).environ()
    assert "MLFLOW_RUN_ID" not in env and env["OTEL_FORGE_JOB_ID"] == "slurm-12.0"
    read = LaunchedRun.from_environ(env)
    assert read is not None and read.pending and launched_run_id(env) is None
    assert LaunchedRun.from_environ({}) is None


def test_the_process_run_resumes_at_the_next_start_run_and_is_put_back_at_close() -> None:
    environ = {"UNRELATED": "1"}
    restore = make_process_run("r2", environ)
    assert environ["MLFLOW_RUN_ID"] == "r2" and launched_run_id(environ) == "r2"
    restore()
    assert environ == {"UNRELATED": "1"}
    # A run handed by `otel-forge run` stays as it was handed.
    environ = {"MLFLOW_RUN_ID": "r3", "OTEL_FORGE_LAUNCHED_RUN_ID": "r3"}
    make_process_run("r3", environ)()
    assert environ == {"MLFLOW_RUN_ID": "r3", "OTEL_FORGE_LAUNCHED_RUN_ID": "r3"}


def test_the_default_run_name_is_what_ran(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    assert script_stem(["otel-forge", "python", "train.py", "--lr", "0.1"]) == "train"
    assert script_stem(["train.py", "--steps", "3"]) == "train"  # sys.argv of an in-code TrainingRun
    assert script_stem(["otel-forge", "./train.sh"]) == "train"
    assert source_name(["-c"]) is None  # python -c: MLflow's own name then


def test_the_default_run_name_says_which_array_task_of_which_job(tmp_path, monkeypatch) -> None:
    import logging

    from otel_forge.mlflow.training.run_description import RunDescription
    from otel_forge.ratelimit import RateLimitedLogger
    from otel_forge.scrub import SecretKeys

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    for name, value in {"SLURM_JOB_ID": "1239", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "5"}.items():
        monkeypatch.setenv(name, value)
    warnings = RateLimitedLogger(logging.getLogger(__name__))
    description = RunDescription(None, None, {}, ["otel-forge", "python", "train.py"], SecretKeys(()), warnings)
    assert description.default_run_name() == "train-slurm-1234_5"
