"""A run ended however its process ends: at exit (FINISHED for 0, FAILED after an uncaught exception
or a non-zero ``sys.exit``), at ``os._exit`` (the same, by its code), and on SIGTERM (KILLED, then the
process dies of it as it would have, or the previous handler runs). A forked child inherits all of
them but not the run: in it they end nothing (``forking``).

CPython keeps the exit code of a ``SystemExit`` that reaches the top level to itself (atexit
handlers cannot read it), so the main thread's ``sys.exit`` is wrapped to note its code, as Sentry's
``SysExitIntegration`` does. A bare ``raise SystemExit(3)`` outside a ``with TrainingRun()`` block
is not seen: the run ends FINISHED (``otel-forge run`` and the block know the exit for certain)."""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import NoReturn

from otel_forge.forking import forked_from

_watched: list[ExitHandlers] = []  # installed handlers, for os._exit
_exit_codes: list[object] = []  # the main thread's last sys.exit argument
_patch_lock = threading.Lock()
_watching = False  # sys.exit and os._exit are wrapped


def exit_status(code: object) -> str:
    """The run's end for a process exiting with ``code`` (``sys.exit``'s argument)."""
    return "FINISHED" if code in (0, None) else "FAILED"


class ExitHandlers:
    """``close(status)`` registered at exit, at ``os._exit`` and, from the main thread, on SIGTERM."""

    def __init__(self, close: Callable[[str], None], handle_sigterm: bool = True) -> None:
        self._close = close
        self._handle_sigterm = handle_sigterm
        # What signal.signal gave back: a handler of Python's, SIG_DFL or SIG_IGN (ints), or None
        # (a handler not installed from Python).
        self._previous_sigterm: Callable[[int, FrameType | None], object] | int | None = None
        self._pid = os.getpid()

    @property
    def installed(self) -> bool:
        return self in _watched

    def install(self) -> None:
        if self.installed:
            return
        self._pid = os.getpid()
        _watch_exits()
        _watched.append(self)
        atexit.register(self._close_at_exit)
        if self._handle_sigterm and threading.current_thread() is threading.main_thread():
            self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)

    def remove(self) -> None:
        atexit.unregister(self._close_at_exit)
        if self in _watched:
            _watched.remove(self)
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def _close_at_exit(self) -> None:
        if forked_from(self._pid):
            return
        failed = getattr(sys, "last_value", None) is not None
        self._close("FAILED" if failed else exit_status(_exit_codes[-1] if _exit_codes else 0))

    def close_at_os_exit(self, code: int) -> None:
        if not forked_from(self._pid):
            self._close(exit_status(code))

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous_sigterm
        if not forked_from(self._pid):  # a Pool stopping its forked worker: the worker's death only
            self._close("KILLED")
        if callable(previous):
            previous(signum, frame)
        else:
            # Die as SIGTERM would have killed us, now that the run is ended.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


def _watch_exits() -> None:
    """Wrap ``sys.exit`` and ``os._exit`` once per process (whatever wrapped them before is called)."""
    global _watching
    with _patch_lock:
        if _watching:
            return
        _watching = True
        sys_exit, os_exit = sys.exit, os._exit

        def exit(status: str | int | None = None) -> NoReturn:  # noqa: A001 - it is sys.exit (typeshed's argument)
            if threading.current_thread() is threading.main_thread():
                _exit_codes[:] = [status]
            sys_exit(status)

        def _exit(status: int) -> NoReturn:
            for handlers in list(_watched):
                handlers.close_at_os_exit(status)
            os_exit(status)

        sys.exit, os._exit = exit, _exit
