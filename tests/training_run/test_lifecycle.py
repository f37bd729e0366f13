"""Opening and ending a ``TrainingRun``: lazy construction, the first ``log()`` opens the run,
``close()`` and the context manager's statuses, process exit paths (SIGTERM, atexit, uncaught
exception) in real subprocesses, and the Databricks experiment rule."""

from __future__ import annotations

import json
import signal
import textwrap
import time

import pytest
from run_reading import anchor_steps
from trun_helpers import popen_script, run_script

from otel_forge.config import ConfigError, ForgeConfig
from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.proxy import MlflowProxy, Mode
from testkit.servers import wait_for

LAZY_SCRIPT = """
import json, sys, threading, time
from otel_forge.config import ConfigError
from otel_forge.mlflow.training.training_run import TrainingRun

threads_before = threading.active_count()
run = TrainingRun({{"lr": 0.1}}, tracking_uri={uri!r}, experiment={experiment!r}, run_name="lazy",
                  register_checkpoints=True, launch_argv=["train.py"])
databricks = []
for uri, experiment in (("databricks", "relative"), ("databricks://profile", "also/relative")):
    try:
        TrainingRun(tracking_uri=uri, experiment=experiment)
    except ConfigError as error:
        databricks.append(str(error))
TrainingRun(tracking_uri="databricks", experiment="/Users/someone@example.com/project")
TrainingRun(tracking_uri="databricks", experiment="1234567")
time.sleep(0.5)
print(json.dumps({{"mlflow_imported": "mlflow" in sys.modules, "threads": threading.active_count() - threads_before,
                  "run_id": run.run_id, "entry": run.tracking_entry(), "fields": run.checkpoint_fields(3),
                  "databricks": databricks}}))
"""


def test_construction_does_no_io(mlflow_server, client, experiment):
    with MlflowProxy(mlflow_server.uri) as proxy:
        done = run_script(LAZY_SCRIPT.format(uri=proxy.uri, experiment=experiment))
        assert done.returncode == 0, done.stderr
        state = json.loads(done.stdout.strip().splitlines()[-1])
        assert proxy.total() == 0
    assert state == {
        "mlflow_imported": False,
        "threads": 0,
        "run_id": None,
        "entry": None,
        "fields": None,
        "databricks": state["databricks"],
    }
    assert len(state["databricks"]) == 2
    assert all("absolute workspace path" in message for message in state["databricks"])
    assert client.get_experiment_by_name(experiment) is None


def test_first_log_opens_the_run(mlflow_server, client, experiment):
    with MlflowProxy(mlflow_server.uri) as proxy:
        run = TrainingRun(
            {"lr": 0.1}, tracking_uri=proxy.uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"]
        )
        assert (run.run_id, run.tracking_entry(), proxy.total()) == (None, None, 0)
        run.log({"loss": 1.0}, step=0)
        wait_for(lambda: run.run_id is not None, 30, 0.05)
        assert proxy.total() > 0
        assert run.tracking_entry() == {
            "backend": "mlflow",
            "run_id": run.run_id,
            "experiment": experiment,
            "tracking_uri": proxy.uri,
        }
        run.close()
    data = client.get_run(run.run_id)
    assert data.info.status == "FINISHED"
    assert data.data.metrics == {"loss": 1.0}
    assert run.tracking_entry() is None  # closed


def test_close_without_entering_or_logging_creates_no_run(mlflow_server, client, experiment):
    with MlflowProxy(mlflow_server.uri) as proxy:
        run = TrainingRun(
            {"lr": 0.1}, tracking_uri=proxy.uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"]
        )
        run.close()
        assert proxy.total() == 0
    assert client.get_experiment_by_name(experiment) is None


def test_entering_opens_the_run_without_a_log(mlflow_server, client, experiment):
    # Every rank enters its TrainingRun: that alone must open the run (and start the node's sampling).
    with TrainingRun(
        {"lr": 0.1},
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        system_metrics=False,
        launch_argv=["train.py"],
    ) as run:
        wait_for(lambda: run.run_id is not None, 30, 0.05)
    found = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert [(r.info.run_id, r.info.status, r.data.params) for r in found] == [(run.run_id, "FINISHED", {"lr": "0.1"})]


def test_a_loop_that_ends_before_its_run_opens_keeps_the_nodes_windows(mlflow_server, client, experiment):
    # A slow server (every call 0.5 s), and entering does not wait for it (start_wait_s=0): the run
    # opens after the loop ended. The windows sampled meanwhile wait for it, and close() lets it open
    # before stopping the sampling.
    config = ForgeConfig.resolve(
        environ={},
        sampling_interval_s=0.1,
        samples_per_window=1,
        collectors=["cpu"],
        prometheus=False,
        spool_dir=None,
        start_wait_s=0.0,
    )
    with MlflowProxy(mlflow_server.uri) as proxy:
        proxy.set_mode(Mode.DELAY, delay_s=0.5)
        with TrainingRun(
            {"lr": 0.1}, tracking_uri=proxy.uri, experiment=experiment, launch_argv=["train.py"], forge_config=config
        ) as run:
            time.sleep(0.5)  # the loop: shorter than the first call to the server
            assert run.run_id is None
    steps = anchor_steps(client, run.run_id)
    assert len(steps) >= 5 and steps == list(range(len(steps))), steps
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_databricks_relative_experiment_is_a_config_error(monkeypatch):
    with pytest.raises(ConfigError, match="absolute workspace path"):
        TrainingRun(tracking_uri="databricks", experiment="relative")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "relative-from-env")
    with pytest.raises(ConfigError, match="relative-from-env"):
        TrainingRun(tracking_uri="databricks")


def _statuses(client, experiment):
    found = client.get_experiment_by_name(experiment)
    return {r.info.run_name: r.info.status for r in client.search_runs([found.experiment_id])}


def test_close_statuses_and_idempotence(mlflow_server, client, experiment):
    def training_run(name):
        return TrainingRun(
            tracking_uri=mlflow_server.uri,
            experiment=experiment,
            run_name=name,
            system_metrics=False,
            launch_argv=["train.py"],
        )

    with training_run("normal") as run:
        run.log({"loss": 1.0}, step=0)
    with pytest.raises(ValueError), training_run("error") as run:
        run.log({"loss": 1.0}, step=0)
        raise ValueError("boom")
    with pytest.raises(KeyboardInterrupt), training_run("interrupt") as run:
        run.log({"loss": 1.0}, step=0)
        raise KeyboardInterrupt
    twice = training_run("twice")
    twice.log({"loss": 1.0}, step=0)
    twice.close()
    twice.close()
    twice.close("FAILED")  # already closed: nothing happens
    twice.log({"loss": 2.0}, step=1)  # after close: a no-op
    assert _statuses(client, experiment) == {
        "normal": "FINISHED",
        "error": "FAILED",
        "interrupt": "KILLED",
        "twice": "FINISHED",
    }
    assert [(m.step, m.value) for m in client.get_metric_history(twice.run_id, "loss")] == [(0, 1.0)]


EXIT_SCRIPT = """
import signal, sys, time
from otel_forge.mlflow.training.training_run import TrainingRun

run = TrainingRun({{"lr": 0.1}}, tracking_uri={uri!r}, experiment={experiment!r}, run_name={name!r},
                  system_metrics=False, launch_argv=["train.py"])
for step in range(3):
    run.log({{"loss": float(step)}}, step=step)
assert run.start()
print(run.run_id, flush=True)
if {name!r} == "sigterm":
    step = 3
    while True:
        run.log({{"loss": float(step)}}, step=step)
        step += 1
        time.sleep(0.01)
elif {name!r} == "exception":
    raise RuntimeError("training blew up")
"""


def test_process_exit_paths_end_the_run(mlflow_server, client, experiment):
    processes = {
        name: popen_script(textwrap.dedent(EXIT_SCRIPT.format(uri=mlflow_server.uri, experiment=experiment, name=name)))
        for name in ("sigterm", "normal-exit", "exception")
    }
    try:
        run_ids = {name: process.stdout.readline().strip() for name, process in processes.items()}
        assert all(run_ids.values()), {n: p.stderr.read() for n, p in processes.items() if not run_ids[n]}
        processes["sigterm"].send_signal(signal.SIGTERM)
        results = {name: (process.wait(timeout=60), process.stderr.read()) for name, process in processes.items()}
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
            process.stdout.close()
            process.stderr.close()
    assert results["sigterm"][0] == -signal.SIGTERM, results["sigterm"][1]  # dies as SIGTERM would kill it
    assert results["normal-exit"][0] == 0, results["normal-exit"][1]
    assert results["exception"][0] == 1 and "training blew up" in results["exception"][1]
    assert _statuses(client, experiment) == {"sigterm": "KILLED", "normal-exit": "FINISHED", "exception": "FAILED"}
    for name, run_id in run_ids.items():
        steps = [m.step for m in client.get_metric_history(run_id, "loss")]
        assert sorted(steps)[:3] == [0, 1, 2], name
        assert sorted(steps) == list(range(len(steps))), name  # nothing lost in between
