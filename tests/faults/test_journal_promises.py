"""The journal's promises where users' jobs broke them (issue 41's table), each against a real
``mlflow server`` and a real training process: no exception reaches the script, every value whose
``log()`` reported no drop is in the run once, the run ends with the status the job earned, and
what the user is told is true."""

from __future__ import annotations

import subprocess
import textwrap
import time

import pytest
from trun_helpers import popen_script, unique

from testkit.mlflow_server import MlflowServer
from testkit.servers import free_port, wait_for

pytestmark = pytest.mark.slow

WIDTH = 100  # values a log() call

# Logs BEFORE steps while the server refuses connections, says so, waits for a line on stdin (the
# server is up), waits for its run (bounded), logs AFTER steps more, and leaves the block.
SERVER_COMES_UP = """
import sys, time
from otel_forge import ForgeConfig, TrainingRun
values = lambda step: {{f"v{{i}}": step + i / 1000 for i in range({width})}}
entered_at = time.monotonic()
with TrainingRun(config={{"lr": 0.25, "layers": 4}}, tracking_uri={uri!r}, experiment={experiment!r},
                 system_metrics=False) as run:
    print("entered", round(time.monotonic() - entered_at, 2), flush=True)
    for step in range({before}):
        run.log(values(step), step=step)
    print("logged", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + 60
    while run.run_id is None and time.monotonic() < deadline:
        time.sleep(0.1)
    print("opened", run.run_id, flush=True)
    for step in range({before}, {before} + {after}):
        run.log(values(step), step=step)
        time.sleep(0.01)
    closing_at = time.monotonic()
print("closed", round(time.monotonic() - closing_at, 2), flush=True)
"""


def _line(process: subprocess.Popen, starts: str, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        if line.startswith(starts):
            return line.strip()
    raise AssertionError(f"no line {starts!r}; stderr: {process.stderr.read()[-2000:] if process.poll() else ''}")


def _the_run(client, experiment: str, timeout_s: float = 90.0):
    def found():
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs[0] if len(runs) == 1 and runs[0].info.status != "RUNNING" else None

    return wait_for(found, timeout_s, 0.5, message=f"one ended run in {experiment}")


def _assert_every_value_once(client, run, steps: int) -> None:
    assert len([key for key in run.data.metrics if key.startswith("v")]) == WIDTH
    for key in ("v0", f"v{WIDTH // 2}", f"v{WIDTH - 1}"):
        history = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert history == list(range(steps)), f"{key}: {len(history)} steps of {steps}"


@pytest.fixture
def down_server(tmp_path):
    """A server on a port that refuses connections until the test starts it."""
    (tmp_path / "server").mkdir()
    server = MlflowServer(tmp_path / "server", port=free_port())
    yield server
    server.stop()


def test_a_backlog_logged_before_the_server_answers_is_delivered_with_the_run_opened_behind_it(down_server, tmp_path):
    """30,000 values logged while the server refuses connections; it comes up; the run opens
    behind them in the journal (its ``opened`` entry after 300 records of 100 values). Before:
    0 of 39,000 values arrived, the run stayed RUNNING without its params."""
    from mlflow import MlflowClient

    experiment = unique("backlog")
    code = SERVER_COMES_UP.format(uri=down_server.uri, experiment=experiment, width=WIDTH, before=300, after=90)
    spool = {"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}
    process = popen_script(textwrap.dedent(code), env=spool, stdin=subprocess.PIPE)
    try:
        _line(process, "logged")
        down_server.start()
        process.stdin.write("up\n")
        process.stdin.flush()
        opened = _line(process, "opened")
        assert opened.split()[1] != "None", "the run did not open once the server answered"
        _line(process, "closed")
        assert process.wait(timeout=60) == 0
        stderr = process.stderr.read()
    finally:
        process.kill()
    assert "Traceback" not in stderr
    client = MlflowClient(down_server.uri)
    run = _the_run(client, experiment)
    assert run.info.status == "FINISHED"
    assert run.data.params.get("lr") == "0.25"
    _assert_every_value_once(client, run, 390)
