"""The first hour, as a new user meets it: ``/metrics`` answers while the run is still opening, a
fresh local store's creation is not taken for a slow server, and a server that does not answer is one
line naming where everything is kept."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from testkit.hermetic import hermetic_environ
from testkit.servers import free_port, wait_for

OWN_LINE = re.compile(r"otel-forge: (run [0-9a-f]{32} in experiment \S+ at \S+|serving \S.*)$")
CMD = (
    "import os, time; print('cmd started', os.environ.get('MLFLOW_RUN_ID'), os.path.exists('mlflow.db'), flush=True);"
    " time.sleep(1)"
)


def _scrape(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            return str(response.read().decode())
    except OSError:
        return None


def _forge(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "otel_forge.cli", "run", *args, "--", sys.executable, "-c", CMD],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_metrics_are_served_while_the_run_is_still_opening(pausable_server, tmp_path) -> None:
    port = free_port()
    env = hermetic_environ({"OTEL_FORGE_START_WAIT": "30"}, prefixes=("OTEL_", "MLFLOW_"))
    pausable_server.pause()  # the open hangs: CMD waits out the start wait
    try:
        forge = _forge(
            ["--tracking-uri", pausable_server.uri, "--prometheus-port", str(port), "--interval", "0.3"], tmp_path, env
        )
        try:
            body = wait_for(lambda: _scrape(port), 60, 0.1, "/metrics")
            assert forge.poll() is None
            assert "system_cpu_utilization" in body and "system_memory_usage" in body
            # CMD has not started: no process tree is read yet (never otel-forge's own process).
            assert "process_cpu_time" not in body
        finally:
            pausable_server.resume()
        out, err = forge.communicate(timeout=120)
    finally:
        pausable_server.resume()
    assert forge.returncode == 0, err
    assert "cmd started" in out


@pytest.mark.parametrize("experiment", [None, "first-run"], ids=["script-names-it", "given"])
def test_a_fresh_local_store_opens_before_the_command_without_a_warning(tmp_path, experiment) -> None:
    # A start wait far shorter than creating a store's tables: the wait is the server's, not the store's.
    env = hermetic_environ({"OTEL_FORGE_START_WAIT": "0.2"}, prefixes=("OTEL_", "MLFLOW_"))
    forge = _forge(["--no-prometheus", *(["--experiment", experiment] if experiment else [])], tmp_path, env)
    out, err = forge.communicate(timeout=180)

    assert forge.returncode == 0, err
    # Nothing on stderr but otel-forge run's own lines (the run, once open, and what it serves).
    assert [line for line in err.splitlines() if not OWN_LINE.match(line)] == [], err
    (started,) = [line for line in out.splitlines() if line.startswith("cmd started")]
    assert started.endswith(" True"), out  # the store was made before CMD started
    # Given an experiment, CMD is handed the open run; else its first run is the job's (none here).
    assert (started == "cmd started None True") == (experiment is None), out


def test_an_unreachable_server_is_one_line_at_the_start_one_at_the_end_and_the_job_runs(tmp_path) -> None:
    down = f"http://127.0.0.1:{free_port()}"
    spool = tmp_path / "spool"
    env = hermetic_environ({"OTEL_FORGE_SPOOL_DIR": str(spool)}, prefixes=("OTEL_", "MLFLOW_"))
    lines: list[str] = []
    forge = _forge(["--tracking-uri", down, "--no-prometheus"], tmp_path, env)
    reader = threading.Thread(target=lambda: lines.extend(forge.stderr or ()), daemon=True)
    reader.start()
    out = forge.stdout.read() if forge.stdout else ""
    forge.wait(timeout=120)
    reader.join(10)

    assert forge.returncode == 0, lines
    assert "cmd started None" in out  # CMD ran, with no run to attach to yet
    (job_dir,) = spool.iterdir()
    assert lines[0] == (
        f"otel-forge: MLflow at {down} does not answer: connection refused; {sys.executable} -c runs, "
        f"everything is kept in {job_dir}, otel-forge replay {job_dir} delivers it\n"
    )
    # The job's last line: nothing was delivered, what waits where, and the command (issue 34).
    assert len(lines) == 2 and lines[1].startswith(f"otel-forge: nothing reached MLflow at {down}: "), lines
    assert lines[1].endswith(f"are kept in {job_dir}; otel-forge replay {job_dir} delivers them\n"), lines
