"""The training process dies as jobs die (SIGKILL: the OOM killer, preemption, an NCCL abort), at any
moment, against a real ``mlflow server``: every value it logged arrives once, and its run is ended
(KILLED for a signal, FAILED for a non-zero exit or an exception, FINISHED for 0), by the companion
process that delivers its journal, in code with no wrapper and under ``otel-forge run``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
from trun_helpers import popen_script, run_script

from testkit.hermetic import hermetic_environ
from testkit.servers import REPO_ROOT, wait_for

# Logs `steps` steps of `width` values each, at `rate` steps a second, printing each step once logged;
# the flush interval is long, so at a kill most of what was logged has not been sent yet.
LOOP = """
import sys, time
from otel_forge import ForgeConfig, TrainingRun
run = TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, system_metrics=False,
                  forge_config=ForgeConfig.resolve(flush_interval_s={flush!r}, start_wait_s={wait!r}))
{enter}
print("begun", flush=True)
for step in range({steps}):
    run.log({{f"v{{i}}": step + i / 1000 for i in range({width})}}, step=step)
    print(step, flush=True)
    time.sleep(1 / {rate})
print("done", flush=True)
time.sleep(600)
"""


def _loop(uri: str, experiment: str, *, steps: int = 200, width: int = 1, rate: float = 50, flush: float = 30.0,
          wait: float = 15.0, enter: str = "run.start(30)") -> subprocess.Popen:  # fmt: skip
    code = LOOP.format(uri=uri, experiment=experiment, steps=steps, width=width, rate=rate, flush=flush, wait=wait,
                       enter=enter)  # fmt: skip
    return popen_script(textwrap.dedent(code))


def _logged_until(process: subprocess.Popen, last: int | None = None, timeout_s: float = 120.0) -> int:
    """Read the loop's lines until it has logged step ``last`` (or all); the last step it printed."""
    deadline, logged = time.monotonic() + timeout_s, -1
    while time.monotonic() < deadline:
        raw = process.stdout.readline()
        line = raw.strip()
        if not raw or line == "done":
            return logged
        if line.isdigit():
            logged = int(line)
            if last is not None and logged >= last:
                return logged
    raise AssertionError("the loop did not log in time")


def _kill(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def _the_run(client, experiment: str, timeout_s: float = 60.0):
    def found():
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs[0] if len(runs) == 1 else None

    return wait_for(found, timeout_s, 0.2, message=f"one run in {experiment}")


def _ended(client, run_id: str, timeout_s: float = 30.0) -> str:
    return wait_for(
        lambda: (status := client.get_run(run_id).info.status) != "RUNNING" and status, timeout_s, 0.2, message="end"
    )


def _steps(client, run_id: str, key: str = "v0") -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def _assert_every_step_once(client, run_id: str, logged: int, width: int = 1) -> None:
    for i in range(width):
        steps = _steps(client, run_id, f"v{i}")
        assert len(steps) == len(set(steps)), f"v{i}: a step arrived twice"
        assert steps[: logged + 1] == list(range(logged + 1)), f"v{i}: {len(steps)} steps, logged 0..{logged}"


@pytest.fixture
def client_factory():
    from mlflow import MlflowClient

    return MlflowClient


@pytest.mark.parametrize("moment", ["before-the-first-flush", "mid-flush"])
def test_a_killed_training_process_loses_no_value_and_its_run_ends_killed(moment, mlflow_server, client, experiment):
    # Before the first flush: 30 s flushes, killed after 100 steps. Mid-flush: a batch a step.
    flush = 30.0 if moment == "before-the-first-flush" else 0.0
    process = _loop(mlflow_server.uri, experiment, flush=flush)
    try:
        logged = _logged_until(process, 100)
        _kill(process)
    finally:
        process.kill()
    run = _the_run(client, experiment)
    assert _ended(client, run.info.run_id) == "KILLED"
    _assert_every_step_once(client, run.info.run_id, logged)


def test_killed_while_the_server_is_hung_everything_arrives_once_it_answers(
    pausable_server, client_factory, experiment
):
    process = _loop(pausable_server.uri, experiment)
    client = client_factory(pausable_server.uri)
    try:
        _logged_until(process, 20)
        pausable_server.pause()
        logged = _logged_until(process, 120)
        _kill(process)
        time.sleep(3)
    finally:
        pausable_server.resume()
        process.kill()
    resumed_at = time.monotonic()
    run = _the_run(client, experiment)
    assert _ended(client, run.info.run_id) == "KILLED"
    assert time.monotonic() - resumed_at < 15
    _assert_every_step_once(client, run.info.run_id, logged)


def test_killed_while_its_run_is_still_opening_the_run_is_made_and_holds_everything(
    pausable_server, client_factory, experiment
):
    pausable_server.pause()  # the run cannot open: the loop starts at once and logs into the journal
    try:
        process = _loop(pausable_server.uri, experiment, wait=0.0, enter="")
        try:
            logged = _logged_until(process, 60)
            _kill(process)
        finally:
            process.kill()
        time.sleep(2)
    finally:
        pausable_server.resume()
    client = client_factory(pausable_server.uri)
    run = _the_run(client, experiment)
    assert _ended(client, run.info.run_id) == "KILLED"
    _assert_every_step_once(client, run.info.run_id, logged)


def test_fifty_thousand_values_at_ten_thousand_a_second_then_sigkill_all_arrive(mlflow_server, client, experiment):
    process = _loop(mlflow_server.uri, experiment, steps=500, width=100, rate=100, flush=1.0)
    try:
        logged = _logged_until(process)
        _kill(process)
    finally:
        process.kill()
    assert logged == 499
    run = _the_run(client, experiment)
    assert _ended(client, run.info.run_id, timeout_s=90) == "KILLED"
    _assert_every_step_once(client, run.info.run_id, logged, width=100)


def test_thirty_thousand_calls_of_one_value_then_sigkill_all_arrive(mlflow_server, client, experiment):
    # More journal records than a delivery reads at once: the ones past its first read arrive too.
    process = _loop(mlflow_server.uri, experiment, steps=30_000, width=1, rate=10_000, flush=1.0)
    try:
        logged = _logged_until(process)
        _kill(process)
    finally:
        process.kill()
    assert logged == 29_999
    run = _the_run(client, experiment)
    assert _ended(client, run.info.run_id, timeout_s=120) == "KILLED"
    _assert_every_step_once(client, run.info.run_id, logged)


EXITS = {
    "exit-0": ("FINISHED", "sys.exit(0)"),
    "exit-3": ("FAILED", "sys.exit(3)"),
    "exception": ("FAILED", "raise RuntimeError('diverged')"),
}
TOP_LEVEL_EXITS = {
    **EXITS,
    "argparse-error": ("FAILED", "argparse.ArgumentParser().parse_args(['--no-such-flag'])"),
    "os._exit-0": ("FINISHED", "os._exit(0)"),
    "os._exit-3": ("FAILED", "os._exit(3)"),
    "end-of-script": ("FINISHED", "pass"),
}
# A TrainingRun logging 20 steps: in a ``with`` block ({start} opens it), or started and never closed.
ENDING = """
import argparse, os, sys
from otel_forge import ForgeConfig, TrainingRun
{start}TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, system_metrics=False,
                 forge_config=ForgeConfig.resolve(flush_interval_s=30.0)){opened}
{indent}for step in range(20):
{indent}    run.log({{"v0": float(step)}}, step=step)
{indent}{ending}
"""


def _run_of_a_script_ending(client, uri: str, experiment: str, ending: str, in_block: bool):  # type: ignore[no-untyped-def]
    """The script's stderr and its run's status; every step it logged is in the run once."""
    start, opened, indent = ("with ", " as run:", "    ") if in_block else ("run = ", "\nrun.start(30)", "")
    code = ENDING.format(start=start, opened=opened, indent=indent, uri=uri, experiment=experiment, ending=ending)
    result = run_script(textwrap.dedent(code), timeout_s=120)
    run = _the_run(client, experiment)
    _assert_every_step_once(client, run.info.run_id, 19)
    return result.stderr, client.get_run(run.info.run_id).info.status  # ended before the process exited


@pytest.mark.parametrize("how", list(EXITS))
def test_how_the_training_process_exits_is_how_its_run_ends(how, mlflow_server, client, experiment):
    status, ending = EXITS[how]
    stderr, ended = _run_of_a_script_ending(client, mlflow_server.uri, experiment, ending, in_block=True)
    assert "Traceback" not in stderr or how == "exception", stderr
    assert ended == status


@pytest.mark.parametrize("how", list(TOP_LEVEL_EXITS))
def test_an_exit_outside_any_block_ends_the_run_by_its_code(how, mlflow_server, client, experiment):
    """A script that starts its run and never closes it: the script's exit is the run's end."""
    status, ending = TOP_LEVEL_EXITS[how]
    stderr, ended = _run_of_a_script_ending(client, mlflow_server.uri, experiment, ending, in_block=False)
    assert ended == status, stderr


@pytest.mark.parametrize("moment", ["mid-run", "server-hung"])
def test_under_otel_forge_run_a_killed_command_loses_nothing(
    moment, pausable_server, client_factory, experiment, tmp_path
):
    client = client_factory(pausable_server.uri)
    code = LOOP.format(uri=pausable_server.uri, experiment=experiment, steps=200, width=1, rate=50, flush=30.0,
                       wait=15.0, enter="run.start(30)")  # fmt: skip
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(code))
    env = hermetic_environ({"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"), "PYTHONPATH": str(REPO_ROOT)},
                           prefixes=("OTEL_", "MLFLOW_"), MLFLOW_TRACKING_URI=pausable_server.uri)  # fmt: skip
    wrapper = subprocess.Popen(
        [sys.executable, "-m", "otel_forge.cli", "run", "--no-prometheus", "--experiment", experiment, "--",
         sys.executable, "-u", str(script)],  # fmt: skip
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    try:
        logged = _logged_until(wrapper, 100)
        if moment == "server-hung":
            pausable_server.pause()
            logged = _logged_until(wrapper, 150)
        [cmd] = [c for c in psutil.Process(wrapper.pid).children() if str(script) in " ".join(c.cmdline())]
        os.kill(cmd.pid, signal.SIGKILL)
        if moment == "server-hung":
            time.sleep(2)
            pausable_server.resume()
        assert wrapper.wait(timeout=60) == 128 + signal.SIGKILL
    finally:
        pausable_server.resume()
        wrapper.kill()
    run = _the_run(client, experiment)
    assert client.get_run(run.info.run_id).info.status == "KILLED"
    _assert_every_step_once(client, run.info.run_id, logged)
