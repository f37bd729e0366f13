"""``otel-forge run`` killed with SIGKILL: CMD does not outlive it, and the run does not stay
RUNNING (its watchdog ends it KILLED, with the node's outcome tag). Real ``mlflow server``."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import uuid

import psutil

from testkit.hermetic import hermetic_environ
from testkit.servers import wait_for

FORGE_RUN = [sys.executable, "-m", "otel_forge.cli", "run"]
RUN_LINE = re.compile(r"^otel-forge: run ([0-9a-f]{32}) ", re.MULTILINE)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigkill_takes_cmd_along_and_the_run_ends_killed(mlflow_server, client, tmp_path) -> None:
    pid_file, err = tmp_path / "cmd.pid", tmp_path / "stderr.txt"  # otel-forge run's own lines: on its stderr
    cmd = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(300)",
    ]
    env = hermetic_environ({"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}, prefixes=("OTEL_", "MLFLOW_"))
    with open(err, "w") as stderr:
        forge = subprocess.Popen(
            [
                *FORGE_RUN,
                "--tracking-uri",
                mlflow_server.uri,
                "--experiment",
                f"killed-{uuid.uuid4().hex[:8]}",
                "--no-prometheus",
                "--interval",
                "0.3",
                "--",
                *cmd,
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        cmd_pid = int(wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60, 0.05, "CMD to start"))
        run_id = wait_for(lambda: (found := RUN_LINE.search(err.read_text())) and found.group(1), 10, 0.05)
        assert client.get_run(run_id).info.status == "RUNNING"

        os.kill(forge.pid, signal.SIGKILL)  # otel-forge alone, not its group
        forge.wait(timeout=10)

        wait_for(lambda: _gone(cmd_pid), 10, 0.05, "CMD to end with otel-forge")
        wait_for(lambda: client.get_run(run_id).info.status == "KILLED", 60, 0.2, "the watchdog to end the run")
        tags = client.get_run(run_id).data.tags
        assert tags["otel_forge.job.outcome"] == "KILLED"
        assert [v for k, v in tags.items() if k.startswith("otel_forge.outcome.")] == [
            "KILLED (rank None, otel-forge run died)"
        ]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(forge.pid, signal.SIGKILL)


def test_a_normal_end_leaves_no_watchdog_behind(mlflow_server, client, tmp_path) -> None:
    env = hermetic_environ({"OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool")}, prefixes=("OTEL_", "MLFLOW_"))
    result = subprocess.run(
        [*FORGE_RUN, "--tracking-uri", mlflow_server.uri, "--no-prometheus", "--", sys.executable, "-c", "pass"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    run_id = RUN_LINE.search(result.stderr).group(1)  # type: ignore[union-attr]
    assert client.get_run(run_id).info.status == "FINISHED"
    # This run's watchdog is the one that names its run (others may run beside the test: not ours to count).
    assert not [p for p in psutil.process_iter() if {"otel_forge.cli.watchdog", run_id} <= set(_cmdline(p))]


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
