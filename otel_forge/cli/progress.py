"""``ReplayProgress``: the line a replay keeps up to date on a terminal: what it delivered, at what
rate, and what is left, per kind of spool (a journal's metric values, a spool's windows)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TextIO

SHOW_EVERY_S = 0.5  # a line rewritten more often is not read, only redrawn


class ReplayProgress:
    """Told each delivery (``unit``, ``count``); shows the line on ``stream`` where it is a terminal."""

    def __init__(self, stream: TextIO, kept: Mapping[str, int], clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._on_terminal = stream.isatty()
        self._kept = dict(kept)  # unit -> what the spools held when the replay began
        self._delivered: Counter[str] = Counter()
        self._clock = clock
        self._started = clock()
        self._shown_at: float | None = None

    def __call__(self, unit: str, count: int) -> None:
        self._delivered[unit] += count
        now = self._clock()
        if self._on_terminal and (self._shown_at is None or now - self._shown_at >= SHOW_EVERY_S):
            self._shown_at = now
            self._stream.write("\r\x1b[K" + self.line(now))
            self._stream.flush()

    def line(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-6)
        parts = [
            f"{done:,} {unit} delivered ({done / elapsed:,.0f}/s), {max(self._kept.get(unit, 0) - done, 0):,} left"
            for unit, done in self._delivered.items()
        ]
        return "otel-forge: " + "; ".join(parts)

    def close(self) -> None:
        """End the line, so that what is printed next starts on its own."""
        if self._shown_at is not None:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
