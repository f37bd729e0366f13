"""The metric table: every instrument otel_forge reports, declared once.

Semantic-convention names where one exists; what semconv lacks lives under ``otel_forge.``.
Collectors add readings under these names, ``instruments`` registers one observable instrument
per row, and the README's metric table is rendered from this tuple.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    UP_DOWN_COUNTER = "updowncounter"


# Attributes every GPU reading carries.
GPU_ATTRIBUTES = ("hw.id", "hw.name", "hw.vendor", "hw.type", "otel_forge.gpu.uuid", "otel_forge.gpu.pci_bus_id")
_FS = ("system.device", "system.filesystem.mountpoint", "system.filesystem.type")
_DISK = ("system.device", "disk.io.direction")
_NET = ("network.interface.name", "network.io.direction")
_PROC = ("process.pid",)


@dataclass(frozen=True)
class MetricSpec:
    """One instrument: its name, kind, UCUM unit, the collector that reads it, its attributes."""

    name: str
    kind: Kind
    unit: str
    source: str
    attributes: tuple[str, ...]
    description: str


def _gpu(name: str, kind: Kind, unit: str, extra: tuple[str, ...], description: str) -> tuple[MetricSpec, ...]:
    """The same GPU metric for both vendors' collectors."""
    return tuple(MetricSpec(name, kind, unit, source, GPU_ATTRIBUTES + extra, description)
                 for source in ("nvidia", "amd"))


G, C, U = Kind.GAUGE, Kind.COUNTER, Kind.UP_DOWN_COUNTER

METRICS: tuple[MetricSpec, ...] = (
    # cpu
    MetricSpec("system.cpu.utilization", G, "1", "cpu", ("cpu.mode",),
               "Fraction of CPU time in each mode over the last interval, all logical CPUs."),
    MetricSpec("otel_forge.cpu.utilization", G, "1", "cpu", (),
               "Busy fraction of all logical CPUs over the last interval (not idle, not iowait)."),
    MetricSpec("otel_forge.cpu.logical.utilization", G, "1", "cpu", ("cpu.logical_number",),
               "Busy fraction per logical CPU (only with per_cpu)."),
    MetricSpec("system.cpu.logical.count", U, "{cpu}", "cpu", (), "Logical CPUs."),
    MetricSpec("system.cpu.load_average.1m", G, "{thread}", "cpu", (), "Load average over 1 minute."),
    MetricSpec("system.cpu.load_average.5m", G, "{thread}", "cpu", (), "Load average over 5 minutes."),
    MetricSpec("system.cpu.load_average.15m", G, "{thread}", "cpu", (), "Load average over 15 minutes."),
    # memory
    MetricSpec("system.memory.usage", U, "By", "memory", ("system.memory.state",),
               "Memory by state; `used` is total - available."),
    MetricSpec("system.memory.utilization", G, "1", "memory", ("system.memory.state",),
               "Memory by state as a fraction of the total."),
    MetricSpec("system.memory.limit", U, "By", "memory", (), "Total physical memory."),
    MetricSpec("system.paging.usage", U, "By", "memory", ("system.paging.state",), "Swap by state."),
    MetricSpec("system.paging.utilization", G, "1", "memory", ("system.paging.state",),
               "Swap by state as a fraction of the total."),
    # disk
    MetricSpec("system.filesystem.usage", U, "By", "disk", _FS + ("system.filesystem.state",),
               "Filesystem space by state (used, free, reserved), pseudo filesystems excluded."),
    MetricSpec("system.filesystem.utilization", G, "1", "disk", _FS, "Used fraction of a filesystem."),
    MetricSpec("system.filesystem.limit", U, "By", "disk", _FS, "Size of a filesystem."),
    MetricSpec("system.disk.io", C, "By", "disk", _DISK, "Bytes read and written per disk."),
    MetricSpec("system.disk.operations", C, "{operation}", "disk", _DISK, "Reads and writes per disk."),
    # network
    MetricSpec("system.network.io", C, "By", "network", _NET, "Bytes per interface and direction."),
    MetricSpec("system.network.packet.count", C, "{packet}", "network", _NET, "Packets per interface and direction."),
    MetricSpec("system.network.errors", C, "{error}", "network", _NET, "Errors per interface and direction."),
    MetricSpec("system.network.packet.dropped", C, "{packet}", "network", _NET,
               "Dropped packets per interface and direction."),
    # process (the monitored tree: a root pid and its children)
    MetricSpec("process.cpu.utilization", G, "1", "process", _PROC,
               "CPU time of the process tree over the last interval / elapsed time / logical CPUs."),
    MetricSpec("process.cpu.time", C, "s", "process", _PROC + ("cpu.mode",), "CPU seconds of the process tree."),
    MetricSpec("process.memory.usage", U, "By", "process", _PROC, "Resident memory of the process tree."),
    MetricSpec("process.memory.virtual", U, "By", "process", _PROC, "Virtual memory of the process tree."),
    MetricSpec("process.thread.count", U, "{thread}", "process", _PROC, "Threads of the process tree."),
    MetricSpec("process.unix.file_descriptor.count", U, "{file_descriptor}", "process", _PROC,
               "Open file descriptors of the process tree."),
    MetricSpec("otel_forge.process.count", U, "{process}", "process", _PROC, "Processes in the tree."),
    # GPUs (NVIDIA through NVML, AMD through amdsmi)
    *_gpu("hw.gpu.utilization", G, "1", ("hw.gpu.task",), "Fraction of time the GPU was busy."),
    *_gpu("otel_forge.gpu.memory.activity", G, "1", (),
          "Fraction of time device memory was being read or written."),
    *_gpu("hw.gpu.memory.usage", U, "By", (), "GPU memory used."),
    *_gpu("hw.gpu.memory.limit", U, "By", (), "GPU memory size."),
    *_gpu("hw.gpu.memory.utilization", G, "1", (), "GPU memory used / size."),
    *_gpu("hw.power", G, "W", (), "Power draw."),
    *_gpu("otel_forge.gpu.power.limit", G, "W", (), "Enforced power limit."),
    *_gpu("hw.energy", C, "J", (), "Energy consumed since the driver loaded."),
    *_gpu("hw.temperature", G, "Cel", ("hw.sensor_location",), "Temperature."),
    *_gpu("otel_forge.gpu.clock.frequency", G, "Hz", ("otel_forge.gpu.clock",), "Clock frequency (sm, memory)."),
    *_gpu("hw.errors", C, "{error}", ("hw.error.type",), "ECC errors (corrected, uncorrected)."),
    *_gpu("hw.status", U, "1", ("hw.state",), "1 for the GPU's current state (ok, failed), 0 for the others."),
    MetricSpec("otel_forge.gpu.pcie.throughput", G, "By/s", "nvidia", GPU_ATTRIBUTES + ("network.io.direction",),
               "PCIe throughput (transmit, receive)."),
    MetricSpec("otel_forge.gpu.throttle", G, "1", "nvidia", GPU_ATTRIBUTES + ("otel_forge.gpu.throttle.reason",),
               "1 while a clock throttle reason is active, else 0."),
    MetricSpec("otel_forge.gpu.xid.errors", C, "{event}", "nvidia", GPU_ATTRIBUTES + ("otel_forge.gpu.xid",),
               "XID error events, by XID code."),
    *_gpu("otel_forge.gpu.process.memory.usage", U, "By", (), "GPU memory used by the monitored process tree."),
    # self-telemetry
    MetricSpec("otel_forge.collector.reads", C, "{read}", "self", ("otel_forge.collector",),
               "Hardware reads per collector."),
    MetricSpec("otel_forge.collector.errors", C, "{error}", "self", ("otel_forge.collector",),
               "Failed reads per collector."),
    MetricSpec("otel_forge.collector.read.time", C, "s", "self", ("otel_forge.collector",),
               "Time spent reading, per collector."),
)
