"""Ranks other than 0 stay thin. One given the job's run (``otel-forge run`` hands it down, or
``MLFLOW_RUN_ID``) only attaches; one that neither logs nor samples its node and knows only the job's
key does not look for the run at all. Inside ``with TrainingRun()`` neither imports MLflow or opens a
connection to the server; one that fails still ends the run FAILED with its outcome (found then)."""

from __future__ import annotations

import contextlib
import getpass
import json
import subprocess
import sys

import psutil
import pytest
from trun_helpers import _script_environ, popen_script, run_script, unique

# A script's first lines: ``connects`` counts its network connections (the node's companion is reached
# on a Unix socket, its address a str). No braces: the scripts that follow may be ``str.format``ted.
COUNTS_CONNECTS = """
import json, socket, sys
connects = []
connect = socket.socket.connect
def counted(sock, address):
    if isinstance(address, tuple):
        connects.append(address)
    return connect(sock, address)
socket.socket.connect = counted
"""

RANK_SCRIPT = (
    COUNTS_CONNECTS
    + """
from otel_forge import TrainingRun

with TrainingRun(system_metrics=False) as run:
    run.log({{"loss": 1.0}}, step=0)
    run.wait_open(10)  # a rank given the run has it at once; one with the job key only never looks
    inside = {{"mlflow": "mlflow" in sys.modules, "connects": len(connects), "run_id": run.run_id}}
    if {fail}:
        print(json.dumps(inside), flush=True)
        raise RuntimeError("rank fails")
print(json.dumps({{**inside, "mlflow_after": "mlflow" in sys.modules, "connects_after": len(connects)}}))
"""
)


def _rank_environ(uri: str, run_id: str | None, rank: int, tmp_path, **more: str) -> dict[str, str]:
    return {
        "MLFLOW_TRACKING_URI": uri, "RANK": str(rank), "LOCAL_RANK": str(rank % 2), "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2", "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"),
        **({"MLFLOW_RUN_ID": run_id} if run_id else {}), **more,
    }  # fmt: skip


@pytest.mark.parametrize("rank", [1, 2, 3])
def test_a_rank_given_the_run_imports_no_mlflow_and_connects_to_nothing(mlflow_server, client, tmp_path, rank):
    experiment_id = client.create_experiment(unique("thin"))
    run_id = client.create_run(experiment_id).info.run_id
    done = run_script(RANK_SCRIPT.format(fail=False), _rank_environ(mlflow_server.uri, run_id, rank, tmp_path))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen == {
        "mlflow": False, "connects": 0, "run_id": run_id, "mlflow_after": False, "connects_after": 0,
    }  # fmt: skip
    assert client.get_run(run_id).info.status == "RUNNING"  # rank 0 ends it, not rank 1


def test_a_failing_rank_given_the_run_still_ends_it_failed_with_its_outcome(mlflow_server, client, tmp_path):
    experiment_id = client.create_experiment(unique("thin-fails"))
    run_id = client.create_run(experiment_id).info.run_id
    done = run_script(RANK_SCRIPT.format(fail=True), _rank_environ(mlflow_server.uri, run_id, 1, tmp_path))
    assert done.returncode == 1 and "rank fails" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["mlflow"] is False  # until it failed
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["otel_forge.job.outcome"] == "FAILED"
    assert [v for k, v in run.data.tags.items() if k.startswith("otel_forge.outcome.")] == ["FAILED (rank 1)"]


RANK_ZERO_SCRIPT = """
import sys
from otel_forge import TrainingRun

with TrainingRun(system_metrics=False) as run:
    run.log({"loss": 1.0}, step=0)
    print(run.run_id, flush=True)
    sys.stdin.readline()
"""


def test_a_rank_that_knows_only_the_job_key_looks_for_the_run_only_when_it_fails(mlflow_server, client, tmp_path):
    job = {"OTEL_FORGE_JOB_ID": unique("job"), "MLFLOW_EXPERIMENT_NAME": unique("thin-key")}
    zero = popen_script(RANK_ZERO_SCRIPT, _rank_environ(mlflow_server.uri, None, 0, tmp_path, **job), stdin=-1)
    try:
        run_id = zero.stdout.readline().strip()
        assert run_id, zero.stderr.read()
        for fail in (False, True):  # rank 3 (local rank 1) ends well, then another attempt of it fails
            done = run_script(RANK_SCRIPT.format(fail=fail), _rank_environ(mlflow_server.uri, None, 3, tmp_path, **job))
            seen = json.loads(done.stdout.splitlines()[-1])
            assert (seen["mlflow"], seen["connects"], seen["run_id"]) == (False, 0, None), done.stderr
            assert done.returncode == (1 if fail else 0), done.stderr
        run = client.get_run(run_id)
        assert run.info.status == "FAILED"
        outcomes = [v for k, v in run.data.tags.items() if k.startswith("otel_forge.outcome.")]
        assert outcomes == ["FAILED (rank 3)"]
    finally:
        zero.stdin.close()
        zero.wait(timeout=60)


RANK_ZERO_THIN_SCRIPT = (
    COUNTS_CONNECTS
    + """
import otel_forge
from otel_forge import TrainingRun

with TrainingRun(config={"lr": 0.1}, system_metrics=False) as run:
    run.log({"loss": 1.0}, step=0)
    job_run_id = otel_forge.job_run_id()  # as Lightning's MLFlowLogger(run_id=...) is given it: waits for it
    inside = {"mlflow": "mlflow" in sys.modules, "connects": len(connects), "job_run_id": job_run_id}
    import mlflow  # a framework's MLflow calls inside the block go to the job's run: the import waits for it

    mlflow.log_metric("framework", 2.0, step=0)
    inside["framework_run"] = mlflow.active_run().info.run_id
    inside["run_id"] = run.run_id
print(json.dumps(inside))
"""
)


@pytest.mark.parametrize("key", ["job key", "new run"])
def test_rank_zero_opens_its_run_through_the_companion_with_no_mlflow_import_and_no_connection(
    mlflow_server, client, tmp_path, key
):
    """Global rank 0 journals only: its companion opens the run from the journal (a new one, or the
    job key's) and tells it the id; MLflow's context tags are the script's. The block begins at once,
    and what needs the run waits for it: ``job_run_id()`` (Lightning's logger is given it) and MLflow's
    import (a framework's calls inside the block go to the job's run)."""
    experiment = unique("thin-zero")
    job = {"OTEL_FORGE_JOB_ID": unique("job")} if key == "job key" else {}
    script = tmp_path / "train.py"
    script.write_text(RANK_ZERO_THIN_SCRIPT)
    env = _rank_environ(mlflow_server.uri, None, 0, tmp_path, MLFLOW_EXPERIMENT_NAME=experiment, **job)
    done = subprocess.run(
        [sys.executable, str(script)], env=_script_environ(env), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert (seen["mlflow"], seen["connects"]) == (False, 0), done.stderr
    run = client.get_run(seen["run_id"])
    assert seen["framework_run"] == seen["job_run_id"] == run.info.run_id
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == experiment
    assert {k: m for k, m in run.data.metrics.items()} == {"loss": 1.0, "framework": 2.0}
    assert run.data.params == {"lr": "0.1"}
    tags = run.data.tags
    assert (tags["mlflow.source.name"], tags["mlflow.user"], tags["mlflow.runName"]) == (
        str(script),
        getpass.getuser(),
        "train",
    )
    assert tags.get("otel_forge.job.key", "").startswith(job.get("OTEL_FORGE_JOB_ID", "otel-forge-"))


def test_rank_zero_under_otel_forge_run_attaches_to_the_launchers_run_with_no_mlflow_import(
    mlflow_server, client, tmp_path
):
    """Under ``otel-forge run`` the launcher opened the run, read it and delivers CMD's journal: rank 0
    attaches by id, as the other ranks do, and a framework's MLflow calls in the block go to that run."""
    experiment = unique("thin-launched")
    script = tmp_path / "train.py"
    script.write_text(RANK_ZERO_THIN_SCRIPT)
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri, "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}
    command = [sys.executable, "-m", "otel_forge.cli", "run", "--no-prometheus", "--experiment", experiment]
    done = subprocess.run(
        [*command, "--", sys.executable, str(script)], env=_script_environ(env), capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert (seen["mlflow"], seen["connects"]) == (False, 0), done.stderr
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert seen["run_id"] == seen["job_run_id"] == seen["framework_run"] == run.info.run_id
    assert run.info.status == "FINISHED"
    assert {k: v for k, v in run.data.metrics.items() if not k.startswith("system/")} == {
        "loss": 1.0, "framework": 2.0,
    }  # fmt: skip
    assert run.data.params["lr"] == "0.1"


def _rank_zero(tmp_path, uri: str, script: str, **more: str) -> subprocess.Popen:
    path = tmp_path / "train.py"
    path.write_text(script)
    env = _rank_environ(uri, None, 0, tmp_path, MLFLOW_EXPERIMENT_NAME=unique("thin-fault"), **more)
    return subprocess.Popen(
        [sys.executable, "-u", str(path)], env=_script_environ(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


GIVEN_SCRIPT = """
import sys
from otel_forge import TrainingRun

with TrainingRun(system_metrics=False) as run:
    for step in range(3):
        run.log({"loss": 1.0}, step=step)
    print("run", run.run_id, "mlflow" in sys.modules, flush=True)
print("done", flush=True)
"""


def test_rank_zero_given_a_run_that_does_not_exist_says_so_once_and_trains_on(mlflow_server, tmp_path):
    """The companion cannot open the run (an id that names none): it tells rank 0, which says why in one
    line, disables its journal and trains on, no traceback."""
    missing = "0" * 31 + "1"
    zero = _rank_zero(tmp_path, mlflow_server.uri, GIVEN_SCRIPT, MLFLOW_RUN_ID=missing)
    out, err = zero.communicate(timeout=120)
    assert zero.returncode == 0, err
    assert out.splitlines() == ["run None False", "done"], err
    said = [line for line in err.splitlines() if "MLflow logging disabled" in line]
    assert len(said) == 1 and f"run {missing} does not exist" in said[0], err
    assert "Traceback" not in err


def _companions(parent: psutil.Process) -> list[psutil.Process]:
    """``parent``'s companions (a child that just exited, a `git` the rank ran, is a zombie: skipped)."""
    found = []
    for child in parent.children():
        with contextlib.suppress(psutil.Error):
            if "otel_forge.cli.companion" in child.cmdline():
                found.append(child)
    return found


COMPANION_KILLED_SCRIPT = """
import sys
from otel_forge import TrainingRun

with TrainingRun(system_metrics=False) as run:
    run.log({"loss": 0.0}, step=0)
    print("entered", flush=True)
    sys.stdin.readline()  # the test kills the companion meanwhile
    for step in range(1, 5):
        run.log({"loss": float(step)}, step=step)
    print("run", run.run_id, flush=True)
"""


def test_a_companion_killed_before_it_opened_the_run_is_replaced_and_the_next_one_opens_it(
    mlflow_server, client, tmp_path
):
    """SIGKILL the companion that was to open rank 0's run: another takes the journal on and opens the
    run, and rank 0 learns it from that one; nothing logged is lost."""
    zero = _rank_zero(tmp_path, mlflow_server.uri, COMPANION_KILLED_SCRIPT)
    try:
        assert zero.stdout.readline().strip() == "entered", zero.stderr.read()
        [companion] = _companions(psutil.Process(zero.pid))
        companion.kill()
        companion.wait(10)
        zero.stdin.write("\n")
        zero.stdin.flush()
        out, err = zero.communicate(timeout=120)
    finally:
        zero.kill()
    assert zero.returncode == 0, err
    run_id = out.split()[-1]
    assert f"the otel-forge companion (pid {companion.pid}) ended (signal 9)" in err
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(step, float(step)) for step in range(5)]
    assert client.get_run(run_id).info.status == "FINISHED"


SCRIPT_NAMES_NONE = """
import json, sys
from otel_forge import TrainingRun

with TrainingRun(config={"lr": 0.1}, system_metrics=False) as run:
    for step in range(3):
        run.log({"loss": float(step)}, step=step)
    inside = "mlflow" in sys.modules
print(json.dumps({"mlflow": inside, "mlflow_after": "mlflow" in sys.modules}))
"""


def test_a_lone_process_that_names_no_experiment_leaves_the_open_to_its_companion(mlflow_server, client, tmp_path):
    """One process, no experiment named by anything: the script could still name one (its first MLflow
    run would be the job's), and does not; the companion opens the run in the default experiment."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT_NAMES_NONE)
    env = {"MLFLOW_TRACKING_URI": mlflow_server.uri, "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}
    done = subprocess.run(
        [sys.executable, str(script)], env=_script_environ(env), capture_output=True, text=True, timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"mlflow": False, "mlflow_after": False}, done.stderr
    runs = client.search_runs([client.get_experiment_by_name("otel-forge").experiment_id])
    [run] = [r for r in runs if r.data.tags.get("mlflow.source.name") == str(script)]
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")) == [
        (0, 0.0), (1, 1.0), (2, 2.0),
    ]  # fmt: skip


ADOPTING_SCRIPT = (
    COUNTS_CONNECTS
    + """
from otel_forge import TrainingRun

with TrainingRun(config={{"{name}_lr": 0.1}}, system_metrics=False) as run:
    run.log({{"{name}": 1.0}}, step=0)  # the first value: the script named no experiment, the run opens now
    run.wait_open(60)
    seen = {{"mlflow": "mlflow" in sys.modules, "connects": len(connects), "run_id": run.run_id}}
    print(json.dumps(seen), flush=True)
    sys.stdin.readline()
"""
)


def test_a_process_adopting_the_run_another_of_its_job_claimed_imports_no_mlflow(mlflow_server, client, tmp_path):
    """Two processes of one job (its key), the experiment left to the script: the first claims the job's
    run and its companion opens it; the second adopts the published run through the node's companion,
    its description added, with no MLflow import and no connection of its own."""
    env = {
        "MLFLOW_TRACKING_URI": mlflow_server.uri, "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"),
        "OTEL_FORGE_JOB_ID": unique("adopted"),
    }  # fmt: skip
    started, seen = [], []
    try:
        for name in ("first", "second"):  # one after the other: the first has claimed and published the run
            started.append(popen_script(ADOPTING_SCRIPT.format(name=name), env, cwd=tmp_path, stdin=subprocess.PIPE))
            line = started[-1].stdout.readline()
            assert line, started[-1].communicate(timeout=60)[1]
            seen.append(json.loads(line))
        first, second = seen
    finally:
        for process in started:
            process.stdin.close()
        codes = [process.wait(timeout=60) for process in started]
    assert codes == [0, 0], [process.stderr.read() for process in started]
    assert (second["mlflow"], second["connects"]) == (False, 0), second
    assert (first["mlflow"], first["connects"]) == (False, 0), first
    assert second["run_id"] == first["run_id"] is not None
    run = client.get_run(first["run_id"])
    assert run.data.metrics == {"first": 1.0, "second": 1.0}  # both at step 0: the adopter's is not skipped
    assert run.data.params == {"first_lr": "0.1", "second_lr": "0.1"}  # the adopter's description added
    assert run.info.status == "FINISHED"


LATE_SCRIPT = (
    COUNTS_CONNECTS
    + """
import time
time.sleep(6)  # well past otel-forge run's 2 s wait for the script to name the experiment: the launcher claims
from otel_forge import TrainingRun

with TrainingRun(config={"lr": 0.1}, system_metrics=False) as run:
    run.log({"loss": 1.0}, step=0)
    run.wait_open(60)
    seen = {"mlflow": "mlflow" in sys.modules, "connects": len(connects), "run_id": run.run_id}
print(json.dumps(seen))
"""
)


def test_under_otel_forge_run_a_trainingrun_adopting_the_launchers_run_imports_no_mlflow(
    mlflow_server, client, tmp_path
):
    """Nothing names the experiment; the script enters its block 6 s in, after the launcher's 2 s wait, so the
    launcher has claimed and opened the job's run: the block attaches to it by its published id, and the
    launcher's delivery adds its config and values. No MLflow import, no connection in the script."""
    script = tmp_path / "train.py"
    script.write_text(LATE_SCRIPT)
    env = {
        "MLFLOW_TRACKING_URI": mlflow_server.uri, "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"),
        "OTEL_FORGE_EXPERIMENT_WAIT": "2",
    }  # fmt: skip
    command = [sys.executable, "-m", "otel_forge.cli", "run", "--no-prometheus", "--", sys.executable, str(script)]
    done = subprocess.run(command, env=_script_environ(env), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert (seen["mlflow"], seen["connects"]) == (False, 0), done.stderr
    run = client.get_run(seen["run_id"])
    assert f"otel-forge: run {run.info.run_id} in experiment otel-forge" in done.stderr
    assert run.info.status == "FINISHED"
    assert {k: v for k, v in run.data.metrics.items() if not k.startswith("system/")} == {"loss": 1.0}
    assert run.data.params["lr"] == "0.1"
