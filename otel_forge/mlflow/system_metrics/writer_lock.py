"""One writer per ``system/<node>/`` prefix of a run on a host.

A second agent for the same node (``otel-forge monitor --run-id`` beside ``otel-forge run``, say)
would write the same steps with other values. Each exporter holds an exclusive ``flock`` on a file
in the host's temporary directory, named after the run and the prefix; the kernel releases it when
its holder exits, however it ends, so an agent restarted after a crash takes its node back at once.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from otel_forge.mlflow.keys import key_segment


def default_lock_dir() -> Path:
    """Host-local, shared by the user's processes on this host (a home directory may not be)."""
    return Path(tempfile.gettempdir()) / f"otel-forge-{os.getuid()}" / "writers"


class NodeWriterLock:
    """An exclusive, non-blocking lock on ``<directory>/<run>-<prefix>.lock``; holds the holder's pid."""

    def __init__(self, run_id: str, prefix: str, directory: Path | None = None) -> None:
        directory = directory or default_lock_dir()
        self.path = directory / f"{key_segment(run_id)}-{key_segment(prefix.replace('/', '.'))}.lock"
        self._fd: int | None = None

    def acquire(self) -> bool:
        """True when this process is now the writer; False when another one is."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            if self._still_the_file(fd):
                break
            os.close(fd)  # its holder removed it between our open and our lock: take the new one
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return True

    def _still_the_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def holder(self) -> str:
        """The pid of the process that holds the lock, as it wrote it ("?" if unreadable)."""
        try:
            return self.path.read_text().strip() or "?"
        except OSError:
            return "?"

    def release(self) -> None:
        if self._fd is None:
            return
        # Removed while still held, so that no one can lock the old file after us.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
