"""CPU: utilization by mode and overall from time deltas, optional per logical CPU, load average.

Modes are semconv's ``cpu.mode`` values: psutil's ``irq`` and ``softirq`` are both ``interrupt``.
"""

from __future__ import annotations

import os
from typing import Any

import psutil

from otel_forge.collectors.base import HardwareCollector, Readings
from otel_forge.config import ForgeConfig

# Linux counts guest time inside user/nice already.
_NOT_IN_TOTAL = ("guest", "guest_nice")
_NOT_BUSY = ("idle", "iowait")
# psutil's field -> semconv's cpu.mode, where they differ (semconv has one interrupt mode).
_SEMCONV_MODE = {"irq": "interrupt", "softirq": "interrupt"}


def mode_fractions(before: Any, after: Any) -> dict[str, float] | None:
    """Share of each semconv ``cpu.mode`` in the CPU time elapsed between two ``cpu_times`` readings."""
    deltas: dict[str, float] = {}
    for field in after._fields:
        if field not in _NOT_IN_TOTAL:
            mode = _SEMCONV_MODE.get(field, field)
            deltas[mode] = deltas.get(mode, 0.0) + max(0.0, getattr(after, field) - getattr(before, field))
    total = sum(deltas.values())
    if total <= 0:
        return None  # no clock tick elapsed: no honest value to give
    return {mode: delta / total for mode, delta in deltas.items()}


def busy_fraction(fractions: dict[str, float]) -> float:
    return 1.0 - sum(fractions.get(mode, 0.0) for mode in _NOT_BUSY)


class CpuCollector(HardwareCollector):
    """One ``psutil.cpu_times`` per read (per CPU only when asked); utilization is the delta."""

    name = "cpu"

    def __init__(self, per_cpu: bool = False) -> None:
        self._per_cpu = per_cpu
        # Primed here so the first reported utilization covers real elapsed time, not a fake 0.
        self._previous = self._times()
        self._logical_cpus = psutil.cpu_count() or 1

    @classmethod
    def create(cls, config: ForgeConfig) -> CpuCollector:
        return cls(per_cpu=config.per_cpu)

    def _times(self) -> Any:
        return psutil.cpu_times(percpu=self._per_cpu)

    def read(self, readings: Readings) -> None:
        current = self._times()
        previous, self._previous = self._previous, current
        if self._per_cpu:
            # strict=False: a CPU hot-plugged between two reads is skipped once.
            for number, (before, after) in enumerate(zip(previous, current, strict=False)):
                for mode, fraction in (mode_fractions(before, after) or {}).items():
                    readings.add("system.cpu.utilization", fraction, {"cpu.mode": mode, "cpu.logical_number": number})
            previous, current = _summed(previous), _summed(current)
        if (fractions := mode_fractions(previous, current)) is not None:
            for mode, fraction in fractions.items():
                readings.add("system.cpu.utilization", fraction, {"cpu.mode": mode})
            readings.add("otel_forge.cpu.utilization", busy_fraction(fractions))
        readings.add("system.cpu.logical.count", self._logical_cpus)
        for window, load in zip(("1m", "5m", "15m"), os.getloadavg(), strict=True):
            readings.add(f"system.cpu.load_average.{window}", load)


def _summed(per_cpu_times: list[Any]) -> Any:
    first = per_cpu_times[0]
    return type(first)(*(sum(getattr(t, field) for t in per_cpu_times) for field in first._fields))
