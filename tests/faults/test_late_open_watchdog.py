"""A run that opens after ``otel-forge run`` stopped waiting for it (the server hung at the job's
start) is not left RUNNING when otel-forge dies: its watchdog starts once the run opens, and ends it
KILLED. Real ``mlflow server`` paused with SIGSTOP, then resumed."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid

from faultkit import HTTP_TIMEOUT_S

from testkit.hermetic import hermetic_environ
from testkit.servers import wait_for

RUN_LINE = re.compile(r"^otel-forge: run ([0-9a-f]{32}) ", re.MULTILINE)


def test_a_run_that_opens_late_is_ended_killed_by_its_watchdog(pausable_server, tmp_path) -> None:
    from mlflow import MlflowClient

    err, pid_file = tmp_path / "stderr.txt", tmp_path / "cmd.pid"  # otel-forge run's own lines: on its stderr
    env = hermetic_environ(
        {
            "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"),
            "OTEL_FORGE_START_WAIT": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(HTTP_TIMEOUT_S),
        },
        prefixes=("OTEL_", "MLFLOW_"),
    )
    cmd = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write('x'); time.sleep(300)"]
    options = ["--tracking-uri", pausable_server.uri, "--experiment", f"late-{uuid.uuid4().hex[:8]}"]
    pausable_server.pause()
    with open(err, "w") as stderr:
        forge = subprocess.Popen(
            [sys.executable, "-m", "otel_forge.cli", "run", *options, "--no-prometheus", "--", *cmd],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        wait_for(pid_file.exists, 60, 0.05, "CMD to start while the server hangs")
        assert not RUN_LINE.search(err.read_text())  # CMD started before the run opened
        pausable_server.resume()
        run_id = wait_for(lambda: (found := RUN_LINE.search(err.read_text())) and found.group(1), 90, 0.1)
        client = MlflowClient(pausable_server.uri)
        assert client.get_run(run_id).info.status == "RUNNING"

        os.kill(forge.pid, signal.SIGKILL)
        forge.wait(timeout=10)

        wait_for(lambda: client.get_run(run_id).info.status == "KILLED", 60, 0.2, "the watchdog to end the run")
    finally:
        pausable_server.resume()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(forge.pid, signal.SIGKILL)
