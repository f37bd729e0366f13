"""The node dashboard: one node (or a few), every reading."""

from __future__ import annotations

from typing import Any

from dashboard_parts.panels import (
    Panel,
    Query,
    Row,
    dashboard,
    datasource_variable,
    gpu_variable,
    job_variable,
    node_variable,
    table_of,
    up_down_mappings,
)
from dashboard_parts.queries import (
    GENERAL,
    GPM_NOTE,
    GPU_OK,
    GPUS,
    HOST,
    JOB,
    MEM_USED,
    NODE,
    PCIE,
    PCIE_NOTE,
    TENSOR,
    ZERO_IS_NORMAL,
    agent_up,
    gpu_util,
    per_gpu,
    sel,
)
from dashboard_parts.rows import container_row, gpu_memory_and_link_panels, infiniband_row


def node_dashboard() -> dict[str, Any]:
    # All logical CPUs: per-CPU points (with per_cpu) carry cpu_logical_number.
    cpu = sel("system.cpu.utilization", *HOST, 'cpu_mode!="idle"', 'cpu_logical_number=""')
    rows = [
        Row(
            "Overview",
            [
                Panel(
                    "stat",
                    "Agent",
                    [Query(agent_up(*HOST), instant=True)],
                    unit="none",
                    width=3,
                    height=4,
                    mappings=up_down_mappings(),
                    thresholds=[(None, "red"), (1, "green")],
                    description="UP while Prometheus scrapes the agent (or, through a Collector, while its "
                    "hardware reads go on).",
                ),
                Panel(
                    "stat",
                    "CPU busy",
                    [Query(f"max({sel('otel_forge.cpu.utilization', *HOST)})")],
                    unit="percentunit",
                    width=3,
                    height=4,
                    thresholds=[(None, "green"), (0.9, "orange")],
                ),
                Panel(
                    "stat",
                    "Memory used",
                    [Query(f"max({sel('system.memory.utilization', *HOST, MEM_USED)})")],
                    unit="percentunit",
                    width=3,
                    height=4,
                    thresholds=[(None, "green"), (0.9, "red")],
                ),
                Panel(
                    "stat",
                    "GPUs OK",
                    [Query(f"sum({sel('hw.status', *GPUS, GPU_OK)})")],
                    unit="none",
                    width=3,
                    height=4,
                ),
                Panel(
                    "stat",
                    "GPU utilization (mean)",
                    [Query(f"avg({gpu_util(*GPUS)})")],
                    unit="percentunit",
                    width=3,
                    height=4,
                    thresholds=[(None, "red"), (0.5, "orange"), (0.8, "green")],
                ),
                Panel("stat", "GPU power", [Query(f"sum({sel('hw.power', *GPUS)})")], unit="watt", width=3, height=4),
                Panel(
                    "stat",
                    "GPU energy over the range",
                    [Query(f"sum(increase({sel('hw.energy', *GPUS)}[$__range]))", instant=True)],
                    unit="joule",
                    width=6,
                    height=4,
                    description="Energy the selected GPUs used over the dashboard's time range "
                    "(increase of hw.energy).",
                ),
            ],
        ),
        Row(
            "CPU and memory",
            [
                Panel(
                    "timeseries",
                    "CPU by mode",
                    [Query(f"max by (cpu_mode) ({cpu})", "{{cpu_mode}}")],
                    unit="percentunit",
                    stack=True,
                    min=0,
                    width=8,
                    description="Fraction of all logical CPUs' time in each mode (idle left out; the stack is "
                    "the busy fraction).",
                ),
                Panel(
                    "timeseries",
                    "Load average",
                    [
                        Query(
                            f'max by (__name__) ({{__name__=~"system_cpu_load_average_(1m|5m|15m)", {JOB}, {NODE}}})',
                            "{{__name__}}",
                        ),
                        Query(f"max({sel('system.cpu.logical.count', *HOST)})", "logical CPUs"),
                    ],
                    unit="short",
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Memory",
                    [
                        Query(
                            f"max by (system_memory_state) ({sel('system.memory.usage', *HOST)})",
                            "{{system_memory_state}}",
                        ),
                        Query(f"max({sel('system.memory.limit', *HOST)})", "total"),
                    ],
                    unit="bytes",
                    min=0,
                    width=8,
                    description="Memory by state (psutil's: used excludes buffers and cache) and the total.",
                ),
                Panel(
                    "timeseries",
                    "Swap",
                    [
                        Query(
                            f"max by (system_paging_state) ({sel('system.paging.usage', *HOST)})",
                            "{{system_paging_state}}",
                        )
                    ],
                    unit="bytes",
                    min=0,
                    width=8,
                ),
            ],
        ),
        container_row(),
        Row(
            "Filesystems, disks and network",
            [
                # One unit per panel (the schema allows no per-field unit overrides): used fraction in the
                # table, sizes in a stat beside it.
                Panel(
                    "table",
                    "Filesystems",
                    [
                        Query(
                            f"max by (system_filesystem_mountpoint, system_device, system_filesystem_type) "
                            f"({sel('system.filesystem.utilization', *HOST)})",
                            instant=True,
                            fmt="table",
                        )
                    ],
                    unit="percentunit",
                    width=8,
                    thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")],
                    transformations=table_of(
                        1,
                        rename={
                            "system_filesystem_mountpoint": "mount point",
                            "system_device": "device",
                            "system_filesystem_type": "type",
                            "Value": "used",
                        },
                    ),
                    description="Used fraction of each filesystem (pseudo filesystems excluded).",
                ),
                Panel(
                    "stat",
                    "Filesystem sizes",
                    [
                        Query(
                            f"max by (system_filesystem_mountpoint) ({sel('system.filesystem.limit', *HOST)})",
                            "{{system_filesystem_mountpoint}}",
                            instant=True,
                        )
                    ],
                    unit="bytes",
                    width=4,
                ),
                Panel(
                    "timeseries",
                    "Filesystem used",
                    [
                        Query(
                            f"max by (system_filesystem_mountpoint) ({sel('system.filesystem.utilization', *HOST)})",
                            "{{system_filesystem_mountpoint}}",
                        )
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")],
                ),
                Panel(
                    "timeseries",
                    "Disk throughput",
                    [
                        Query(
                            f"sum by (system_device, disk_io_direction) "
                            f"(rate({sel('system.disk.io', *HOST)}[$__rate_interval]))",
                            "{{system_device}} {{disk_io_direction}}",
                        )
                    ],
                    unit="Bps",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Disk operations",
                    [
                        Query(
                            f"sum by (system_device, disk_io_direction) "
                            f"(rate({sel('system.disk.operations', *HOST)}[$__rate_interval]))",
                            "{{system_device}} {{disk_io_direction}}",
                        )
                    ],
                    unit="iops",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Network throughput",
                    [
                        Query(
                            f"sum by (network_interface_name, network_io_direction) "
                            f"(rate({sel('system.network.io', *HOST)}[$__rate_interval]))",
                            "{{network_interface_name}} {{network_io_direction}}",
                        )
                    ],
                    unit="Bps",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Network packets, errors and drops",
                    [
                        Query(
                            f"sum by (network_io_direction) (rate({sel('system.network.packet.count', *HOST)}"
                            f"[$__rate_interval]))",
                            "packets {{network_io_direction}}",
                        ),
                        Query(
                            f"sum by (network_io_direction) (rate({sel('system.network.errors', *HOST)}"
                            f"[$__rate_interval]))",
                            "errors {{network_io_direction}}",
                        ),
                        Query(
                            f"sum by (network_io_direction) (rate({sel('system.network.packet.dropped', *HOST)}"
                            f"[$__rate_interval]))",
                            "dropped {{network_io_direction}}",
                        ),
                    ],
                    unit="pps",
                    min=0,
                    width=24,
                    height=7,
                ),
            ],
        ),
        infiniband_row(),
        Row(
            "Training process",
            [
                Panel(
                    "timeseries",
                    "Process CPU",
                    [Query(f"sum by (process_pid) ({sel('process.cpu.utilization', *HOST)})", "pid {{process_pid}}")],
                    unit="percentunit",
                    min=0,
                    width=8,
                    description="CPU time of the monitored process tree / elapsed time / logical CPUs.",
                ),
                Panel(
                    "timeseries",
                    "Process CPU time by mode",
                    [
                        Query(
                            f"sum by (cpu_mode) (rate({sel('process.cpu.time', *HOST)}[$__rate_interval]))",
                            "{{cpu_mode}}",
                        )
                    ],
                    unit="short",
                    min=0,
                    stack=True,
                    width=8,
                    description="CPU seconds per second of the process tree (1 = one core busy).",
                ),
                Panel(
                    "timeseries",
                    "Process memory",
                    [
                        Query(f"sum({sel('process.memory.usage', *HOST)})", "resident"),
                        Query(f"sum({sel('process.memory.virtual', *HOST)})", "virtual"),
                    ],
                    unit="bytes",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Processes, threads and open files",
                    [
                        Query(f"sum({sel('otel_forge.process.count', *HOST)})", "processes"),
                        Query(f"sum({sel('process.thread.count', *HOST)})", "threads"),
                        Query(f"sum({sel('process.unix.file_descriptor.count', *HOST)})", "open files"),
                    ],
                    unit="short",
                    min=0,
                    width=12,
                ),
                Panel(
                    "timeseries",
                    "GPU memory of the process tree",
                    [Query(f"{per_gpu('otel_forge.gpu.process.memory.usage', *GPUS)}", "GPU {{hw_id}}")],
                    unit="bytes",
                    min=0,
                    width=12,
                ),
            ],
        ),
        Row(
            "GPUs",
            [
                Panel(
                    "timeseries",
                    "GPU utilization",
                    [Query(per_gpu("hw.gpu.utilization", *GPUS, GENERAL), "GPU {{hw_id}}")],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                ),
                Panel(
                    "timeseries",
                    "GPU memory activity",
                    [Query(per_gpu("otel_forge.gpu.memory.activity", *GPUS), "GPU {{hw_id}}")],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                    description="Fraction of time device memory was read or written.",
                ),
                Panel(
                    "timeseries",
                    "GPU activity vs utilization",
                    [
                        Query(per_gpu("otel_forge.gpu.sm.activity", *GPUS), "GPU {{hw_id}} SM activity"),
                        Query(per_gpu("hw.gpu.utilization", *GPUS, GENERAL), "GPU {{hw_id}} utilization"),
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                    description=GPM_NOTE,
                ),
                Panel(
                    "timeseries",
                    "Tensor and DRAM activity",
                    [
                        Query(per_gpu("otel_forge.gpu.pipe.activity", *GPUS, TENSOR), "GPU {{hw_id}} tensor pipe"),
                        Query(per_gpu("otel_forge.gpu.dram.activity", *GPUS), "GPU {{hw_id}} DRAM"),
                        Query(per_gpu("otel_forge.gpu.sm.occupancy", *GPUS), "GPU {{hw_id}} SM occupancy"),
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                    description="Tensor-core pipe activity, DRAM (memory interface) activity and SM occupancy "
                    "(resident warps / the maximum). " + GPM_NOTE.split(": ", 1)[0] + ": empty on older GPUs.",
                ),
                Panel(
                    "timeseries",
                    "GPU memory used",
                    [
                        Query(per_gpu("hw.gpu.memory.usage", *GPUS), "GPU {{hw_id}} used"),
                        Query(per_gpu("hw.gpu.memory.limit", *GPUS), "GPU {{hw_id}} size"),
                    ],
                    unit="bytes",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Power vs limit",
                    [
                        Query(per_gpu("hw.power", *GPUS), "GPU {{hw_id}} power"),
                        Query(per_gpu("otel_forge.gpu.power.limit", *GPUS), "GPU {{hw_id}} limit"),
                    ],
                    unit="watt",
                    min=0,
                    width=8,
                    description="Power draw and the enforced power limit.",
                ),
                Panel(
                    "timeseries",
                    "Power / limit",
                    [Query(per_gpu("otel_forge.gpu.power.utilization", *GPUS), "GPU {{hw_id}}")],
                    unit="percentunit",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Temperature",
                    [
                        Query(
                            per_gpu("hw.temperature", *GPUS, by="hw_sensor_location"),
                            "GPU {{hw_id}} {{hw_sensor_location}}",
                        )
                    ],
                    unit="celsius",
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "SM and memory clocks",
                    [
                        Query(
                            per_gpu("otel_forge.gpu.clock.frequency", *GPUS, by="otel_forge_gpu_clock"),
                            "GPU {{hw_id}} {{otel_forge_gpu_clock}}",
                        )
                    ],
                    unit="hertz",
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Throttle reasons",
                    [
                        Query(
                            f"sum by (otel_forge_gpu_throttle_reason) ({sel('otel_forge.gpu.throttle', *GPUS)})",
                            "{{otel_forge_gpu_throttle_reason}}",
                        )
                    ],
                    unit="short",
                    min=0,
                    width=8,
                    description="Number of GPUs with each clock-throttle reason active (0 when none is).",
                ),
                Panel(
                    "timeseries",
                    "PCIe throughput",
                    [
                        Query(
                            f"max by (job, instance, hw_id, network_io_direction) "
                            f"(rate({sel('hw.gpu.io', *GPUS, PCIE)}[$__rate_interval]))",
                            "GPU {{hw_id}} {{network_io_direction}}",
                        )
                    ],
                    unit="Bps",
                    min=0,
                    width=12,
                    description=PCIE_NOTE,
                ),
                *gpu_memory_and_link_panels("hw_id", "GPU {{hw_id}}", 12),
                Panel(
                    "timeseries",
                    "ECC errors",
                    [
                        Query(
                            f"sum by (hw_id, error_type) (increase({sel('hw.errors', *GPUS)}[$__rate_interval]))",
                            "GPU {{hw_id}} {{error_type}}",
                        )
                    ],
                    unit="short",
                    min=0,
                    width=12,
                    description="ECC errors per GPU and type in each interval. " + ZERO_IS_NORMAL,
                ),
                Panel(
                    "table",
                    "XID events",
                    [
                        Query(
                            f"max by (hw_id, otel_forge_gpu_xid) "
                            f"(max_over_time({sel('otel_forge.gpu.xid.errors', *GPUS)}[$__range])) > 0",
                            instant=True,
                            fmt="table",
                        )
                    ],
                    unit="none",
                    width=12,
                    thresholds=[(None, "red")],
                    transformations=table_of(
                        1, rename={"hw_id": "GPU", "otel_forge_gpu_xid": "XID", "Value": "events since agent start"}
                    ),
                    description="XID critical-error events per GPU and code, counted since the agent started, for "
                    "GPUs that had any in the range. " + ZERO_IS_NORMAL,
                ),
                Panel(
                    "stat",
                    "GPU energy over the range, per GPU",
                    [
                        Query(
                            f"sum by (hw_id) (increase({sel('hw.energy', *GPUS)}[$__range]))",
                            "GPU {{hw_id}}",
                            instant=True,
                        )
                    ],
                    unit="joule",
                    width=12,
                ),
            ],
        ),
        Row(
            "Agent",
            [
                Panel(
                    "timeseries",
                    "Hardware reads and errors",
                    [
                        Query(
                            f"sum by (otel_forge_collector) (rate({sel('otel_forge.collector.reads', *HOST)}"
                            f"[$__rate_interval]))",
                            "{{otel_forge_collector}} reads",
                        ),
                        Query(
                            f"sum by (otel_forge_collector) (rate({sel('otel_forge.collector.errors', *HOST)}"
                            f"[$__rate_interval]))",
                            "{{otel_forge_collector}} errors",
                        ),
                    ],
                    unit="reqps",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Time per hardware read",
                    [
                        Query(
                            f"sum by (otel_forge_collector) (rate({sel('otel_forge.collector.read.time', *HOST)}"
                            f"[$__rate_interval])) / sum by (otel_forge_collector) "
                            f"(rate({sel('otel_forge.collector.reads', *HOST)}[$__rate_interval]))",
                            "{{otel_forge_collector}}",
                        )
                    ],
                    unit="s",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "MLflow delivery",
                    [
                        Query(
                            f"sum by (otel_forge_delivery_outcome) "
                            f"(increase({sel('otel_forge.delivery.windows', *HOST)}[$__rate_interval]))",
                            "{{otel_forge_delivery_outcome}}",
                        )
                    ],
                    unit="short",
                    min=0,
                    width=8,
                    description="MLflow windows per interval by outcome (delivered, retried, spooled, dropped); "
                    "empty when the agent serves no run.",
                ),
            ],
        ),
    ]
    return dashboard(
        "otel-forge-node",
        "otel-forge / Node",
        "One node in depth: CPU, memory, filesystems, disks, network, the training process and every GPU.",
        [datasource_variable(), job_variable(), node_variable(multi=False), gpu_variable()],
        rows,
    )
