"""One companion per node: the training processes of a node (a sweep's runs, a notebook beside a job)
share the process that samples and delivers for them, started by the first, left by the last. It
outlives the process that started it while it serves another, and one that dies is started again
once, whichever of them notices first."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap

import psutil
from prometheus_client.parser import text_string_to_metric_families
from trun_helpers import popen_script

from testkit.servers import free_port, http_get, wait_for

CPU_KEY = "system/cpu_utilization_percentage"
COMPANION = "otel_forge.cli.companion"

RUN_SCRIPT = """
import sys
from otel_forge import ForgeConfig, TrainingRun

config = ForgeConfig.resolve(sampling_interval_s=0.2, prometheus={port} is not None, prometheus_port={port} or 0)
with TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, forge_config=config) as run:
    run.log({{"loss": 0.0}}, step=0)
    run.wait_open(30)
    print("entered", run.run_id, flush=True)
    sys.stdin.readline()  # the test goes on meanwhile
    for step in range(1, 4):
        run.log({{"loss": float(step)}}, step=step)
print("closed", flush=True)
"""


def _start(uri: str, experiment: str, tmp_path, count: int, port: int | None = None) -> list[subprocess.Popen]:
    """``count`` training processes, started at once, each with its run; their run ids once entered.
    ``port``: the node's /metrics is served there (else not at all)."""
    script = textwrap.dedent(RUN_SCRIPT.format(uri=uri, experiment=experiment, port=port))
    env = {"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}
    return [popen_script(script, env, stdin=subprocess.PIPE) for _ in range(count)]


def _entered(process: subprocess.Popen) -> str:
    line = process.stdout.readline().split()
    assert line[:1] == ["entered"], process.stderr.read()
    return line[1]


def _companions() -> list[psutil.Process]:
    """The companions among this test's descendants."""
    found = []
    for process in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if COMPANION in process.cmdline() and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def _close(process: subprocess.Popen) -> str:
    out, err = process.communicate("\n", timeout=120)
    assert process.returncode == 0 and out.strip().endswith("closed"), err
    return err


def _finished_with_every_value(client, run_id: str) -> None:
    history = client.get_metric_history(run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [(step, float(step)) for step in range(4)]
    assert client.get_run(run_id).info.status == "FINISHED"
    assert client.get_metric_history(run_id, CPU_KEY), "the node's windows"


def _kill_all(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_three_runs_started_at_once_on_a_node_share_one_companion(mlflow_server, client, experiment, tmp_path):
    processes = _start(mlflow_server.uri, experiment, tmp_path, 3)
    try:
        run_ids = [_entered(process) for process in processes]
        assert len(set(run_ids)) == 3
        [companion] = _companions()
        assert companion.ppid() in {process.pid for process in processes}
        for process in processes:
            _close(process)
        companion.wait(timeout=30)  # its last session ended
    finally:
        _kill_all(processes)
    for run_id in run_ids:
        _finished_with_every_value(client, run_id)


def _series(port: int, family: str, label: str) -> set[str]:
    """The values of ``label`` across the samples of ``family`` on the node's /metrics."""
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200, body
    return {
        sample.labels[label]
        for metrics in text_string_to_metric_families(body)
        if metrics.name == family
        for sample in metrics.samples
    }


def test_the_runs_of_one_companion_are_sampled_by_one_agent_on_one_endpoint(
    mlflow_server, client, experiment, tmp_path
):
    """Three runs sampled by their node's companion: one /metrics serves the three (each run's info,
    each training process's tree), where an agent per run refused the port to all but the first."""
    port = free_port()
    processes = _start(mlflow_server.uri, experiment, tmp_path, 3, port=port)
    try:
        run_ids = {_entered(process) for process in processes}
        pids = {str(process.pid) for process in processes}
        wait_for(lambda: _series(port, "otel_forge_run_info", "mlflow_run_id") == run_ids, 60, 0.2, "the runs")
        wait_for(lambda: _series(port, "process_memory_usage_bytes", "process_pid") == pids, 60, 0.2, "the trees")
        errors = [_close(process) for process in processes]
    finally:
        _kill_all(processes)
    assert not any("cannot serve Prometheus" in err for err in errors), errors
    for run_id in run_ids:
        _finished_with_every_value(client, run_id)


def test_the_companion_outlives_the_process_that_started_it_while_it_serves_another(
    mlflow_server, client, experiment, tmp_path
):
    """The process that started the companion is SIGKILLed: its run ends KILLED with what it logged;
    the other's run goes on being delivered and sampled by the same companion."""
    [first] = _start(mlflow_server.uri, experiment, tmp_path, 1)
    processes = [first]
    try:
        first_run = _entered(first)
        [companion] = _companions()
        assert companion.ppid() == first.pid
        [second] = _start(mlflow_server.uri, experiment, tmp_path, 1)
        processes.append(second)
        second_run = _entered(second)
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=10)
        wait_for(lambda: client.get_run(first_run).info.status == "KILLED", 60, message="the killed run ended")
        assert companion.is_running()
        windows = len(client.get_metric_history(second_run, CPU_KEY))
        wait_for(lambda: len(client.get_metric_history(second_run, CPU_KEY)) > windows, 60, message="windows go on")
        _close(second)
        companion.wait(timeout=30)
    finally:
        _kill_all(processes)
    _finished_with_every_value(client, second_run)
    assert [(m.step, m.value) for m in client.get_metric_history(first_run, "loss")] == [(0, 0.0)]


def test_a_companion_killed_under_two_runs_is_started_again_once_and_takes_both_journals_on(
    mlflow_server, client, experiment, tmp_path
):
    processes = _start(mlflow_server.uri, experiment, tmp_path, 2)
    try:
        run_ids = [_entered(process) for process in processes]
        [companion] = _companions()
        companion.kill()
        companion.wait(timeout=10)
        wait_for(lambda: len(_companions()) >= 1, 30, message="a new companion")
        [again] = _companions()
        assert again.pid != companion.pid
        errors = [_close(process) for process in processes]
    finally:
        _kill_all(processes)
    assert sum(f"the otel-forge companion (pid {companion.pid}) ended" in err for err in errors) == 2, errors
    for run_id in run_ids:
        _finished_with_every_value(client, run_id)
