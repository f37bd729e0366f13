"""A signal to one thread of another process, as the kernel may hand a process's signal to any of its
threads: CPython runs the Python handler in the main thread only, once that thread runs."""

from __future__ import annotations

import ctypes
import os
import signal
from pathlib import Path


def send_to_another_thread(pid: int, sig: signal.Signals) -> int:
    """``sig`` to one of ``pid``'s threads other than its main one (``tgkill``); that thread's id."""
    [tid, *_] = sorted(int(task.name) for task in Path(f"/proc/{pid}/task").iterdir() if int(task.name) != pid)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.tgkill(pid, tid, int(sig)) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    return tid
