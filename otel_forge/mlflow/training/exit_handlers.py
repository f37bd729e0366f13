"""A run ended however its process ends: at exit (FINISHED, or FAILED after an uncaught exception)
and on SIGTERM (KILLED, then the process dies of it as it would have, or the previous handler runs).
A forked child inherits both handlers but not the run: in it they end nothing (``forking``)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from otel_forge.forking import forked_from


class ExitHandlers:
    """``close(status)`` registered at exit and, from the main thread, on SIGTERM."""

    def __init__(self, close: Callable[[str], None], handle_sigterm: bool = True) -> None:
        self._close = close
        self._handle_sigterm = handle_sigterm
        self._previous_sigterm: Any = None
        self._pid = os.getpid()

    def install(self) -> None:
        self._pid = os.getpid()
        atexit.register(self._close_at_exit)
        if self._handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def remove(self) -> None:
        atexit.unregister(self._close_at_exit)
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _close_at_exit(self) -> None:
        if forked_from(self._pid):
            return
        self._close("FAILED" if getattr(sys, "last_value", None) is not None else "FINISHED")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        previous = self._previous_sigterm
        if not forked_from(self._pid):  # a Pool stopping its forked worker: the worker's death only
            self._close("KILLED")
        if callable(previous):
            previous(signum, frame)
        else:
            # Die as SIGTERM would have killed us, now that the run is ended.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
