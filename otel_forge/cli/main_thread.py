"""Waits of the CLI's main thread, in short sleeps.

CPython runs a signal's Python handler in the main thread only, and only once that thread runs
Python code. The kernel may hand a process's SIGTERM to any of its threads; a main thread blocked
in a wait that never wakes (an ``Event.wait()``, a ``Popen.wait()``) then never runs the handler,
and the agent outlives its stop. A sleep wakes every ``WAKE_S``; a handler that only records the
signal takes no lock the interrupted thread may hold.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WAKE_S = 0.25


def sleep_until(done: Callable[[], bool], timeout_s: float | None = None) -> bool:
    """Sleep until ``done()`` or for ``timeout_s`` (None: no end); whether ``done()``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not done():
        left = WAKE_S if deadline is None else deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(WAKE_S, left))
    return True
