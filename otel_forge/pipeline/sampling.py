"""One hardware read per interval, however many readers ask: a cached snapshot per collector."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from otel_forge.collectors.base import Collector, Readings, Snapshot
from otel_forge.ratelimit import RateLimitedLogger

_logger = logging.getLogger(__name__)
_warnings = RateLimitedLogger(_logger)


@dataclass
class ReadStats:
    """Self-telemetry of one collector: cumulative since start."""

    reads: int = 0
    errors: int = 0
    read_time_s: float = 0.0


class CachedCollector:
    """Serves a collector's latest snapshot, re-reading the source only when it is too old.

    Every observable callback of every reader calls ``snapshot()``; the first one after
    ``max_age_s`` triggers the read, the rest share it. A read that raises costs this
    collector's values for that cycle (an empty snapshot), is counted and warned at most
    once a minute.
    """

    def __init__(self, collector: Collector, max_age_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.collector = collector
        self.max_age_s = max_age_s
        self.stats = ReadStats()
        self._clock = clock
        self._lock = threading.Lock()
        self._snapshot: Snapshot | None = None

    @property
    def name(self) -> str:
        return self.collector.name

    def snapshot(self) -> Snapshot:
        with self._lock:
            now = self._clock()
            if self._snapshot is None or now - self._snapshot.taken_at_s >= self.max_age_s:
                self._snapshot = self._read(now)
            return self._snapshot

    def expire(self) -> None:
        with self._lock:
            self._snapshot = None

    def _read(self, now: float) -> Snapshot:
        readings = Readings()
        started = time.perf_counter()
        try:
            self.collector.read(readings)
        except Exception as error:  # noqa: BLE001 - isolation: one source never breaks the others
            self.stats.errors += 1
            _warnings.warning(self.name, "collector %s failed to read: %s", self.name, error)
            readings = Readings()
        finally:
            self.stats.reads += 1
            self.stats.read_time_s += time.perf_counter() - started
        return Snapshot(now, readings)
