"""Training metrics waiting for delivery: many ``log()`` calls become few ``log_batch`` calls."""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping

# (key, value, timestamp_ms, step)
MetricRow = tuple[str, float, int, int]


class MetricBuffer:
    """A bounded, ordered buffer of metric values; ``take`` hands out the oldest first."""

    def __init__(self, max_values: int) -> None:
        self.max_values = max_values
        self.dropped = 0
        self._rows: collections.deque[MetricRow] = collections.deque()
        self._lock = threading.Lock()

    def add(self, values: Mapping[str, float], step: int, timestamp_ms: int) -> bool:
        """Keep the values of one step; False (and counted as dropped) when there is no room."""
        with self._lock:
            if len(self._rows) + len(values) > self.max_values:
                self.dropped += len(values)
                return False
            self._rows.extend((key, value, timestamp_ms, step) for key, value in values.items())
            return True

    def take(self, count: int) -> list[MetricRow]:
        with self._lock:
            return [self._rows.popleft() for _ in range(min(count, len(self._rows)))]

    def __len__(self) -> int:
        return len(self._rows)
