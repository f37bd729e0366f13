"""One writer per ``system/<node>/`` prefix of a run on a host.

A second agent for the same node (``otel-forge monitor --run-id`` beside ``otel-forge run``, say)
would write the same steps with other values. Each exporter holds an exclusive ``flock`` on a file
in a host-local directory of the user's own, named after the run and the prefix; the kernel
releases it when its holder exits, however it ends, so an agent restarted after a crash takes its
node back at once.

The directory is ``$XDG_RUNTIME_DIR/otel-forge/writers`` when that is usable, else
``$TMPDIR/otel-forge-<uid>/writers``; each level is created 0700 and checked to be the user's own
and not a symlink (``otel_forge.private_dirs``), and the lock file is opened with ``O_NOFOLLOW``.
On a shared ``/tmp`` another user could otherwise plant the directory or a symlink at the lock
file (and have us truncate its target), or hold the flock and make our node stand down. Where no
private directory can be had, the agent says so in one line and writes without the check.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from otel_forge.mlflow.keys import key_segment
from otel_forge.private_dirs import host_state_location, open_private_file, private_tree, warn_once

_logger = logging.getLogger(__name__)

_LEAF = "writers"


def default_lock_dir() -> Path:
    """Host-local, shared by the user's processes on this host (a home directory may not be)."""
    base, names = host_state_location(_LEAF)
    return base.joinpath(*names)


class NodeWriterLock:
    """An exclusive, non-blocking lock on ``<directory>/<run>-<prefix>.lock``; holds the holder's pid."""

    def __init__(self, run_id: str, prefix: str, directory: Path | None = None) -> None:
        """``directory``: the lock directory (its parent is the base, checked the same way);
        by default ``default_lock_dir()``."""
        base, names = (directory.parent, (directory.name,)) if directory else host_state_location(_LEAF)
        self._base, self._names = base, names
        self.path = base.joinpath(*names) / f"{key_segment(run_id)}-{key_segment(prefix.replace('/', '.'))}.lock"
        self.prefix = prefix
        self._fd: int | None = None

    def acquire(self) -> bool:
        """True when this process writes the prefix: it now holds the lock, or no lock can be held
        safely here (a directory not the user's own, a read-only file system: said once, in a
        warning); False when another agent holds it."""
        try:
            private_tree(self._base, self._names)
            return self._lock()
        except OSError as error:  # NotPrivate among them: never used, whatever the reason
            warn_once(error, f"this agent writes {self.prefix} without the one-writer-per-node check")
            return True

    def _lock(self) -> bool:
        while True:
            fd = open_private_file(self.path, os.O_RDWR)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False
            if self._still_the_file(fd):
                break
            os.close(fd)  # its holder removed it between our open and our lock: take the new one
        os.ftruncate(fd, 0)  # our own regular file (checked on open), never a symlink's target
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return True

    def _still_the_file(self, fd: int) -> bool:
        try:
            return os.fstat(fd).st_ino == os.lstat(self.path).st_ino
        except FileNotFoundError:
            return False

    def holder(self) -> str:
        """The pid of the process that holds the lock, as it wrote it ("?" if unreadable)."""
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return "?"
        with os.fdopen(fd, "rb") as file:
            return file.read(32).decode(errors="replace").strip() or "?"

    def release(self) -> None:
        if self._fd is None:
            return
        # Removed while still held, so that no one can lock the old file after us.
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
