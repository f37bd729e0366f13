"""Memory and swap: usage by state, utilization, limit, in one read of each."""

from __future__ import annotations

import psutil

from otel_forge.collectors.base import HardwareCollector, Readings
from otel_forge.config import ForgeConfig


class MemoryCollector(HardwareCollector):
    name = "memory"

    @classmethod
    def create(cls, config: ForgeConfig) -> MemoryCollector:
        return cls()

    def read(self, readings: Readings) -> None:
        memory = psutil.virtual_memory()
        # psutil's "used" (total - free - buffers - cached), as the hostmetrics receiver and MLflow.
        states = {
            "used": memory.used,
            "free": memory.free,
            "cached": getattr(memory, "cached", None),
            "buffers": getattr(memory, "buffers", None),
        }
        readings.add("system.memory.limit", memory.total)
        for state, value in states.items():
            readings.add("system.memory.usage", value, {"system.memory.state": state})
            if value is not None and memory.total:
                readings.add("system.memory.utilization", value / memory.total, {"system.memory.state": state})
        swap = psutil.swap_memory()
        for state, value in (("used", swap.used), ("free", swap.free)):
            readings.add("system.paging.usage", value, {"system.paging.state": state})
            if swap.total:
                readings.add("system.paging.utilization", value / swap.total, {"system.paging.state": state})
