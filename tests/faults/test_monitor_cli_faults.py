"""``otel-forge monitor --run-id`` as a process while its tracking server hangs (SIGSTOP) for 2 s in
the middle of a 4 s run: it ends by itself (``--duration``) with exit 0, and every window it sampled
is in the run, those it sampled during the hang included."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from faultkit import anchor_key, assert_every_window, create_run, system_histories

from testkit.hermetic import hermetic_environ

INTERVAL_S = 0.2
DURATION_S = 4.0
DRAIN_DEADLINE_S = 5.0
HANG_S = 2.0
# How long the test waits for the exit before it fails: a wait, not a measure (it exits ~4.5 s after
# "serving": the duration, the last export and the close; run with -s to see it).
EXIT_WAIT_S = 60.0


def test_monitor_exits_on_time_and_delivers_every_window_despite_a_hang(pausable_server, tmp_path: Path) -> None:
    server = pausable_server
    run_id = create_run(server.uri)
    spool_root = tmp_path / "spool"
    env = hermetic_environ(
        OTEL_FORGE_DRAIN_DEADLINE=str(DRAIN_DEADLINE_S),
        OTEL_FORGE_CALL_DEADLINE="1",
        OTEL_FORGE_SPOOL_DIR=str(spool_root),
    )
    command = [
        sys.executable,
        "-m",
        "otel_forge.cli",
        "monitor",
        "--run-id",
        run_id,
        "--tracking-uri",
        server.uri,
        "--interval",
        str(INTERVAL_S),
        "--no-prometheus",
        "--duration",
        str(DURATION_S),
        "--collectors",
        "cpu,memory",
        "--node-id",
        "node_0",
    ]
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    stderr_lines: list[str] = []
    stderr_reader = threading.Thread(target=lambda: stderr_lines.extend(process.stderr), daemon=True)
    stderr_reader.start()
    try:
        serving_line = process.stdout.readline()  # "otel-forge: serving mlflow run ..." once the agent runs
        serving_at = time.monotonic()
        assert "serving mlflow run" in serving_line, (serving_line, process.stdout.read(), "".join(stderr_lines))

        time.sleep(1.0)
        server.pause()
        paused_at = time.time()
        try:
            time.sleep(HANG_S)
        finally:
            resumed_at = time.time()
            server.resume()

        code = process.wait(timeout=EXIT_WAIT_S)  # --duration ends it: no signal
        exited_at = time.monotonic()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr_reader.join(5)
    stdout = process.stdout.read()
    stderr = "".join(stderr_lines)
    run_s = exited_at - serving_at
    print(
        f"\nmonitor: started in {serving_at - started:.2f} s, ran {run_s:.2f} s after serving "
        f"(duration {DURATION_S:g} + drain deadline {DRAIN_DEADLINE_S:g}), exit {code}\n{stderr}"
    )

    assert code == 0, (stdout, stderr)
    assert "Traceback" not in stderr
    assert "not delivered" not in stderr and "dropped" not in stderr, stderr
    # Nothing left behind: no spooled window survives the exit.
    assert not list(spool_root.glob("*/*.window.json")), sorted(spool_root.rglob("*"))

    # Every window the process sampled is in the run: steps 0..N-1, N at most one per interval of the
    # duration plus the last export at shutdown (20 + 1 here; fewer when a loaded machine delays ticks).
    histories = system_histories(server.uri, run_id)
    anchor = histories[anchor_key(histories)]
    windows = len(anchor)
    during_hang = [m.step for m in anchor if paused_at * 1000 <= m.timestamp <= resumed_at * 1000]
    print(f"{windows} windows in the run, {len(during_hang)} of them sampled during the hang")
    assert windows <= DURATION_S / INTERVAL_S + 2, windows
    # The hang did not stop the sampling, and what was sampled during it was delivered after it.
    assert during_hang, [m.timestamp for m in anchor]
    assert_every_window(server.uri, run_id, windows)
