"""Training metrics waiting for delivery: many ``log()`` calls become few ``log_batch`` calls, and
each value checked first, so that one bad value costs only itself, never the batch it would join."""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Mapping
from typing import Any

MAX_KEY_CHARS = 250  # MLflow's limit for a metric key
MAX_STEP = 2**63 - 1  # MLflow stores steps as int64


def checked_step(step: Any) -> int | None:
    """``step`` as MLflow can store it (an integer from 0 to int64's max, integral floats and
    numpy/torch scalars included); None otherwise."""
    if hasattr(step, "item") and not isinstance(step, (int, float)):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    if isinstance(step, float) and not step.is_integer():
        return None
    return int(step) if 0 <= step <= MAX_STEP else None


def checked_value(value: Any) -> float | None:
    """A number MLflow can store: finite, or NaN (a diverged loss is worth seeing); else None."""
    try:
        number = float(value.item() if hasattr(value, "item") else value)
    except (TypeError, ValueError, OverflowError):
        return None
    return None if math.isinf(number) else number


# (key, value, timestamp_ms, step)
MetricRow = tuple[str, float, int, int]


class MetricBuffer:
    """A bounded, ordered buffer of metric values; ``take`` hands out the oldest first.

    What was taken stays "in flight" until ``delivered()``: ``take_undelivered`` (at close) returns
    it with everything still waiting.
    """

    def __init__(self, max_values: int) -> None:
        self.max_values = max_values
        self.dropped = 0
        self._rows: collections.deque[MetricRow] = collections.deque()
        self._in_flight: list[MetricRow] = []
        self._lock = threading.Lock()

    def add(self, values: Mapping[str, float], step: int, timestamp_ms: int) -> bool:
        """Keep the values of one step; False (and counted as dropped) when there is no room."""
        with self._lock:
            if len(self._rows) + len(values) > self.max_values:
                self.dropped += len(values)
                return False
            self._rows.extend((key, value, timestamp_ms, step) for key, value in values.items())
            return True

    def take(self, count: int, after_step: int = -1) -> list[MetricRow]:
        """The oldest ``count`` rows, less those at ``after_step`` or before (dropped: a resumed
        run holds those steps already)."""
        with self._lock:
            taken = [self._rows.popleft() for _ in range(min(count, len(self._rows)))]
            self._in_flight = [row for row in taken if row[3] > after_step]
            return self._in_flight

    def delivered(self) -> None:
        with self._lock:
            self._in_flight = []

    def take_undelivered(self) -> list[MetricRow]:
        """The rows in flight and every row still waiting, oldest first; the buffer is left empty."""
        with self._lock:
            rows, self._in_flight = [*self._in_flight, *self._rows], []
            self._rows.clear()
            return rows

    def __len__(self) -> int:
        return len(self._rows)
