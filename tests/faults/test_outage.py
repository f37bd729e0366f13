"""A tracking server that dies (SIGKILL) mid-run: windows wait in the queue, then in the on-disk
spool, and reach the run in order once the server is back on the same port and database. Closed
while the server is still down, the exporter leaves the spool and names the command that delivers it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from faultkit import NODE, assert_every_window, create_run

import otel_forge
from testkit.hermetic import hermetic_environ
from testkit.servers import free_port, wait_for

INTERVAL_S = 0.2
QUEUE_SIZE = 4
CALL_DEADLINE_S = 1.0
STOP_WAIT_S = 60.0  # how long the test waits for close before it fails: a wait, not a measure


def _monitor(run_id: str, uri: str, tmp_path: Path, drain_deadline_s: float):  # type: ignore[no-untyped-def]
    return otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        tracking_uri=uri,
        sampling_interval=INTERVAL_S,
        samples_per_window=1,
        prometheus=False,
        node_id=NODE,
        collectors=["cpu", "memory"],
        queue_size=QUEUE_SIZE,
        call_deadline_s=CALL_DEADLINE_S,
        drain_deadline_s=drain_deadline_s,
        spool_dir=str(tmp_path / "spool"),
    )


def _spooled_windows(path: Path) -> list[Path]:
    return sorted(path.glob("*.window.json")) if path.is_dir() else []


def _otel_forge() -> list[str]:
    script = shutil.which("otel-forge", path=str(Path(sys.executable).parent)) or shutil.which("otel-forge")
    return [script] if script else [sys.executable, "-m", "otel_forge.cli"]


def test_killed_server_comes_back_and_every_window_arrives_in_order(server, tmp_path, exports) -> None:
    run_id = create_run(server.uri)
    agent = _monitor(run_id, server.uri, tmp_path, drain_deadline_s=15.0)
    exporter = agent.exporter
    stats = exporter.worker.stats
    try:
        wait_for(lambda: stats.delivered >= 3, 15, 0.05, message="the first windows to arrive")

        server.kill()
        # The outage lasts as long as a restart on the same port and database takes (6 s or more).
        restart = threading.Thread(target=server.start, name="test-server-restart")
        restart.start()
        # Exporting goes on past the queue's 4 windows: the rest is written to the spool.
        wait_for(
            lambda: len(_spooled_windows(exporter.spool.path)) >= 3,
            QUEUE_SIZE * INTERVAL_S + 5,
            0.05,
            message="windows in the spool during the outage",
        )
        assert not server.healthy(), "the server came back too early to test an outage"
        files_during_outage = len(_spooled_windows(exporter.spool.path))
        spooled_during_outage = stats.spooled
        header = json.loads((exporter.spool.path / "spool.json").read_text())
        delivered_before = stats.delivered

        restart.join(120)
        assert server.healthy(), "the server did not restart"
        wait_for(
            lambda: exporter.worker.pending() == 0 and stats.delivered >= exports.windows,
            45,
            0.05,
            message="the queue and the spool to be delivered after the restart",
        )
    finally:
        agent.stop()

    print(
        f"\noutage: {exports.windows} windows, {delivered_before} delivered before the kill, "
        f"{files_during_outage} spool files seen, {stats.spooled} spooled, {stats.retried} retries"
    )
    assert spooled_during_outage > 0
    assert stats.retried > 0
    assert stats.dropped == 0
    assert header["run_id"] == run_id and header["first_step"] == 0, header
    # A delivery per window, and one more when the close sends what the last window held back
    # (at that window's step: every chart ends at the last step).
    assert stats.delivered - exports.windows in (0, 1), (stats.delivered, exports.windows)
    assert_every_window(server.uri, run_id, exports.windows)
    assert not exporter.spool.path.exists(), "the spool directory should be removed once delivered"


def test_closed_while_down_leaves_a_spool_that_replay_delivers(server, tmp_path, exports, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge")
    run_id = create_run(server.uri)
    agent = _monitor(run_id, server.uri, tmp_path, drain_deadline_s=1.0)
    exporter = agent.exporter
    stats = exporter.worker.stats
    try:
        wait_for(lambda: stats.delivered >= 3, 15, 0.05, message="the first windows to arrive")
        server.kill()
        wait_for(lambda: stats.spooled >= 2, QUEUE_SIZE * INTERVAL_S + 10, 0.05, message="windows in the spool")
    finally:
        stopped_at = time.monotonic()
        # On a thread: a close that waited for the dead server would never return.
        stopper = threading.Thread(target=agent.stop, name="test-stop", daemon=True)
        stopper.start()
        stopper.join(STOP_WAIT_S)
        stop_s = time.monotonic() - stopped_at

    # The server is still down: close gave up on it (its drain deadline is 1 s) instead of waiting.
    assert not stopper.is_alive(), "close kept waiting for a server that is down"
    spool = exporter.spool.path
    left = _spooled_windows(spool)
    delivered = stats.delivered
    print(
        f"\nclosed while down: {exports.windows} windows, {delivered} delivered, {len(left)} left in {spool}, "
        f"stop took {stop_s:.2f} s"
    )
    assert spool.is_dir()
    # Every window not delivered, and what the close sent of the last one's held-back values.
    assert len(left) - (exports.windows - delivered) in (0, 1), (len(left), exports.windows, delivered)
    assert json.loads((spool / "spool.json").read_text())["first_step"] == 0
    warnings = [r.getMessage() for r in caplog.records if "otel-forge replay" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert f"otel-forge replay {spool}" in warnings[0]
    assert re.match(rf"{len(left)} system-metrics window\(s\)", warnings[0]), warnings[0]

    server.start()
    result = subprocess.run(
        [*_otel_forge(), "replay", str(spool)],
        capture_output=True,
        text=True,
        timeout=60,
        env=hermetic_environ(),
        stdin=subprocess.DEVNULL,
    )
    print(result.stdout, result.stderr)
    assert result.returncode == 0, (result.stdout, result.stderr)
    assert f"delivered {len(left)} window(s) to run {run_id}" in result.stdout
    assert "Traceback" not in result.stderr
    # Delivered before the kill, then replayed: steps 0..N-1, the replayed ones continuing the node's steps.
    assert_every_window(server.uri, run_id, exports.windows)
    assert not spool.exists(), "replay should remove the spool once it is delivered"


def test_replay_of_a_missing_path_is_one_line_and_exit_2(tmp_path) -> None:
    result = subprocess.run(
        [*_otel_forge(), "replay", str(tmp_path / "nonexistent")],
        capture_output=True,
        text=True,
        timeout=60,
        env=hermetic_environ(),
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("otel-forge") and "nonexistent" in lines[0], lines[0]
    assert result.stdout == ""


def test_spool_left_at_close_keeps_window_order(tmp_path, exports) -> None:
    """No server at all (a refused port): every window is written to the spool as it is made (write-
    ahead), and close leaves them there in window order, the order ``otel-forge replay`` delivers in.
    (Regression: windows that waited in memory used to be appended after newer ones.)"""
    agent = _monitor("0" * 32, f"http://127.0.0.1:{free_port()}", tmp_path, drain_deadline_s=0.3)
    exporter = agent.exporter
    try:
        wait_for(lambda: exporter.worker.stats.spooled >= QUEUE_SIZE + 3, 10, 0.05, message="windows in the spool")
    finally:
        agent.stop()
    indices = [json.loads(f.read_text())["index"] for f in _spooled_windows(exporter.spool.path)]
    assert len(indices) >= QUEUE_SIZE + 3
    # Nothing was delivered: every window is in the spool, once, oldest first.
    # (The last window's held-back values, sent by the close, follow it at its index.)
    assert indices in (list(range(exports.windows)), [*range(exports.windows), exports.windows - 1]), (
        f"spool (replay) order of window indices: {indices}"
    )
