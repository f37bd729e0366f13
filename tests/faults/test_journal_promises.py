"""The journal's promises where users' jobs broke them (issue 41's table), each against a real
``mlflow server`` and a real training process: no exception reaches the script, every value whose
``log()`` reported no drop is in the run once, the run ends with the status the job earned, and
what the user is told is true."""

from __future__ import annotations

import select
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from faultkit import WIDTH, steps_logged, the_run
from trun_helpers import popen_script, unique

from testkit.mlflow_server import MlflowServer
from testkit.servers import free_port, wait_for

pytestmark = pytest.mark.slow


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


def _read_until(process: subprocess.Popen, starts: str, timeout_s: float = 120.0) -> list[str]:
    """The lines the process prints up to the first that starts with ``starts`` (the last)."""
    deadline, lines = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and (line := process.stdout.readline()):
        lines.append(line.strip())
        if line.startswith(starts):
            return lines
    raise AssertionError(f"no line {starts!r}; stderr: {process.stderr.read()[-2000:] if process.poll() else ''}")


def _line(process: subprocess.Popen, starts: str, timeout_s: float = 120.0) -> str:
    return _read_until(process, starts, timeout_s)[-1]


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
    behind them in the journal (its ``opened`` entry after 300 records of 100 values). The close's
    drain deadline (0.1 s here) is too short for the backlog: the companion goes on delivering after
    the process exits, and says so. Before: 0 of 39,000 values arrived, the run stayed RUNNING
    without its params; then, past the deadline (10 s: 39,000 values on a busy CI machine), the
    companion left the rest for a replay and the run RUNNING."""
    from mlflow import MlflowClient

    experiment = unique("backlog")
    code = SERVER_COMES_UP.format(uri=down_server.uri, experiment=experiment, width=WIDTH, before=300, after=90)
    spool = {"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"), "OTEL_FORGE_DRAIN_DEADLINE": "0.1"}
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
    assert "are still being delivered" in stderr and "goes on after this process exits" in stderr, stderr[-2000:]
    client = MlflowClient(down_server.uri)
    run = the_run(client, experiment, said=stderr)
    assert run.info.status == "FINISHED"
    assert run.data.params.get("lr") == "0.25"
    _assert_every_value_once(client, run, 390)


# Logs STEPS steps of WIDTH values at RATE steps a second inside the block, printing each step once
# logged (and "dropped N" once log() has dropped values), with a hook run at step HOOK_AT.
LOOP = """
import sys, time
from otel_forge import ForgeConfig, TrainingRun
values = lambda step: {{f"v{{i}}": step + i / 1000 for i in range({width})}}
with TrainingRun(config={{"lr": 0.25}}, tracking_uri={uri!r}, experiment={experiment!r},
                 system_metrics=False) as run:
    for step in range({steps}):
        if step == {hook_at}:
            print("hook", flush=True)
            sys.stdin.readline()
        run.log(values(step), step=step)
        print("step", step, run.rejected, flush=True)
        time.sleep(1 / {rate})
print("exited", run.rejected, flush=True)
"""


def _loop(uri: str, experiment: str, spool: Path, *, steps: int, rate: float, hook_at: int = -1) -> subprocess.Popen:
    code = LOOP.format(uri=uri, experiment=experiment, width=WIDTH, steps=steps, rate=rate, hook_at=hook_at)
    return popen_script(textwrap.dedent(code), env={"OTEL_FORGE_SPOOL_DIR": str(spool)}, stdin=subprocess.PIPE)


def _assert_kept_arrived_and_drops_counted(client, experiment: str, lines: list[str], stderr: str) -> int:
    """Every step whose log() dropped nothing is in the run, once, and no other; every drop is
    counted, on stderr and in the run's tag; the run ended FINISHED. The count dropped."""
    logged = steps_logged(lines)
    dropped = int(lines[-1].split()[1])
    kept = [step for step, so_far in logged.items() if so_far == logged.get(step - 1, 0)]
    assert 0 < dropped == WIDTH * (len(logged) - len(kept)), "every drop is counted, a call's values together"
    assert f"{dropped} metric value(s) were dropped in all: {dropped} lost" in stderr
    run = the_run(client, experiment, said=stderr)
    assert run.info.status == "FINISHED"
    assert run.data.tags["otel_forge.log.rejected"] == str(dropped)
    for key in ("v0", f"v{WIDTH - 1}"):
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, key)) == kept
    return dropped


@pytest.fixture
def small_spool(tmp_path):
    from testkit.small_disk import can_mount, small_disk

    if not can_mount():
        pytest.skip("mounting a small tmpfs needs root")
    with small_disk(tmp_path / "spool", size="1m") as disk:
        yield disk


def test_a_spool_disk_that_fills_and_frees_raises_nothing_and_every_kept_value_arrives(
    small_spool, mlflow_server, client
):
    """The spool's 1 MiB disk fills while the loop logs, then space is freed: nothing reaches the
    script, every value whose log() reported no drop is in the run once, the drops are counted
    exactly (stderr and the run's tag), and the run ends FINISHED. Before: an OSError out of the
    ``with`` at close, 1,800 kept values lost at the hole the failed write left."""
    from testkit.small_disk import fill

    experiment = unique("fulldisk")
    process = _loop(mlflow_server.uri, experiment, small_spool, steps=120, rate=50, hook_at=40)
    try:
        lines = _read_until(process, "hook")
        filler = fill(small_spool)
        process.stdin.write("go\n")
        process.stdin.flush()
        lines += _read_until(process, "step 80 ")
        filler.unlink()
        rest, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    _assert_kept_arrived_and_drops_counted(client, experiment, lines + rest.splitlines(), stderr)


def test_a_spool_disk_full_for_the_rest_of_the_job_raises_nothing_and_the_run_ends_finished(
    small_spool, mlflow_server, client
):
    """The disk stays full to the end: the run's end cannot be journaled, and reaches the run anyway
    (handed to the companion); the drop count is exact. Before: OSError [Errno 28] out of the
    ``with`` at close."""
    from testkit.small_disk import fill

    experiment = unique("fullend")
    process = _loop(mlflow_server.uri, experiment, small_spool, steps=60, rate=50, hook_at=20)
    try:
        lines = _read_until(process, "hook")
        fill(small_spool)
        process.stdin.write("go\n")
        process.stdin.flush()
        out, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    dropped = _assert_kept_arrived_and_drops_counted(client, experiment, lines + out.splitlines(), stderr)
    assert dropped >= 35 * WIDTH  # a few more fit in the journal's last page, no more


def test_a_companion_killed_mid_job_is_replaced_and_the_run_fills_during_the_job(tmp_path, mlflow_server, client):
    """SIGKILL to the companion that delivers the journal: nothing reaches the script, a new
    companion delivers on during the job, and the run ends FINISHED with every value once. Before:
    BrokenPipeError out of the ``with``, exit 1, 120 of 2,140 values in the run."""
    import psutil

    experiment = unique("companion")
    process = _loop(mlflow_server.uri, experiment, tmp_path / "spool", steps=400, rate=40, hook_at=40)
    try:
        _line(process, "hook")
        companions = [
            child for child in psutil.Process(process.pid).children() if "companion" in " ".join(child.cmdline())
        ]
        assert len(companions) == 1
        companions[0].kill()
        companions[0].wait(10)
        process.stdin.write("go\n")
        process.stdin.flush()
        run = wait_for(lambda: _run_with_steps(client, experiment, 200), 60, 0.5, message="values during the job")
        assert process.poll() is None, "the values arrived during the job"
        out, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert "companion" in stderr and "a new one delivers" in stderr
    run = the_run(client, experiment, said=stderr)
    assert run.info.status == "FINISHED"
    _assert_every_value_once(client, run, 400)


def _run_with_steps(client, experiment: str, steps: int):
    exp = client.get_experiment_by_name(experiment)
    runs = client.search_runs([exp.experiment_id]) if exp else []
    if len(runs) != 1:
        return None
    return runs[0] if len(client.get_metric_history(runs[0].info.run_id, "v0")) >= steps else None


# Logs STEPS steps of WIDTH values while the server refuses connections, then waits to be killed.
UNOPENED = """
import time
from otel_forge import TrainingRun
run = TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, system_metrics=False)
run.__enter__()
for step in range({steps}):
    run.log({{f"v{{i}}": step + i / 1000 for i in range({width})}}, step=step)
print("logged", flush=True)
time.sleep(600)
"""


def _replay_on_a_terminal(spool: Path, interrupt_at: str | None = None) -> tuple[int, str]:
    """``otel-forge replay --all`` with its stderr on a pseudo-terminal: its exit code and what it showed
    there (SIGINT, as Ctrl-C, as soon as it shows ``interrupt_at``)."""
    import os
    import pty
    import signal

    from testkit.hermetic import hermetic_environ

    main, secondary = pty.openpty()
    environ = {**hermetic_environ(), "OTEL_FORGE_SPOOL_DIR": str(spool)}
    replay = subprocess.Popen(
        [str(Path(sys.executable).with_name("otel-forge")), "replay", "--all"],
        stdout=subprocess.PIPE, stderr=secondary, env=environ, text=True,
        # Ctrl-C as on a terminal, though the test runs where SIGINT is ignored (a background job).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509
    )  # fmt: skip
    os.close(secondary)
    shown = b""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if interrupt_at and interrupt_at.encode() in shown and replay.poll() is None:
            replay.send_signal(signal.SIGINT)
            interrupt_at = None
        try:
            chunk = os.read(main, 65536) if select.select([main], [], [], 0.1)[0] else b""
        except OSError:  # the terminal's other side closed: the replay exited
            break
        shown += chunk
        if not chunk and replay.poll() is not None:
            break
    os.close(main)
    out = replay.communicate(timeout=30)[0]
    return replay.returncode, shown.decode(errors="replace") + out


def test_a_journal_whose_run_never_opened_is_given_up_in_patience_then_replayed_whole_with_progress(
    down_server, tmp_path
):
    """60,000 values, the server refusing, the training process SIGKILLed: its orphaned companion
    gives up within OTEL_FORGE_DELIVERY_PATIENCE (the lock released), and `otel-forge replay --all`
    once the server is up shows its progress on the terminal, is interrupted, goes on where it
    stopped, and delivers every value into one run ended KILLED. Before: replay hung for ever with no
    output, 0 delivered; the companion held the lock past its patience."""
    import psutil
    from mlflow import MlflowClient

    experiment, spool = unique("unopened"), tmp_path / "spool"
    code = UNOPENED.format(uri=down_server.uri, experiment=experiment, steps=600, width=WIDTH)
    environ = {"OTEL_FORGE_SPOOL_DIR": str(spool), "OTEL_FORGE_DELIVERY_PATIENCE": "3"}
    process = popen_script(textwrap.dedent(code), env=environ)
    try:
        _line(process, "logged")
        companion = [child for child in psutil.Process(process.pid).children() if "companion" in child.cmdline()[2]]
        process.kill()
        process.wait(10)
    finally:
        process.kill()
    gone_by = time.monotonic() + 60
    psutil.wait_procs(companion, timeout=60)
    assert time.monotonic() < gone_by and not any(c.is_running() for c in companion), (
        "the companion outlived its patience"
    )
    down_server.start()
    code, shown = _replay_on_a_terminal(spool, interrupt_at=" left")  # at its first progress line
    assert code == 130 and "goes on from there" in shown, shown[-2000:]
    assert "metric value(s) delivered (" in shown and "/s), " in shown and " left" in shown
    assert "Traceback" not in shown
    code, shown = _replay_on_a_terminal(spool)
    assert code == 0, shown[-2000:]
    client = MlflowClient(down_server.uri)
    run = the_run(client, experiment, said=shown)
    assert run.info.status == "KILLED"
    assert "and ended it KILLED" in shown
    _assert_every_value_once(client, run, 600)


LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"

# Enters the block through a proxy, logs 1 step a PERIOD for STEPS steps, leaves.
THROUGH_PROXY = """
import time
from otel_forge import TrainingRun
with TrainingRun(tracking_uri={uri!r}, experiment={experiment!r}, system_metrics=False) as run:
    print("entered", run.run_id, flush=True)
    for step in range({steps}):
        run.log({{"loss": 1 / (step + 1)}}, step=step)
        time.sleep({period})
"""


@pytest.mark.parametrize("status", [429, 503])
def test_a_server_that_asks_to_wait_with_retry_after_is_left_alone_that_long_and_named(
    status, mlflow_server, client, tmp_path
):
    """A gateway answers every call ``status`` with ``Retry-After: 5`` for 12 s: the delivery sends
    at most one call per Retry-After, the line it prints names the status and the pause, no
    urllib3 text reaches the user, and every value arrives. Before: 12-13 calls in 20 s, "HTTP 500"."""
    from testkit.proxy import MlflowProxy

    experiment = unique(f"wait{status}")
    with MlflowProxy(mlflow_server.uri, retry_after_s=5) as proxy:
        code = THROUGH_PROXY.format(uri=proxy.uri, experiment=experiment, steps=80, period=0.2)
        process = popen_script(textwrap.dedent(code), env={"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")})
        try:
            _line(process, "entered")
            time.sleep(1.0)
            began = time.time()
            proxy.set_mode(str(status))
            time.sleep(12.0)
            proxy.set_mode("pass")
            ended = time.time()
            _, stderr = process.communicate(timeout=120)
        finally:
            process.kill()
        refused_calls = [at for at, _ in proxy.arrivals(LOG_BATCH) if began <= at < ended]
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    assert 1 <= len(refused_calls) <= 4, f"{len(refused_calls)} log-batch calls while the server asked for 5 s"
    assert f"HTTP {status}, Retry-After 5 s" in stderr, stderr[-2000:]
    assert "urllib3" not in stderr and "Retrying (" not in stderr and "HTTP 500" not in stderr
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(80))


DEADLINE_S = 60.0
SHORT_JOB = """
import time
from otel_forge import TrainingRun
began = time.monotonic()
with TrainingRun(tracking_uri={uri!r}, experiment="refused", system_metrics=False) as run:
    print("entered", round(time.monotonic() - began, 2), flush=True)
    run.log({{"loss": 0.5}}, step=0)
    time.sleep(2)
    closing = time.monotonic()
print("closed", round(time.monotonic() - closing, 2), flush=True)
"""


def test_a_server_that_refuses_connections_costs_the_job_no_more_than_a_moment(tmp_path):
    """Nothing listens on the tracking server's port: the block is entered and left at once (the
    values are kept for a replay), in code and under `otel-forge run`, however long the start wait
    and the drain deadline are (60 s each here). Before: the start wait to enter (15 s by default),
    and a 5 s job under `otel-forge run` exited 14 s late. Each takes ~0.1 s on a quiet machine
    (bench figures in docs/reliability.md); a bound of half a deadline says none was waited for."""
    uri = f"http://127.0.0.1:{free_port()}"
    environ = {
        "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"),
        "OTEL_FORGE_START_WAIT": str(DEADLINE_S),
        "OTEL_FORGE_DRAIN_DEADLINE": str(DEADLINE_S),
    }
    process = popen_script(textwrap.dedent(SHORT_JOB.format(uri=uri)), env=environ)
    out, stderr = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in stderr, stderr[-2000:]
    entered_s = float(out.split("entered ")[1].split()[0])
    closed_s = float(out.split("closed ")[1].split()[0])
    assert entered_s < DEADLINE_S / 2 and closed_s < DEADLINE_S / 2, out
    assert "connection refused" in stderr and "otel-forge replay" in stderr

    from testkit.hermetic import hermetic_environ

    command = [str(Path(sys.executable).with_name("otel-forge")), "run", "--tracking-uri", uri, "--"]
    began = time.monotonic()
    wrapped = subprocess.run(
        [*command, sys.executable, "-c", "import time; time.sleep(2)"],
        capture_output=True, text=True, timeout=120, env=hermetic_environ(environ),
    )  # fmt: skip
    late_s = time.monotonic() - began - 2.0
    assert wrapped.returncode == 0, wrapped.stderr[-2000:]
    assert late_s < DEADLINE_S / 2, f"otel-forge run exited {late_s:.1f} s after its command"
