"""Where spools live and how their files are written: a directory per spool under one root,
``spool.json`` its header, each file written whole (temp file + rename) and readable by its owner
only (spools may name hosts and runs). Shared by the system-metrics window spool and the training
spool, which ``otel-forge replay`` and ``doctor`` read.

Spool directories are private (``otel_forge.private_dirs``): each is created 0700 and checked to be
the user's own and not a symlink, under a root that is the user's (or root's), not a symlink, and
not world-writable unless sticky. A spool that fails the check raises ``NotPrivate`` (an
``OSError``) from ``make_spool_dir`` and ``write_atomically``: the spools' existing "cannot write
the spool" line says why, and nothing is written there.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, TypedDict

from otel_forge.config import TOLD_SPOOL_ENV
from otel_forge.private_dirs import check_base, open_private_file, private_dir

if TYPE_CHECKING:
    import psutil

HEADER = "spool.json"
STATS = "stats.json"
DELIVERY_LOCK = "delivery.lock"


class SpoolBusy(RuntimeError):
    """Another process is delivering this spool."""


def default_spool_root() -> Path:
    """In the user's cache, not ``$XDG_RUNTIME_DIR``: a spool must outlive a reboot to be replayed."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "otel-forge" / "spool"


def spool_root(spool_dir: str | None) -> Path:
    """The ``spool_dir`` setting, else the default root."""
    return Path(spool_dir) if spool_dir else default_spool_root()


def told_spool(path: Path) -> None:
    """The user was told that ``path`` keeps what cannot be delivered and how to replay it (this
    process and the commands it starts): closing says at INFO what it keeps there."""
    os.environ[TOLD_SPOOL_ENV] = str(path)


def kept_notice_level(path: Path) -> int:
    """WARNING for the line naming what a close kept in ``path``; INFO once the user was told."""
    told = os.environ.get(TOLD_SPOOL_ENV)
    return logging.INFO if told and Path(told) in (path, *path.parents) else logging.WARNING


def remove_if_empty(path: Path) -> None:
    """Remove a job's spool directory that nothing was kept in (or all was delivered from)."""
    with contextlib.suppress(OSError):
        path.rmdir()


def make_spool_dir(path: Path) -> Path:
    """Create (or check) the spool directory ``path`` and its root ``path.parent``, both private
    enough (see the module's docstring); a missing root is created 0700."""
    root = path.parent
    if not os.path.lexists(root):
        root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made meanwhile by another process: checked next
            os.mkdir(root, 0o700)
    check_base(root)
    return private_dir(path)


def write_atomically(path: Path, text: str) -> None:
    """Write whole or not at all: a crash loses at most the file being written. Only into a private
    spool directory, and never through a symlink planted at the temporary file's name."""
    make_spool_dir(path.parent)
    temporary = path.with_name(path.name + ".tmp")
    fd = open_private_file(temporary, os.O_WRONLY)
    with os.fdopen(fd, "w") as file:
        file.truncate()  # the temporary of a write that crashed may be left longer than this one
        file.write(text)
    os.replace(temporary, path)


class _WriterStart(TypedDict):
    pid: int
    started: float  # psutil's create_time(), in seconds since the epoch


class WriterIdentity(_WriterStart, total=False):
    """The process that writes a spool, as its header names it: a pid is reused, a start time is not."""

    # Seconds from boot to the process's start, where psutil says it (7.1+): the epoch value moves
    # with the system clock (a step makes a live writer look gone), this one never does.
    started_since_boot: float


# Where only the epoch start time can be compared: a clock step of up to this much is not a new process.
_CLOCK_STEP_S = 2.0


def _started(process: psutil.Process) -> tuple[float, float | None]:
    """``process``'s start: seconds since the epoch, and since boot where psutil says it."""
    started = process.create_time()
    try:
        return started, process.create_time(monotonic=True)
    except TypeError:  # psutil before 7.1
        return started, None


def writer_identity() -> WriterIdentity:
    """This process as a spool's header names it."""
    import psutil

    started, since_boot = _started(psutil.Process())
    identity: WriterIdentity = {"pid": os.getpid(), "started": started}
    if since_boot is not None:
        identity["started_since_boot"] = since_boot
    return identity


def writer_alive(header: Mapping[str, object]) -> bool:
    """Whether the process that wrote the spool still runs (a zombie has ended; a spool that names
    no writer, from an older version, is left)."""
    import psutil

    pid = header.get("pid")
    if not isinstance(pid, (int, float, str)):  # no pid (an older version's header), or no number
        return False
    try:
        process = psutil.Process(int(pid))
        return _same_start(process, header) and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, TypeError, ValueError):
        return False


def _same_start(process: psutil.Process, header: Mapping[str, object]) -> bool:
    """Whether ``process`` started when the header says its writer did: by the start since boot where
    both have it, else by the epoch start within a clock step."""
    started, since_boot = _started(process)
    said_since_boot, said = header.get("started_since_boot"), header.get("started")
    if since_boot is not None and isinstance(said_since_boot, (int, float)):
        return since_boot == said_since_boot
    return isinstance(said, (int, float)) and abs(started - said) < _CLOCK_STEP_S


def claim(spool: Path) -> contextlib.closing[IO[str]]:
    """This process delivers ``spool`` until the returned handle is closed; ``SpoolBusy`` where
    another process does (two processes of a node taking what an earlier one left)."""
    fd = os.open(spool / DELIVERY_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SpoolBusy(f"another process is delivering {spool} now") from None
    return contextlib.closing(os.fdopen(fd))
