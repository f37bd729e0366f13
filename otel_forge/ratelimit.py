"""Warnings that repeat at most once per interval per key, so a broken source never floods logs."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class RateLimitedLogger:
    """Logs a warning for ``key`` at most once every ``interval_s``; the rest are counted."""

    def __init__(
        self, logger: logging.Logger, interval_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log ``message % args`` unless ``key`` was logged within the interval; True if logged."""
        return self.log(logging.WARNING, key, message, *args)

    def log(self, level: int, key: str, message: str, *args: object) -> bool:
        """``warning`` at ``level``."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._suppressed[key] = self._suppressed.get(key, 0) + 1
                return False
            self._last[key] = now
            suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            message += " (%d similar warnings suppressed)"
            args = (*args, suppressed)
        self._logger.log(level, message, *args)
        return True
