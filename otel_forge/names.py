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


# Attributes every GPU reading carries (the identity ones where the library gives them).
GPU_ATTRIBUTES = (
    "hw.id",
    "hw.name",
    "hw.vendor",
    "hw.type",
    "hw.model",
    "hw.serial_number",
    "hw.driver_version",
    "hw.firmware_version",
    "otel_forge.gpu.uuid",
    "otel_forge.gpu.pci_bus_id",
)
# What a MIG instance carries beyond GPU_ATTRIBUTES: its GPU's hw.id and its GPU instance id.
MIG_ATTRIBUTES = ("hw.parent", "otel_forge.gpu.mig.instance")
_FS = ("system.device", "system.filesystem.mountpoint", "system.filesystem.type")
_DISK = ("system.device", "disk.io.direction")
_NET = ("network.interface.name", "network.io.direction")
PROCESS_PID = "process.pid"  # the root of a monitored process tree: tells the trees apart
_PROC = (PROCESS_PID,)
_IB = ("otel_forge.infiniband.device", "otel_forge.infiniband.port", "otel_forge.infiniband.link_layer")
_IB_IO = _IB + ("network.io.direction",)
_RANK = ("otel_forge.training.rank",)


class Fold(str, Enum):
    """How a window of samples becomes one MLflow value."""

    MEAN = "mean"  # gauges: the window mean (max and min on request)
    SINCE_START = "since_start"  # counters: growth since the exporter started, at window end
    RATE = "rate"  # counters: growth per second over the window
    LAST = "last"  # counters that count from the job's start already: the window's last value


@dataclass(frozen=True)
class MlflowKey:
    """An MLflow key for a metric's data points.

    ``key`` may name attributes in braces (``gpu_{hw.id}_power_usage_watts``); ``where`` keeps
    only points whose attribute has one of the listed values, ``without`` only points lacking
    these attributes; points that map to the same key are summed
    (``network_{network.io.direction}_megabytes_per_second`` adds up the interfaces).
    ``gives_way_to`` (metric, key): where that metric reports in the same export, this one is
    written as that key instead (the container's view takes MLflow's name, the host's moves aside).
    """

    key: str
    scale: float = 1.0
    fold: Fold = Fold.MEAN
    where: tuple[tuple[str, tuple[str, ...]], ...] = ()
    without: tuple[str, ...] = ()
    gives_way_to: tuple[str, str] | None = None


def _where(allowed: dict[str, str | tuple[str, ...]]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((name, (v,) if isinstance(v, str) else v) for name, v in allowed.items())


@dataclass(frozen=True)
class MetricSpec:
    """One instrument: name, kind, UCUM unit, owning collector, attributes, MLflow keys."""

    name: str
    kind: Kind
    unit: str
    source: str
    attributes: tuple[str, ...]
    description: str
    mlflow: tuple[MlflowKey, ...] = ()


def _gpu(
    name: str,
    kind: Kind,
    unit: str,
    extra: tuple[str, ...],
    description: str,
    mlflow: tuple[MlflowKey, ...] = (),
    mig: bool = False,
) -> tuple[MetricSpec, ...]:
    """The same GPU metric for both vendors' collectors; ``mig``: NVIDIA's MIG instances report it too."""
    return tuple(_gpu_metric(source, name, kind, unit, extra, description, mlflow, mig) for source in ("nvidia", "amd"))


def _gpu_metric(
    source: str,
    name: str,
    kind: Kind,
    unit: str,
    extra: tuple[str, ...],
    description: str,
    mlflow: tuple[MlflowKey, ...],
    mig: bool,
) -> MetricSpec:
    """One vendor's GPU metric; only NVIDIA's MIG instances report any."""
    mig_attributes = MIG_ATTRIBUTES if mig and source == "nvidia" else ()
    return MetricSpec(name, kind, unit, source, GPU_ATTRIBUTES + extra + mig_attributes, description, mlflow)


def _nvidia(
    name: str,
    kind: Kind,
    unit: str,
    extra: tuple[str, ...],
    description: str,
    mlflow: tuple[MlflowKey, ...] = (),
    mig: bool = False,
) -> MetricSpec:
    """A GPU metric only NVML gives; ``mig``: MIG instances report it too."""
    return _gpu_metric("nvidia", name, kind, unit, extra, description, mlflow, mig)


_MB = 1e-6
_PCT = 100.0


G, C, U = Kind.GAUGE, Kind.COUNTER, Kind.UP_DOWN_COUNTER

# otel_forge.gpu.pipe values: the SM pipes NVML GPM reports activity for.
GPU_PIPES = ("tensor", "fp64", "fp32", "fp16")

# semconv's cpu.mode values a CPU is busy in (not idle, not iowait); psutil's irq and softirq are "interrupt".
BUSY_CPU_MODES = ("user", "nice", "system", "interrupt", "steal", "kernel")

K = MlflowKey
_USED, _FREE = _where({"system.filesystem.state": "used"}), _where({"system.filesystem.state": "free"})
_ROOT = _where({"system.filesystem.mountpoint": "/"})
_MEM_USED = _where({"system.memory.state": "used"})
_SWAP_USED = _where({"system.paging.state": "used"})

# InfiniBand error counters that say a link is unhealthy (bit errors, retraining, a link gone down); the
# others (discards, constraint errors, VL15 drops, the transport's) may also grow on a healthy fabric.
INFINIBAND_LINK_ERRORS = (
    "symbol_error",
    "port_rcv_errors",
    "port_rcv_remote_physical_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "link_error_recovery",
    "link_downed",
)
_IB_PORT_KEY = "infiniband_{otel_forge.infiniband.device}_{otel_forge.infiniband.port}"

# fmt: off
METRICS: tuple[MetricSpec, ...] = (
    # cpu
    MetricSpec("system.cpu.utilization", G, "1", "cpu", ("cpu.mode", "cpu.logical_number"),
               "Fraction of CPU time in each mode over the last interval: all logical CPUs, and each one "
               "(`cpu.logical_number`) with per_cpu.",
               (K("cpu_{cpu.mode}_percentage", _PCT, without=("cpu.logical_number",)),
                # A logical CPU's busy fraction: its modes but idle and iowait, summed.
                K("cpu_{cpu.logical_number}_utilization_percentage", _PCT,
                  where=_where({"cpu.mode": BUSY_CPU_MODES})))),
    MetricSpec("otel_forge.cpu.utilization", G, "1", "cpu", (),
               "Busy fraction of all logical CPUs over the last interval (not idle, not iowait).",
               (K("cpu_utilization_percentage", _PCT,
                  gives_way_to=("otel_forge.container.cpu.utilization", "host_cpu_utilization_percentage")),)),
    MetricSpec("system.cpu.logical.count", U, "{cpu}", "cpu", (), "Logical CPUs."),
    MetricSpec("system.cpu.load_average.1m", G, "{thread}", "cpu", (), "Load average over 1 minute.",
               (K("cpu_load_average_1m"),)),
    MetricSpec("system.cpu.load_average.5m", G, "{thread}", "cpu", (), "Load average over 5 minutes."),
    MetricSpec("system.cpu.load_average.15m", G, "{thread}", "cpu", (), "Load average over 15 minutes."),
    # memory
    MetricSpec("system.memory.usage", U, "By", "memory", ("system.memory.state",),
               "Memory by state (psutil's states; `used` excludes buffers and cache).",
               (K("system_memory_usage_megabytes", _MB, where=_MEM_USED,
                  gives_way_to=("container.memory.working_set", "host_memory_usage_megabytes")),
                K("system_memory_{system.memory.state}_megabytes", _MB,
                  where=_where({"system.memory.state": ("free", "cached", "buffers")})))),
    MetricSpec("system.memory.utilization", G, "1", "memory", ("system.memory.state",),
               "Memory by state as a fraction of the total.",
               (K("system_memory_usage_percentage", _PCT, where=_MEM_USED,
                  gives_way_to=("otel_forge.container.memory.utilization", "host_memory_usage_percentage")),)),
    MetricSpec("system.memory.limit", U, "By", "memory", (), "Total physical memory.",
               (K("system_memory_total_megabytes", _MB,
                  gives_way_to=("otel_forge.container.memory.limit", "host_memory_total_megabytes")),)),
    # the job's cgroup (a container's, a pod's, a SLURM job's): reported where it has a limit
    MetricSpec("otel_forge.container.cpu.limit", G, "{cpu}", "cgroup", (),
               "CPUs the job's cgroup may use: its CFS quota / period, or its cpuset's CPUs, the smaller (where "
               "smaller than the machine).",
               (K("container_cpu_limit_cpus"),)),
    MetricSpec("container.cpu.time", C, "s", "cgroup", (), "CPU time of every process in the job's cgroup."),
    MetricSpec("container.cpu.usage", G, "{cpu}", "cgroup", (),
               "CPUs the job's cgroup used over the last interval."),
    MetricSpec("otel_forge.container.cpu.utilization", G, "1", "cgroup", (),
               "CPUs the job's cgroup used over the last interval / its limit. Takes MLflow's "
               "`cpu_utilization_percentage`; the host's is then `host_cpu_utilization_percentage`.",
               (K("cpu_utilization_percentage", _PCT),)),
    MetricSpec("otel_forge.container.cpu.periods", C, "{period}", "cgroup", (),
               "CFS periods in which the cgroup had runnable tasks (with a quota)."),
    MetricSpec("otel_forge.container.cpu.throttled_periods", C, "{period}", "cgroup", (),
               "CFS periods in which the cgroup used its whole quota and was throttled."),
    MetricSpec("otel_forge.container.cpu.throttled_time", C, "s", "cgroup", (),
               "Time the cgroup's tasks were throttled (held off the CPU by the quota).",
               (K("container_cpu_throttled_seconds_per_second", fold=Fold.RATE),)),
    MetricSpec("otel_forge.container.memory.limit", U, "By", "cgroup", (),
               "Memory limit of the job's cgroup (where smaller than the machine). Takes MLflow's "
               "`system_memory_total_megabytes`; the host's is then `host_memory_total_megabytes`.",
               (K("system_memory_total_megabytes", _MB),)),
    MetricSpec("container.memory.usage", U, "By", "cgroup", (),
               "Memory charged to the job's cgroup, page cache included."),
    MetricSpec("container.memory.working_set", U, "By", "cgroup", (),
               "Memory the job's cgroup holds that the kernel cannot reclaim (usage minus inactive file pages: "
               "the kubelet's measure, what the OOM killer looks at). Takes MLflow's "
               "`system_memory_usage_megabytes`; the host's is then `host_memory_usage_megabytes`.",
               (K("system_memory_usage_megabytes", _MB),)),
    MetricSpec("otel_forge.container.memory.utilization", G, "1", "cgroup", (),
               "Working set / memory limit of the job's cgroup. Takes MLflow's `system_memory_usage_percentage`; "
               "the host's is then `host_memory_usage_percentage`.",
               (K("system_memory_usage_percentage", _PCT),)),
    MetricSpec("otel_forge.container.memory.oom_kills", C, "{process}", "cgroup", (),
               "Processes of the job's cgroup killed by the OOM killer.",
               (K("container_oom_kills", fold=Fold.SINCE_START),)),
    MetricSpec("otel_forge.pressure.stall.time", C, "s", "cgroup",
               ("otel_forge.pressure.resource", "otel_forge.pressure.scope"),
               "Time tasks stalled waiting for a resource (PSI; `otel_forge.pressure.resource` cpu, memory, io; "
               "`otel_forge.pressure.scope` some: at least one task, full: all non-idle tasks at once): the job's "
               "cgroup's with cgroup v2, else the machine's."),
    MetricSpec("system.paging.usage", U, "By", "memory", ("system.paging.state",), "Swap by state.",
               (K("swap_usage_megabytes", _MB, where=_SWAP_USED),)),
    MetricSpec("system.paging.utilization", G, "1", "memory", ("system.paging.state",),
               "Swap by state as a fraction of the total.",
               (K("swap_usage_percentage", _PCT, where=_SWAP_USED),)),
    # disk
    MetricSpec("system.filesystem.usage", U, "By", "disk", _FS + ("system.filesystem.state",),
               "Filesystem space by state (used, free, reserved), pseudo filesystems excluded.",
               (K("disk_usage_megabytes", _MB, where=_ROOT + _USED),
                K("disk_available_megabytes", _MB, where=_ROOT + _FREE),
                K("disk_{system.filesystem.mountpoint}_usage_megabytes", _MB, where=_USED))),
    MetricSpec("system.filesystem.utilization", G, "1", "disk", _FS, "Used fraction of a filesystem.",
               (K("disk_usage_percentage", _PCT, where=_ROOT),
                K("disk_{system.filesystem.mountpoint}_usage_percentage", _PCT))),
    MetricSpec("system.filesystem.limit", U, "By", "disk", _FS, "Size of a filesystem."),
    MetricSpec("system.disk.io", C, "By", "disk", _DISK, "Bytes read and written per disk.",
               (K("disk_{disk.io.direction}_megabytes_per_second", _MB, Fold.RATE),
                K("disk_{system.device}_{disk.io.direction}_megabytes_per_second", _MB, Fold.RATE))),
    MetricSpec("system.disk.operations", C, "{operation}", "disk", _DISK, "Reads and writes per disk.",
               (K("disk_{disk.io.direction}_operations_per_second", fold=Fold.RATE),)),
    # network
    MetricSpec("system.network.io", C, "By", "network", _NET, "Bytes per interface and direction.",
               (K("network_{network.io.direction}_megabytes_per_second", _MB, Fold.RATE),
                K("network_{network.interface.name}_{network.io.direction}_megabytes_per_second", _MB,
                  Fold.RATE))),
    # MLflow's network_*_megabytes count every interface psutil lists (net_io_counters()'s totals), so
    # ours do too; the per-interface series above keep to the interfaces traffic leaves the node by.
    MetricSpec("otel_forge.network.io.all_interfaces", C, "By", "network", ("network.io.direction",),
               "Bytes over every interface, loopback and virtual ones included, summed, by direction (what "
               "MLflow's monitor counts as network traffic).",
               (K("network_{network.io.direction}_megabytes", _MB, Fold.SINCE_START),)),
    MetricSpec("system.network.packet.count", C, "{packet}", "network", _NET,
               "Packets per interface and direction.",
               (K("network_{network.io.direction}_packets_per_second", fold=Fold.RATE),)),
    MetricSpec("system.network.errors", C, "{error}", "network", _NET, "Errors per interface and direction.",
               (K("network_{network.io.direction}_errors", fold=Fold.SINCE_START),)),
    MetricSpec("system.network.packet.dropped", C, "{packet}", "network", _NET,
               "Dropped packets per interface and direction.",
               (K("network_{network.io.direction}_dropped_packets", fold=Fold.SINCE_START),)),
    # InfiniBand and RoCE ports (/sys/class/infiniband, as node_exporter reads it)
    MetricSpec("otel_forge.infiniband.io", C, "By", "infiniband", _IB_IO,
               "Bytes per InfiniBand or RoCE port (`otel_forge.infiniband.link_layer` infiniband, or ethernet: "
               "RoCE) and direction: the port's data counter, in 4-byte words, x 4.",
               (K("infiniband_{network.io.direction}_megabytes_per_second", _MB, Fold.RATE),
                K(_IB_PORT_KEY + "_{network.io.direction}_megabytes_per_second", _MB, Fold.RATE))),
    MetricSpec("otel_forge.infiniband.packets", C, "{packet}", "infiniband", _IB_IO,
               "Packets per port and direction, on all virtual lanes, errors included."),
    MetricSpec("otel_forge.infiniband.unicast.packets", C, "{packet}", "infiniband", _IB_IO,
               "Unicast packets per port and direction, where the adapter counts them."),
    MetricSpec("otel_forge.infiniband.multicast.packets", C, "{packet}", "infiniband", _IB_IO,
               "Multicast packets per port and direction, where the adapter counts them."),
    MetricSpec("otel_forge.infiniband.errors", C, "{error}", "infiniband", _IB + ("error.type",),
               "Error counters per port, `error.type` the counter's file: the port's (`symbol_error`, "
               "`port_rcv_errors`, `link_downed`, `port_xmit_discards`, ...) and the driver's RoCE and transport "
               "counters (`out_of_sequence`, `local_ack_timeout_err`, ...). The MLflow key counts the link errors "
               "only: " + ", ".join(f"`{name}`" for name in INFINIBAND_LINK_ERRORS) + ".",
               (K(_IB_PORT_KEY + "_link_errors", fold=Fold.SINCE_START,
                  where=_where({"error.type": INFINIBAND_LINK_ERRORS})),)),
    MetricSpec("otel_forge.infiniband.status", U, "1", "infiniband", _IB + ("otel_forge.infiniband.state",),
               "1 for the port's current state (down, init, armed, active, active_defer), 0 for the others.",
               (K(_IB_PORT_KEY + "_up", where=_where({"otel_forge.infiniband.state": "active"})),)),
    MetricSpec("otel_forge.infiniband.physical_status", U, "1", "infiniband",
               _IB + ("otel_forge.infiniband.physical_state",),
               "1 for the port's current physical state (link_up; polling: no link, e.g. no cable; disabled; sleep; "
               "port_configuration_training; link_error_recovery; phy_test), 0 for the others."),
    MetricSpec("otel_forge.infiniband.rate", G, "By/s", "infiniband", _IB,
               "The port's link rate (`100 Gb/sec (4X EDR)`: 12.5e9 By/s): a port that trained down to fewer lanes "
               "or a lower speed shows it here."),
    # process (the monitored tree: a root pid and its children)
    MetricSpec("process.cpu.utilization", G, "1", "process", _PROC,
               "CPU time of the process tree over the last interval / elapsed time / logical CPUs.",
               (K("process_cpu_utilization_percentage", _PCT),)),
    MetricSpec("process.cpu.time", C, "s", "process", _PROC + ("cpu.mode",), "CPU seconds of the process tree."),
    MetricSpec("process.memory.usage", U, "By", "process", _PROC, "Resident memory of the process tree.",
               (K("process_memory_rss_megabytes", _MB),)),
    MetricSpec("process.memory.virtual", U, "By", "process", _PROC, "Virtual memory of the process tree.",
               (K("process_memory_virtual_megabytes", _MB),)),
    MetricSpec("process.thread.count", U, "{thread}", "process", _PROC, "Threads of the process tree.",
               (K("process_threads"),)),
    MetricSpec("process.unix.file_descriptor.count", U, "{file_descriptor}", "process", _PROC,
               "Open file descriptors of the process tree.", (K("process_open_fds"),)),
    MetricSpec("otel_forge.process.count", U, "{process}", "process", _PROC, "Processes in the tree.",
               (K("process_count"),)),
    # GPUs (NVIDIA through NVML, AMD through amdsmi); {hw.id} is the GPU index, <gpu>_mig<n> for a MIG instance
    *_gpu("hw.gpu.utilization", G, "1", ("hw.gpu.task",),
          "Fraction of time the GPU was busy (`hw.gpu.task` general; NVIDIA's video encoder and decoder too).",
          (K("gpu_{hw.id}_utilization_percentage", _PCT, where=_where({"hw.gpu.task": "general"})),), mig=True),
    *_gpu("otel_forge.gpu.memory.activity", G, "1", (),
          "Fraction of time device memory was being read or written.",
          (K("gpu_{hw.id}_memory_activity_percentage", _PCT),), mig=True),
    *_gpu("hw.gpu.memory.usage", U, "By", (), "GPU memory used.", (K("gpu_{hw.id}_memory_usage_megabytes", _MB),),
          mig=True),
    *_gpu("hw.gpu.memory.limit", U, "By", (), "GPU memory size.", (K("gpu_{hw.id}_memory_total_megabytes", _MB),),
          mig=True),
    *_gpu("hw.gpu.memory.utilization", G, "1", (), "GPU memory used / size.",
          (K("gpu_{hw.id}_memory_usage_percentage", _PCT),), mig=True),
    *_gpu("hw.power", G, "W", (), "Power draw.", (K("gpu_{hw.id}_power_usage_watts"),)),
    *_gpu("otel_forge.gpu.power.limit", G, "W", (), "Enforced power limit.", (K("gpu_{hw.id}_power_limit_watts"),)),
    *_gpu("otel_forge.gpu.power.utilization", G, "1", (), "Power draw / enforced power limit.",
          (K("gpu_{hw.id}_power_usage_percentage", _PCT),)),
    *_gpu("hw.energy", C, "J", (), "Energy consumed since the driver loaded.",
          (K("gpu_{hw.id}_energy_joules", fold=Fold.SINCE_START),
           # every GPU of the node together (the points of one key add up), in kWh
           K("gpu_energy_kwh", 1 / 3.6e6, Fold.SINCE_START, without=MIG_ATTRIBUTES))),
    *_gpu("hw.temperature", G, "Cel", ("hw.sensor_location",),
          "Temperature (`hw.sensor_location`: NVIDIA gpu, memory; AMD edge, hotspot, memory).",
          # One sensor per key: NVIDIA's die ("gpu"), AMD's edge; AMD's hotspot and the memory (HBM) beside it.
          (K("gpu_{hw.id}_temperature_celsius", where=_where({"hw.sensor_location": ("gpu", "edge")})),
           K("gpu_{hw.id}_hotspot_temperature_celsius", where=_where({"hw.sensor_location": "hotspot"})),
           K("gpu_{hw.id}_memory_temperature_celsius", where=_where({"hw.sensor_location": "memory"})))),
    *_gpu("otel_forge.gpu.clock.frequency", G, "Hz", ("otel_forge.gpu.clock",), "Clock frequency (sm, memory).",
          (K("gpu_{hw.id}_{otel_forge.gpu.clock}_clock_mhz", _MB),)),
    *_gpu("hw.errors", C, "{error}", ("error.type",),
          "ECC errors since the driver loaded (`error.type` corrected, uncorrected; AMD's deferred too).",
          (K("gpu_{hw.id}_ecc_{error.type}_errors", fold=Fold.SINCE_START),)),
    *_gpu("hw.status", U, "1", ("hw.state",), "1 for the GPU's current state (ok, failed), 0 for the others.",
          (K("gpu_{hw.id}_status_ok", where=_where({"hw.state": "ok"})),), mig=True),
    *_gpu("hw.gpu.io", C, "By", ("otel_forge.gpu.link", "network.io.direction"),
          "Bytes over each GPU link (`otel_forge.gpu.link` pcie: NVML's throughput, sampled each read, times the "
          "time between reads; nvlink: NVML's counter over all links; xgmi: amdsmi's counters over all links).",
          (K("gpu_{hw.id}_{otel_forge.gpu.link}_{network.io.direction}_megabytes_per_second", _MB, Fold.RATE),)),
    *_gpu("otel_forge.gpu.throttle", G, "1", ("otel_forge.gpu.throttle.reason",),
          "1 while a clock throttle reason is active, else 0 (NVIDIA's clock-event reasons; AMD's violation "
          "flags: ppt_power, socket_thermal, prochot_thermal, vr_thermal, hbm_thermal).",
          (K("gpu_{hw.id}_throttle_{otel_forge.gpu.throttle.reason}"),)),
    _nvidia("otel_forge.gpu.violation.time", C, "s", ("otel_forge.gpu.violation",),
            "Time the clocks were held below application clocks by the power or the thermal policy "
            "(`otel_forge.gpu.violation`)."),
    _nvidia("otel_forge.gpu.xid.errors", C, "{event}", ("otel_forge.gpu.xid",), "XID error events, by XID code.",
            (K("gpu_{hw.id}_xid_errors", fold=Fold.SINCE_START),)),
    _nvidia("otel_forge.gpu.nvlink.errors", C, "{error}", ("error.type",),
            "NVLink errors over all links since the driver loaded (`error.type` crc_flit, crc_data, replay, "
            "recovery)."),
    *_gpu("otel_forge.gpu.pcie.replays", C, "{replay}", (),
          "PCIe replays (retransmitted packets) since the driver loaded: a growing count is a bad link or riser."),
    _nvidia("otel_forge.gpu.memory.remapped_rows", C, "{row}", ("error.type",),
            "Memory rows remapped to spares, by the error that caused it (corrected, uncorrected)."),
    _nvidia("otel_forge.gpu.memory.remap.pending", G, "1", (),
            "1 while a row remapping waits for a GPU reset, else 0.",
            (K("gpu_{hw.id}_row_remap_pending"),)),
    _nvidia("otel_forge.gpu.memory.remap.failed", G, "1", (),
            "1 once a row remapping failed (no spare row left: the GPU needs service), else 0.",
            (K("gpu_{hw.id}_row_remap_failure"),)),
    *_gpu("otel_forge.gpu.memory.retired_pages", C, "{page}", ("error.type",),
          "Memory pages retired (NVIDIA: by the error that caused it, corrected or uncorrected; AMD: its bad "
          "pages reserved)."),
    *_gpu("otel_forge.gpu.memory.retirement.pending", G, "1", (),
          "1 while a page retirement waits for a GPU reset (or a driver reload), else 0."),
    *_gpu("otel_forge.gpu.process.memory.usage", U, "By", _PROC, "GPU memory used by a monitored process tree.",
          (K("gpu_{hw.id}_process_memory_megabytes", _MB),)),
    # NVML GPM (GPU Performance Monitoring, Hopper and newer): what the GPU did between two reads, from
    # two GPM samples, where hw.gpu.utilization only says that some kernel was running.
    _nvidia("otel_forge.gpu.sm.activity", G, "1", (),
            "Fraction of the SMs busy between two reads (NVML GPM's SM utilization; Hopper and newer).",
            (K("gpu_{hw.id}_sm_activity_percentage", _PCT),), mig=True),
    _nvidia("otel_forge.gpu.sm.occupancy", G, "1", (),
            "Warps resident on the SMs / the most they hold, between two reads (NVML GPM).",
            (K("gpu_{hw.id}_sm_occupancy_percentage", _PCT),), mig=True),
    _nvidia("otel_forge.gpu.pipe.activity", G, "1", ("otel_forge.gpu.pipe",),
            "Fraction of time the SMs ran a pipe between two reads (NVML GPM; `otel_forge.gpu.pipe` tensor: any "
            "tensor operation; fp64, fp32, fp16: non-tensor math).",
            (K("gpu_{hw.id}_{otel_forge.gpu.pipe}_activity_percentage", _PCT,
               where=_where({"otel_forge.gpu.pipe": GPU_PIPES})),), mig=True),
    _nvidia("otel_forge.gpu.dram.activity", G, "1", (),
            "Used fraction of the DRAM bandwidth between two reads (NVML GPM).",
            (K("gpu_{hw.id}_dram_activity_percentage", _PCT),), mig=True),
    _nvidia("otel_forge.gpu.io.rate", G, "By/s", ("otel_forge.gpu.link", "network.io.direction"),
            "Bytes per second over the GPU's links between two reads (NVML GPM; `otel_forge.gpu.link` pcie, "
            "nvlink: all links). MLflow has the same traffic from `hw.gpu.io`.", mig=True),
    # training progress (otel-forge run: progress/, collectors/progress.py): the job, beside its machines
    MetricSpec("otel_forge.training.step", G, "{step}", "progress", _RANK,
               "The rank's optimizer steps so far (else the last step it logged).",
               (K("training_rank_{otel_forge.training.rank}_step"),)),
    MetricSpec("otel_forge.training.step.duration", G, "s", "progress", _RANK + ("otel_forge.training.quantile",),
               "The rank's step time over its last 64 steps (`otel_forge.training.quantile` p50, p95).",
               (K("training_rank_{otel_forge.training.rank}_step_{otel_forge.training.quantile}_seconds"),)),
    MetricSpec("otel_forge.training.step.work", G, "s", "progress", _RANK,
               "The rank's own work per step (median): its step time less its waits in collectives and backward, "
               "where its peers' slowness shows.",
               (K("training_rank_{otel_forge.training.rank}_work_seconds"),)),
    MetricSpec("otel_forge.training.step.work.ratio", G, "1", "progress", _RANK,
               "The rank's own work per step / the median rank's: the slow rank is the highest.",
               (K("training_rank_{otel_forge.training.rank}_work_ratio"),)),
    MetricSpec("otel_forge.training.step.age", G, "s", "progress", _RANK,
               "Time since the rank's last step (or checkpoint, evaluation, logged step).",
               (K("training_rank_{otel_forge.training.rank}_seconds_since_step"),)),
    MetricSpec("otel_forge.training.slow_rank", G, "1", "progress", _RANK + ("host.name",),
               "1 for a rank whose own work per step is `slow_rank_ratio` times the median rank's or more, else "
               "0.", (K("training_rank_{otel_forge.training.rank}_slow"),)),
    MetricSpec("otel_forge.training.steps", G, "{step}/s", "progress", (),
               "Optimizer steps per second (the median rank's, over its last steps).",
               (K("training_steps_per_second"),)),
    MetricSpec("otel_forge.training.samples", G, "{sample}/s", "progress", (),
               "Samples per second of the whole job (`samples_per_step` given).",
               (K("training_samples_per_second"),)),
    MetricSpec("otel_forge.training.tokens", G, "{token}/s", "progress", (),
               "Tokens per second of the whole job (`tokens_per_step` given).",
               (K("training_tokens_per_second"),)),
    MetricSpec("otel_forge.training.mfu", G, "1", "progress", (),
               "Model FLOPs utilisation: FLOPs per step x steps per second / (the job's GPUs x one GPU's peak).",
               (K("training_mfu_percentage", _PCT),)),
    MetricSpec("otel_forge.training.stalled", G, "1", "progress", ("otel_forge.training.rank", "host.name"),
               "1 while no rank of the job advances for max(`stall_factor` median steps, `stall_floor_s`), with "
               "the rank named as the cause (`otel_forge.training.rank`, none where no single one), else 0.",
               (K("training_stalled"),)),
    MetricSpec("otel_forge.training.activity", G, "1", "progress", ("otel_forge.training.activity",),
               "1 for what the job does now (startup, productive, checkpointing, evaluating, stalled, other), "
               "0 for the others."),
    MetricSpec("otel_forge.training.time", C, "s", "progress", ("otel_forge.training.activity",),
               "The job's wall time by activity (goodput): productive, startup, checkpointing, evaluating, "
               "stalled, restart_lost (work since the last checkpoint before a restart), other.",
               (K("training_time_{otel_forge.training.activity}_seconds", fold=Fold.LAST),)),
    MetricSpec("otel_forge.training.goodput", G, "1", "progress", (),
               "Productive time / wall time since the job started.",
               (K("training_goodput_percentage", _PCT),)),
    MetricSpec("otel_forge.training.energy.per_step", G, "J", "progress", (),
               "The node's GPU energy per optimizer step: its GPUs' energy since the job started (`otel-forge "
               "run`'s first read of them) over the optimizer steps the job took (each attempt's most steps of a "
               "rank on the node, summed over the attempts).",
               (K("gpu_energy_joules_per_step", fold=Fold.LAST),)),
    # self-telemetry
    MetricSpec("otel_forge.collector.reads", C, "{read}", "self", ("otel_forge.collector",),
               "Hardware reads per collector."),
    MetricSpec("otel_forge.collector.errors", C, "{error}", "self", ("otel_forge.collector",),
               "Failed reads per collector."),
    MetricSpec("otel_forge.collector.read.time", C, "s", "self", ("otel_forge.collector",),
               "Time spent reading, per collector."),
    MetricSpec("otel_forge.collect.time", G, "s", "self", (),
               "When the agent last collected, Unix seconds: Prometheus serves that collect, so the data's age is "
               "time() minus this (at most one interval)."),
    MetricSpec("otel_forge.run.info", G, "", "run", ("mlflow.run.id", "mlflow.experiment.id", "mlflow.run.name",
                                                 "otel_forge.node.id", "k8s.namespace.name", "k8s.pod.name",
                                                 "k8s.node.name", "k8s.job.name", "otel_forge.k8s.job.kind",
                                                 "otel_forge.k8s.job.name"),
               "1 while the agent serves an MLflow run: joins a node's series to the run (group_left). On "
               "Kubernetes also the node's pod, namespace, node and owning job (those known)."),
    MetricSpec("otel_forge.delivery.windows", C, "{window}", "delivery", ("otel_forge.delivery.outcome",),
               "MLflow windows by outcome: delivered, retried, spooled, dropped."),
    MetricSpec("otel_forge.otlp.received", G, "", "received", ("mlflow.run.id", "otel_forge.mlflow.key"),
               "The latest value of each MLflow key that OTLP metrics received by this agent feed (--otlp-receiver), "
               "by run: what the run's otlp/... charts show, on the dashboards."),
)
# fmt: on
