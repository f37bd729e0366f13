"""The fleet dashboard: every node of every job, the outliers first."""

from __future__ import annotations

from typing import Any

from dashboard_parts.panels import (
    Panel,
    Query,
    Row,
    custom_variable,
    dashboard,
    datasource_variable,
    gpu_variable,
    job_variable,
    node_variable,
    table_of,
    up_down_mappings,
)
from dashboard_parts.queries import (
    GPU_OK,
    GPUS,
    HOST,
    JOB,
    NODE,
    NOT_IDLE,
    NOT_MEMORY_SENSOR,
    ZERO_IS_NORMAL,
    agent_up,
    gpu_util,
    per_gpu,
    sel,
)
from dashboard_parts.rows import fleet_progress_row, gpu_memory_and_link_panels


def fleet_dashboard() -> dict[str, Any]:
    node_util = f"avg by (job, instance) ({gpu_util(*GPUS)})"
    node_util_range = f"avg by (job, instance) (avg_over_time({gpu_util(*GPUS)}[$__range]))"
    temp_range = (
        f"max by (job, instance, hw_id) (max_over_time({sel('hw.temperature', *GPUS, NOT_MEMORY_SENSOR)}[$__range]))"
    )
    up = agent_up(*HOST)
    stragglers = (
        f"{node_util_range} < on (job) group_left () ($straggler_ratio * quantile by (job) (0.5, {node_util_range}))"
    )
    rows = [
        Row(
            "Fleet",
            [
                Panel(
                    "stat",
                    "Agents up",
                    [Query(f"count(({up}) == 1) or vector(0)", instant=True)],
                    unit="none",
                    width=4,
                    height=4,
                ),
                Panel(
                    "stat",
                    "Agents down",
                    [Query(f"count(({up}) == 0) or vector(0)", instant=True)],
                    unit="none",
                    width=4,
                    height=4,
                    thresholds=[(None, "green"), (1, "red")],
                ),
                Panel(
                    "stat",
                    "GPUs",
                    [Query(f"count({sel('hw.status', *GPUS, GPU_OK)} == 1)")],
                    unit="none",
                    width=4,
                    height=4,
                    description="GPUs whose state is ok.",
                ),
                Panel(
                    "stat",
                    "GPU utilization (mean)",
                    [Query(f"avg({gpu_util(*GPUS)})")],
                    unit="percentunit",
                    width=4,
                    height=4,
                    thresholds=[(None, "red"), (0.5, "orange"), (0.8, "green")],
                ),
                Panel(
                    "stat", "Total GPU power", [Query(f"sum({sel('hw.power', *GPUS)})")], unit="watt", width=4, height=4
                ),
                Panel(
                    "stat",
                    "GPU energy over the range",
                    [Query(f"sum(increase({sel('hw.energy', *GPUS)}[$__range]))", instant=True)],
                    unit="joule",
                    width=4,
                    height=4,
                ),
            ],
        ),
        fleet_progress_row(),
        Row(
            "GPU utilization",
            [
                Panel(
                    "heatmap",
                    "GPU utilization by node and GPU",
                    [Query(f"max by (instance, hw_id) ({gpu_util(*GPUS)})", "{{instance}} GPU {{hw_id}}")],
                    unit="percentunit",
                    width=24,
                    height=10,
                    description="One row per node and GPU; a pale row among dark ones is a GPU that waits.",
                ),
                Panel(
                    "timeseries",
                    "Node GPU utilization vs the job's median",
                    [
                        Query(node_util, "{{instance}}"),
                        Query(f"quantile by (job) (0.5, {node_util})", "median {{job}}"),
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=14,
                    height=9,
                    legend_table=True,
                ),
                Panel(
                    "table",
                    "Stragglers",
                    [
                        Query(stragglers, instant=True, fmt="table"),
                        Query(
                            f"({stragglers}) * 0 + on (job) group_left () quantile by (job) (0.5, {node_util_range})",
                            instant=True,
                            fmt="table",
                        ),
                    ],
                    unit="percentunit",
                    width=10,
                    height=9,
                    thresholds=[(None, "orange")],
                    transformations=table_of(
                        2, rename={"instance": "node", "Value #A": "node mean", "Value #B": "job median"}
                    ),
                    description="Nodes whose mean GPU utilization over the range is below $straggler_ratio x the "
                    "median of their job's nodes. Empty when no node lags.",
                ),
            ],
        ),
        Row(
            "Power, energy and temperature",
            [
                Panel(
                    "timeseries",
                    "GPU power by node",
                    [
                        Query(f"sum by (job, instance) ({sel('hw.power', *GPUS)})", "{{instance}}"),
                        Query(f"sum({sel('hw.power', *GPUS)})", "total"),
                        Query(f"sum({sel('otel_forge.gpu.power.limit', *GPUS)})", "total power limit"),
                    ],
                    unit="watt",
                    min=0,
                    width=12,
                    stack=False,
                    legend_table=True,
                ),
                Panel(
                    "table",
                    "GPU energy by node over the range",
                    [
                        Query(
                            f"sum by (job, instance) (increase({sel('hw.energy', *GPUS)}[$__range]))",
                            instant=True,
                            fmt="table",
                        )
                    ],
                    unit="joule",
                    width=12,
                    transformations=table_of(1, rename={"instance": "node", "Value": "energy"}),
                ),
                Panel(
                    "timeseries",
                    "Hottest GPUs",
                    [
                        Query(
                            f"topk(5, {per_gpu('hw.temperature', *GPUS, NOT_MEMORY_SENSOR)})",
                            "{{instance}} GPU {{hw_id}}",
                        )
                    ],
                    unit="celsius",
                    width=12,
                ),
                Panel(
                    "table",
                    "Temperature outliers",
                    [
                        Query(
                            f"{temp_range} > on (job) group_left () (quantile by (job) (0.5, {temp_range}) + 10) "
                            f"or {temp_range} > 85",
                            instant=True,
                            fmt="table",
                        )
                    ],
                    unit="celsius",
                    width=12,
                    thresholds=[(None, "orange"), (85, "red")],
                    transformations=table_of(
                        1, rename={"instance": "node", "hw_id": "GPU", "Value": "max temperature"}
                    ),
                    description="GPUs whose highest temperature in the range is 10 C above their job's median GPU, "
                    "or above 85 C. Empty when none is.",
                ),
                Panel(
                    "timeseries",
                    "GPUs throttling, by reason",
                    [
                        Query(
                            f"sum by (otel_forge_gpu_throttle_reason) "
                            f"({sel('otel_forge.gpu.throttle', *GPUS, NOT_IDLE)})",
                            "{{otel_forge_gpu_throttle_reason}}",
                        )
                    ],
                    unit="short",
                    min=0,
                    width=24,
                    height=7,
                    description="Number of GPUs with each clock-throttle reason active (idle left out).",
                ),
            ],
        ),
        Row(
            "GPU memory and links",
            [
                *gpu_memory_and_link_panels("job, instance", "{{instance}}", 12),
                Panel(
                    "table",
                    "GPUs needing a reset or service",
                    [
                        Query(
                            f"max by (job, instance, hw_id) ({sel('otel_forge.gpu.memory.remap.failed', *GPUS)}) > 0",
                            instant=True,
                            fmt="table",
                        ),
                        Query(
                            f"max by (job, instance, hw_id) ({sel('otel_forge.gpu.memory.remap.pending', *GPUS)}) > 0",
                            instant=True,
                            fmt="table",
                        ),
                    ],
                    unit="none",
                    width=24,
                    height=6,
                    thresholds=[(None, "red")],
                    transformations=table_of(
                        2,
                        rename={
                            "instance": "node",
                            "hw_id": "GPU",
                            "Value #A": "remap failed",
                            "Value #B": "remap pending",
                        },
                    ),
                    description="GPUs whose row remapping failed (service the GPU) or waits for a reset (reset it "
                    "when the job allows). " + ZERO_IS_NORMAL,
                ),
            ],
        ),
        Row(
            "Events and agents",
            [
                Panel(
                    "table",
                    "XID and ECC events",
                    [
                        Query(
                            f"max by (job, instance, hw_id, otel_forge_gpu_xid) "
                            f"(max_over_time({sel('otel_forge.gpu.xid.errors', *GPUS)}[$__range])) > 0",
                            instant=True,
                            fmt="table",
                        ),
                        Query(
                            f"sum by (job, instance, hw_id, error_type) "
                            f"(increase({sel('hw.errors', *GPUS)}[$__range])) > 0",
                            instant=True,
                            fmt="table",
                        ),
                    ],
                    unit="none",
                    width=14,
                    height=9,
                    thresholds=[(None, "red")],
                    transformations=table_of(
                        2,
                        rename={
                            "instance": "node",
                            "hw_id": "GPU",
                            "otel_forge_gpu_xid": "XID",
                            "error_type": "ECC",
                            "Value #A": "XID events since agent start",
                            "Value #B": "ECC errors in range",
                        },
                    ),
                    description="XID events (counted since the agent started, for GPUs that had any in the range) "
                    "and ECC errors in the range. " + ZERO_IS_NORMAL,
                ),
                Panel(
                    "table",
                    "Agents",
                    [
                        Query(up, instant=True, fmt="table"),
                        Query(
                            f"max by (job, instance, host_name, otel_forge_node_id) (target_info{{{JOB}, {NODE}}})",
                            instant=True,
                            fmt="table",
                        ),
                    ],
                    unit="none",
                    width=10,
                    height=9,
                    mappings=up_down_mappings(),
                    thresholds=[(None, "red"), (1, "green")],
                    transformations=table_of(
                        2,
                        exclude=["Value #B"],
                        rename={
                            "instance": "node",
                            "host_name": "host",
                            "otel_forge_node_id": "node id",
                            "Value #A": "agent",
                        },
                    ),
                    description="Every agent of the selected jobs: UP while Prometheus scrapes it (or, through a "
                    "Collector, while its hardware reads go on), DOWN otherwise.",
                ),
            ],
        ),
    ]
    straggler = custom_variable(
        "straggler_ratio",
        "Straggler below x median",
        ["0.5", "0.7", "0.8", "0.9"],
        "0.8",
        "A node is a straggler when its mean GPU utilization is below this fraction of its job's median.",
    )
    return dashboard(
        "otel-forge-fleet",
        "otel-forge / Fleet",
        "All nodes of a job: GPU utilization by node and GPU, stragglers, power and energy, temperature "
        "outliers, XID/ECC events and agents up or down.",
        [datasource_variable(), job_variable(), node_variable(multi=True), gpu_variable(), straggler],
        rows,
    )
