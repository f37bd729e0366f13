"""A ``TrainingRun`` samples its node in a child process: the training process runs no collector, no
SDK reader and no MLflow window call (they took its GIL from the loop), and the child stops with the
run, or by itself once the training process is gone, its windows delivered. One such companion serves
every training process of the node: it outlives the one that started it while another is served."""

from __future__ import annotations

import contextlib
import os
import signal
import textwrap
import threading

import psutil
import pytest
from trun_helpers import popen_script

from otel_forge import ForgeConfig, TrainingRun
from testkit.servers import wait_for

CPU_KEY = "system/cpu_utilization_percentage"
WATCH = "otel-forge-companion-watch"  # blocked in recv on the companion: no wake-up while it lives
REAP = "otel-forge-companion-reap"  # blocked in waitpid on the companion it started


def _samplers(parent: psutil.Process, but: frozenset[int] = frozenset()) -> list[psutil.Process]:
    """The companions ``parent`` runs, ``but`` those (an earlier test's may still be finishing)."""
    found = []
    for child in parent.children():
        with contextlib.suppress(psutil.Error):  # a child gone, or a zombie an earlier test left unreaped
            if "otel_forge.cli.companion" in " ".join(child.cmdline()) and child.pid not in but:
                found.append(child)
    return found


@pytest.fixture
def own_companion(monkeypatch, tmp_path):
    """This test's runs get a companion of their own: the node's companion is shared by processes whose
    OTel and MLflow variables agree (companion_link.py), and an earlier test's may still be serving."""
    monkeypatch.setenv("OTEL_FORGE_SPOOL_DIR", str(tmp_path / "spool"))


def _running() -> frozenset[int]:
    return frozenset(child.pid for child in _samplers(psutil.Process()))


def test_the_node_is_sampled_by_a_child_process_and_no_thread_of_the_training_process(
    mlflow_server, client, experiment, own_companion
):
    config = ForgeConfig.resolve(environ={}, sampling_interval_s=0.2, prometheus=False)
    threads_before = {thread.ident for thread in threading.enumerate()}
    earlier = _running()
    with TrainingRun(tracking_uri=mlflow_server.uri, experiment=experiment, forge_config=config) as run:
        run.log({"loss": 1.0}, step=0)
        wait_for(lambda: len(client.get_metric_history(run.run_id, CPU_KEY)) >= 2, 60, message="sampled windows")
        [sampler] = _samplers(psutil.Process(), earlier)
        ours = sorted(t.name for t in threading.enumerate() if t.ident not in threads_before)
    # The run's owner and the watch that stands MLflow's own sampler down (a look at
    # a dict a second): no reader, collector or exporter thread.
    assert set(ours) <= {"mlflow-run-owner", "otel-forge-mlflow-sampler", WATCH, REAP}, ours
    sampler.wait(timeout=10)  # its last session ended: it leaves
    after_close = len(client.get_metric_history(run.run_id, CPU_KEY))
    assert after_close >= 2
    assert client.get_run(run.run_id).info.status == "FINISHED"


KILLED_SCRIPT = """
import os, sys, time
import psutil
from otel_forge import ForgeConfig, TrainingRun
run = TrainingRun(tracking_uri={uri!r}, experiment={experiment!r},
                  forge_config=ForgeConfig.resolve(sampling_interval_s=0.2, prometheus=False))
run.start(timeout_s=30)
run.log({{"loss": 1.0}}, step=0)
time.sleep(3)
[sampler] = [c for c in psutil.Process().children() if "otel_forge.cli.companion" in " ".join(c.cmdline())]
print(run.run_id, sampler.pid, flush=True)
time.sleep(600)
"""


def test_a_sampler_whose_training_process_was_killed_delivers_its_windows_and_exits(mlflow_server, client, experiment):
    script = textwrap.dedent(KILLED_SCRIPT.format(uri=mlflow_server.uri, experiment=experiment))
    process = popen_script(script)
    try:
        run_id, sampler_pid = process.stdout.readline().split()
        sampler = psutil.Process(int(sampler_pid))
        windows_before = len(client.get_metric_history(run_id, CPU_KEY))
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        sampler.wait(timeout=60)  # it notices its parent is gone, stops, delivers, exits
    finally:
        if process.poll() is None:
            process.kill()
        process.stdout.close()
        process.stderr.close()
    assert len(client.get_metric_history(run_id, CPU_KEY)) > windows_before


def test_monitor_samples_the_node_in_a_companion_process_too(mlflow_server, client, experiment, own_companion):
    import otel_forge

    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    threads_before = {thread.ident for thread in threading.enumerate()}
    earlier = _running()
    with otel_forge.monitor(run_id=run_id, tracking_uri=mlflow_server.uri, sampling_interval=0.2, prometheus=False):
        wait_for(lambda: len(client.get_metric_history(run_id, CPU_KEY)) >= 2, 60, message="sampled windows")
        [companion] = _samplers(psutil.Process(), earlier)
        ours = sorted(t.name for t in threading.enumerate() if t.ident not in threads_before)
    # At most the watch that stands MLflow's own sampler down: no reader, collector or exporter thread.
    assert set(ours) <= {"otel-forge-mlflow-sampler", WATCH, REAP}, ours
    companion.wait(timeout=10)  # stopped with the block
    assert len(client.get_metric_history(run_id, CPU_KEY)) >= 2
