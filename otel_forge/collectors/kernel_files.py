"""The files the kernel serves under /proc and /sys (cgroups, RDMA ports): read whole in one
``os.read``, no buffered text layer; a file that is absent, unreadable or refused gives None."""

from __future__ import annotations

import os


def read_text(path: str | None) -> str | None:
    """The file's text; None where it is absent, unreadable (EACCES) or refused by its driver (EINVAL)."""
    if path is None:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16).decode(errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def read_int(path: str | None) -> int | None:
    """A file holding one integer; anything else ("max", "N/A (no PMA)") gives None."""
    text = read_text(path)
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None
