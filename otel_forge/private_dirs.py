"""Private state directories: where locks and spools live, safe on a shared machine.

A directory that holds our state (the writer locks, a spool) must be the user's own: created
0700, never a symlink, never owned by someone else. On a shared ``/tmp`` another user can create
``/tmp/otel-forge-<uid>`` first, or plant a symlink where a lock file will be opened; following
either would let them truncate a file of ours, read our spools or hold our lock. A directory that
fails a check raises ``NotPrivate`` (an ``OSError``, so callers' existing error paths take it)
with a reason a user can act on; callers say so in one line and do without it.

A *base* is a directory we put our directories into but do not own outright (``/tmp``,
``$XDG_RUNTIME_DIR``, an ``OTEL_FORGE_SPOOL_DIR`` root): it must be ours or root's, and if anyone
may write into it, sticky (so no one else can rename or replace what we create there).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import tempfile
from pathlib import Path

_logger = logging.getLogger(__name__)

# Directories are opened without following a final symlink; O_CLOEXEC keeps the fd out of children.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TRUSTED_OWNERS = frozenset({0})  # root can do anything to us anyway


class NotPrivate(OSError):
    """A directory or file that is not safely the user's own; ``strerror`` names it and says why
    (the callers' lines quote ``strerror``, and the refused one may be a parent of their path)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(errno.EPERM, f"{path} {reason}")
        self.path = path
        self.reason = reason


def _describe_owner(uid: int) -> str:
    return f"is owned by uid {uid}, not by you (uid {os.getuid()})"


def _open_dir(path: Path) -> int:
    """An fd on ``path`` itself: a symlink or a non-directory is refused here, not followed."""
    try:
        return os.open(path, _DIR_FLAGS)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        # Linux answers ENOTDIR for a symlink when O_DIRECTORY is asked too: say which it is.
        if os.path.islink(path):
            raise NotPrivate(path, "is a symlink; name the directory itself") from error
        raise NotPrivate(path, "is not a directory") from error


def check_base(path: Path) -> None:
    """``path`` may hold our private directories: a real directory (not a symlink), the user's or
    root's, and sticky if others may write into it."""
    fd = _open_dir(path)
    try:
        info = os.fstat(fd)
    finally:
        os.close(fd)
    if info.st_uid != os.getuid() and info.st_uid not in _TRUSTED_OWNERS:
        raise NotPrivate(path, _describe_owner(info.st_uid))
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise NotPrivate(path, "is world-writable without the sticky bit")


def private_dir(path: Path) -> Path:
    """Create ``path`` 0700 (its parent must exist) or check the one there: a real directory owned
    by the user. One of ours left more open (by an older version, a umask) is closed to 0700:
    only its owner could have made it, and we are that owner."""
    with contextlib.suppress(FileExistsError):  # checked below, through an fd on the directory itself
        os.mkdir(path, 0o700)
    fd = _open_dir(path)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise NotPrivate(path, _describe_owner(info.st_uid))
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def private_tree(base: Path, names: tuple[str, ...]) -> Path:
    """``base/names[0]/names[1]/...``, each level private (see ``private_dir``), under a checked base."""
    check_base(base)
    path = base
    for name in names:
        path = private_dir(path / name)
    return path


def open_private_file(path: Path, flags: int) -> int:
    """Open (creating 0600) a regular file of the user's own in a private directory, never through
    a symlink: a planted one fails here rather than letting us truncate or write its target."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise NotPrivate(path, "is a symlink") from error
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        raise NotPrivate(path, "is not a regular file of your own")
    return fd


def usable_runtime_dir() -> Path | None:
    """``$XDG_RUNTIME_DIR`` when set and as its spec says it is (absolute, a real directory, the
    user's, 0700); None otherwise (the caller falls back, silently: an unset one is the norm)."""
    value = os.environ.get("XDG_RUNTIME_DIR")
    if not value or not os.path.isabs(value):
        return None
    try:
        info = os.lstat(value)
    except OSError:
        return None
    usable = (
        stat.S_ISDIR(info.st_mode)
        and info.st_uid == os.getuid()
        and not stat.S_IMODE(info.st_mode) & 0o077
        and os.access(value, os.W_OK | os.X_OK)
    )
    if not usable:
        _logger.debug("XDG_RUNTIME_DIR %s is not a private directory of yours: not used", value)
    return Path(value) if usable else None


_warned: set[str] = set()


def host_state_location(leaf: str) -> tuple[Path, tuple[str, ...]]:
    """Where host-local state shared by the user's processes lives (locks, sockets): the base we do
    not own and the levels under it to make private, ``leaf`` last. ``$XDG_RUNTIME_DIR/otel-forge``
    where usable (the user's own by spec, host-local, cleared at logout), else ``$TMPDIR/otel-forge-<uid>``;
    never a home directory, which may be shared by hosts."""
    runtime = usable_runtime_dir()
    if runtime is not None:
        return runtime, ("otel-forge", leaf)
    return Path(tempfile.gettempdir()), (f"otel-forge-{os.getuid()}", leaf)


def warn_once(error: OSError, consequence: str) -> None:
    """One warning line per refused or failing path and reason in a process, however often met."""
    what = str(error.strerror) if isinstance(error, NotPrivate) else f"{error.filename} ({error.strerror or error})"
    if what in _warned:
        return
    _warned.add(what)
    _logger.warning("%s: not used; %s", what, consequence)
