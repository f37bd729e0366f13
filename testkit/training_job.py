"""A training script run as a user runs it, for the fault tests and benches that kill it: a child Python
in a process group of its own (its companion, started with the group it is in, joins it), its stdout
and stderr in files, never in pipes. A killed job's companion lives on, delivering, and would hold a
pipe open (and a test reading it) for as long; a file it can write to for ever.

``TrainingJob`` is a context manager: on the way out it SIGKILLs its process group, and only it: the
training process, its companions, whatever they started. ``otel_forge_command`` runs the
``otel-forge`` command the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from testkit.hermetic import hermetic_environ
from testkit.servers import REPO_ROOT


def job_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A hermetic environment that imports this checkout's otel_forge."""
    environ = hermetic_environ(extra)
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environ.get("PYTHONPATH")]))
    return environ


class TrainingJob:
    """``code`` run by ``python -u -c`` in ``directory`` (``stdout``, ``stderr`` there), in a session of
    its own: its pid is its process group."""

    def __init__(self, code: str, directory: Path, env: Mapping[str, str] | None = None) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.code = code
        self.env = job_environ(env)
        self.stdout_path = directory / "stdout"
        self.stderr_path = directory / "stderr"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> TrainingJob:
        with open(self.stdout_path, "wb") as stdout, open(self.stderr_path, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-u", "-c", self.code], stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr,
                env=self.env, cwd=REPO_ROOT, start_new_session=True,
            )  # fmt: skip
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None, "not started"
        return self.process.pid

    def lines(self) -> list[str]:
        """The complete lines the script has printed so far."""
        text = self.stdout_path.read_text(errors="replace")
        return text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_line(self, starts: str, timeout_s: float = 120.0) -> str:
        """The first line the script printed that starts with ``starts``, waited for."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = next((line for line in self.lines() if line.startswith(starts)), None)
            if found is not None:
                return found
            if time.monotonic() >= deadline or (self.process is not None and self.process.poll() is not None):
                found = next((line for line in self.lines() if line.startswith(starts)), None)
                if found is not None:
                    return found
                raise AssertionError(f"no line {starts!r} from the job; stderr: {self.stderr()[-3000:]}")
            time.sleep(0.05)

    def wait(self, timeout_s: float = 120.0) -> int:
        assert self.process is not None, "not started"
        return self.process.wait(timeout=timeout_s)

    def companions(self) -> list[int]:
        """The pids of the training process's companion processes alive now."""
        import psutil

        found = []
        with contextlib.suppress(psutil.NoSuchProcess):
            for child in psutil.Process(self.pid).children():
                with contextlib.suppress(psutil.Error):
                    if "otel_forge.cli.companion" in child.cmdline():
                        found.append(child.pid)
        return found

    def kill_group(self) -> None:
        """SIGKILL the job's process group (the training process, its companions); reap the script."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)

    def group_alive(self) -> bool:
        """Whether any process of the job's group is still alive (a companion delivering, say)."""
        if self.process is None:
            return False
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        # A zombie script (not reaped yet) still counts in its group: reap it, and ask again.
        if self.process.poll() is not None:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return False
        return True

    def __enter__(self) -> TrainingJob:
        return self.start() if self.process is None else self

    def __exit__(self, *exc_info: object) -> None:
        self.kill_group()


def otel_forge_command(
    args: list[str], directory: Path, env: Mapping[str, str] | None = None, timeout_s: float = 180.0
) -> tuple[int, str]:
    """``otel-forge ARGS`` as a user runs it, in a session of its own, its output (stdout then
    stderr) in files in ``directory``: its exit code and that output. Killed with its group when it
    outlives ``timeout_s`` (exit code -9)."""
    directory.mkdir(parents=True, exist_ok=True)
    out_path, err_path = directory / "stdout", directory / "stderr"
    command = [str(Path(sys.executable).with_name("otel-forge")), *args]
    with open(out_path, "wb") as stdout, open(err_path, "wb") as stderr:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=job_environ(env),
            cwd=REPO_ROOT, start_new_session=True,
        )  # fmt: skip
    try:
        code = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        code = process.wait()
    return code, out_path.read_text(errors="replace") + err_path.read_text(errors="replace")
