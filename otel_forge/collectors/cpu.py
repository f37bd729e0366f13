"""CPU: utilization by mode and overall from time deltas, optional per logical CPU, load average."""

from __future__ import annotations

import os
import time

import psutil

from otel_forge.collectors.base import Collector, Readings
from otel_forge.config import ForgeConfig

# Linux counts guest time inside user/nice already.
_NOT_IN_TOTAL = ("guest", "guest_nice")
_NOT_BUSY = ("idle", "iowait")


def _total(times: psutil._common.namedtuple) -> float:  # type: ignore[name-defined]
    return sum(v for k, v in times._asdict().items() if k not in _NOT_IN_TOTAL)


class CpuCollector(Collector):
    """One ``psutil.cpu_times(percpu=True)`` per read; utilization is the delta since the last."""

    name = "cpu"

    def __init__(self, per_cpu: bool = False) -> None:
        self._per_cpu = per_cpu
        # Primed here so the first reported utilization covers real elapsed time, not a fake 0.
        self._previous = psutil.cpu_times(percpu=True)

    @classmethod
    def create(cls, config: ForgeConfig) -> CpuCollector:
        return cls(per_cpu=config.per_cpu)

    def read(self, readings: Readings) -> None:
        current = psutil.cpu_times(percpu=True)
        previous, self._previous = self._previous, current
        self._add_utilization(readings, previous, current)
        readings.add("system.cpu.logical.count", len(current))
        for window, load in zip(("1m", "5m", "15m"), os.getloadavg()):
            readings.add(f"system.cpu.load_average.{window}", load)

    def _add_utilization(self, readings: Readings, previous: list, current: list) -> None:
        deltas_by_mode: dict[str, float] = {}
        total_delta = 0.0
        for number, (before, after) in enumerate(zip(previous, current)):
            delta = {mode: max(0.0, getattr(after, mode) - getattr(before, mode)) for mode in after._fields}
            cpu_total = sum(v for k, v in delta.items() if k not in _NOT_IN_TOTAL)
            total_delta += cpu_total
            for mode, value in delta.items():
                deltas_by_mode[mode] = deltas_by_mode.get(mode, 0.0) + value
            if self._per_cpu and cpu_total > 0:
                busy = cpu_total - sum(delta.get(k, 0.0) for k in _NOT_BUSY)
                readings.add("otel_forge.cpu.logical.utilization", busy / cpu_total, {"cpu.logical_number": number})
        if total_delta <= 0:
            return  # no tick elapsed since the last read: no honest value to give
        for mode, value in deltas_by_mode.items():
            if mode not in _NOT_IN_TOTAL:
                readings.add("system.cpu.utilization", value / total_delta, {"cpu.mode": mode})
        busy = total_delta - sum(deltas_by_mode.get(k, 0.0) for k in _NOT_BUSY)
        readings.add("otel_forge.cpu.utilization", busy / total_delta)
