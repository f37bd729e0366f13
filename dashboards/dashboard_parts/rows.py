"""Rows and panels more than one dashboard shows: GPU memory and links, the container, InfiniBand,
training progress (the run's and the fleet's)."""

from __future__ import annotations

from typing import Any

from dashboard_parts.panels import STALLED_MAPPINGS, Panel, Query, Row, table_of, up_down_mappings
from dashboard_parts.queries import (
    ACTIVITY,
    CONTAINER_NOTE,
    GPU_LINKS,
    GPUS,
    HOST,
    IB_ACTIVE,
    IB_LEGEND,
    IB_NOTE,
    IB_PORT,
    LINKS_NOTE,
    MEMORY_SENSOR,
    PROGRESS_NOTE,
    QUANTILE,
    RANK,
    REMAP_NOTE,
    SLOW_RANK_NOTE,
    STALL_NOTE,
    ZERO_IS_NORMAL,
    in_run,
    per_node,
    per_rank,
    sel,
)
from otel_forge.names import INFINIBAND_LINK_ERRORS


def gpu_memory_and_link_panels(by: str, legend: str, width: int) -> list[Panel]:
    """Memory temperature, GPU-to-GPU traffic, row remapping and PCIe replays: grouped by ``by``."""
    return [
        Panel(
            "timeseries",
            "GPU memory (HBM) temperature",
            [Query(f"max by ({by}) ({sel('hw.temperature', *GPUS, MEMORY_SENSOR)})", legend)],
            unit="celsius",
            width=width,
            description="The memory's own sensor (NVML's memory temperature, amdsmi's VRAM sensor).",
        ),
        Panel(
            "timeseries",
            "NVLink / XGMI throughput",
            [
                Query(
                    f"sum by ({by}, network_io_direction) "
                    f"(rate({sel('hw.gpu.io', *GPUS, GPU_LINKS)}[$__rate_interval]))",
                    f"{legend} {{{{network_io_direction}}}}",
                )
            ],
            unit="Bps",
            min=0,
            width=width,
            description=LINKS_NOTE,
        ),
        Panel(
            "timeseries",
            "Row remapping",
            [
                Query(
                    f"max by ({by}, error_type) ({sel('otel_forge.gpu.memory.remapped_rows', *GPUS)})",
                    f"{legend} remapped {{{{error_type}}}}",
                ),
                Query(f"max by ({by}) ({sel('otel_forge.gpu.memory.remap.pending', *GPUS)})", f"{legend} pending"),
                Query(f"max by ({by}) ({sel('otel_forge.gpu.memory.remap.failed', *GPUS)})", f"{legend} failed"),
            ],
            unit="short",
            min=0,
            width=width,
            description=REMAP_NOTE + "Zero on a healthy GPU.",
        ),
        Panel(
            "timeseries",
            "PCIe replays and NVLink errors",
            [
                Query(
                    f"sum by ({by}) (increase({sel('otel_forge.gpu.pcie.replays', *GPUS)}[$__rate_interval]))",
                    f"{legend} PCIe replays",
                ),
                Query(
                    f"sum by ({by}, error_type) "
                    f"(increase({sel('otel_forge.gpu.nvlink.errors', *GPUS)}[$__rate_interval]))",
                    f"{legend} NVLink {{{{error_type}}}}",
                ),
            ],
            unit="short",
            min=0,
            width=width,
            description="PCIe replays (retransmissions: a bad link or riser when they keep growing) and NVLink "
            "errors per interval. " + ZERO_IS_NORMAL,
        ),
    ]


def container_row() -> Row:
    """The job's cgroup: CPU and memory against its limits, throttling, OOM kills, and pressure."""
    return Row(
        "Container (the job's cgroup)",
        [
            Panel(
                "timeseries",
                "CPU against the limit",
                [
                    Query(f"max({sel('container.cpu.usage', *HOST)})", "used"),
                    Query(f"max({sel('otel_forge.container.cpu.limit', *HOST)})", "limit"),
                ],
                unit="none",
                min=0,
                width=8,
                description="CPUs the job's cgroup used, beside its limit (CFS quota / period, or its cpuset). A "
                "job at its limit is throttled, however idle the machine looks. " + CONTAINER_NOTE,
            ),
            Panel(
                "timeseries",
                "CPU throttling",
                [
                    Query(
                        f"sum(rate({sel('otel_forge.container.cpu.throttled_periods', *HOST)}[$__rate_interval])) / "
                        f"sum(rate({sel('otel_forge.container.cpu.periods', *HOST)}[$__rate_interval]))",
                        "throttled periods",
                    )
                ],
                unit="percentunit",
                min=0,
                max=1,
                width=8,
                description="Share of CFS periods in which the cgroup used its whole quota and was held off the "
                "CPU: the usual reason a data loader starves the GPUs in Kubernetes. " + CONTAINER_NOTE,
            ),
            Panel(
                "timeseries",
                "Memory against the limit",
                [
                    Query(f"max({sel('container.memory.working_set', *HOST)})", "working set"),
                    Query(f"max({sel('container.memory.usage', *HOST)})", "usage (page cache included)"),
                    Query(f"max({sel('otel_forge.container.memory.limit', *HOST)})", "limit"),
                ],
                unit="bytes",
                min=0,
                width=8,
                description="The working set (what the kernel cannot reclaim, what the OOM killer looks at) "
                "beside the limit. " + CONTAINER_NOTE,
            ),
            Panel(
                "timeseries",
                "OOM kills",
                [
                    Query(
                        f"sum(increase({sel('otel_forge.container.memory.oom_kills', *HOST)}[$__rate_interval]))",
                        "killed",
                    )
                ],
                unit="short",
                min=0,
                width=8,
                description="Processes of the job's cgroup the OOM killer ended, per interval. "
                + ZERO_IS_NORMAL
                + " "
                + CONTAINER_NOTE,
            ),
            Panel(
                "timeseries",
                "Pressure (PSI)",
                [
                    Query(
                        f"sum by (otel_forge_pressure_resource, otel_forge_pressure_scope) "
                        f"(rate({sel('otel_forge.pressure.stall.time', *HOST)}[$__rate_interval]))",
                        "{{otel_forge_pressure_resource}} {{otel_forge_pressure_scope}}",
                    )
                ],
                unit="percentunit",
                min=0,
                width=16,
                description="Share of time tasks stalled waiting for CPU, memory or I/O (some: at least one "
                "task; full: all at once), from the job's cgroup on cgroup v2, else the machine's. Empty where "
                "the kernel has no PSI.",
            ),
        ],
    )


def infiniband_row() -> Row:
    """The node's InfiniBand and RoCE ports: traffic against the link rate, errors, and their state."""
    return Row(
        "InfiniBand and RoCE",
        [
            Panel(
                "timeseries",
                "InfiniBand throughput",
                [
                    Query(
                        f"sum by ({IB_PORT}, network_io_direction) "
                        f"(rate({sel('otel_forge.infiniband.io', *HOST)}[$__rate_interval]))",
                        f"{IB_LEGEND} {{{{network_io_direction}}}}",
                    ),
                    Query(
                        f"max by ({IB_PORT}) ({sel('otel_forge.infiniband.rate', *HOST)})",
                        f"{IB_LEGEND} link rate",
                    ),
                ],
                unit="Bps",
                min=0,
                width=12,
                legend_table=True,
                description="Bytes per second over each port, by direction, beside the port's link rate (a port "
                "that trained down to fewer lanes or a lower speed shows a lower line). Link layer infiniband, or "
                "ethernet for RoCE. " + IB_NOTE,
            ),
            Panel(
                "timeseries",
                "InfiniBand errors",
                [
                    Query(
                        f"sum by ({IB_PORT}, error_type) "
                        f"(increase({sel('otel_forge.infiniband.errors', *HOST)}[$__rate_interval]))",
                        f"{IB_LEGEND} {{{{error_type}}}}",
                    )
                ],
                unit="short",
                min=0,
                width=12,
                legend_table=True,
                description="Error counters per port in each interval, by counter (`error_type`: "
                + ", ".join(INFINIBAND_LINK_ERRORS)
                + " say the link is sick; discards, constraint errors and the transport's counters can also grow "
                "with congestion). " + ZERO_IS_NORMAL,
            ),
            Panel(
                "timeseries",
                "InfiniBand ports active",
                [Query(f"max by ({IB_PORT}) ({sel('otel_forge.infiniband.status', *HOST, IB_ACTIVE)})", IB_LEGEND)],
                unit="none",
                min=0,
                max=1,
                width=12,
                mappings=up_down_mappings(),
                description="1 while a port's state is active, 0 when it leaves it (down, init, armed): a port "
                "that drops during a run stalls every collective across the fabric. " + IB_NOTE,
            ),
            Panel(
                "table",
                "InfiniBand ports",
                [
                    Query(
                        f"max by ({IB_PORT}, otel_forge_infiniband_link_layer, otel_forge_infiniband_state) "
                        f"({sel('otel_forge.infiniband.status', *HOST)}) == 1",
                        instant=True,
                        fmt="table",
                    )
                ],
                unit="none",
                width=12,
                transformations=table_of(
                    1,
                    rename={
                        "otel_forge_infiniband_device": "device",
                        "otel_forge_infiniband_port": "port",
                        "otel_forge_infiniband_link_layer": "link layer",
                        "otel_forge_infiniband_state": "state",
                    },
                    exclude=["Value"],
                ),
                description="Each port, its link layer (ethernet: RoCE) and its state now. " + IB_NOTE,
            ),
        ],
    )


def run_progress_row() -> Row:
    """The run dashboard's training: throughput, MFU, goodput, each rank's steps, stalls and the slow rank."""

    def node(metric: str) -> str:
        return in_run(per_node(metric))

    def ranks(metric: str, by: str = "") -> str:
        return in_run(per_rank(metric, by=by))

    def tile(title: str, expr: str, unit: str, description: str, **options: Any) -> Panel:
        return Panel("stat", title, [Query(expr)], unit=unit, width=3, height=5, description=description, **options)

    legend = "rank {{otel_forge_training_rank}} ({{otel_forge_node_id}})"
    activity_share = in_run(
        f"max by (job, instance, {ACTIVITY}) (rate({sel('otel_forge.training.time', *HOST)}[$__rate_interval]))"
    )
    return Row(
        "Progress",
        [
            tile(
                "Steps per second",
                f"avg({node('otel_forge.training.steps')})",
                "short",
                "The job's optimizer steps per second: each node's median rank over its last steps (0 while the "
                "job starts, checkpoints, evaluates or stalls), the mean over the run's nodes. " + PROGRESS_NOTE,
                decimals=2,
            ),
            tile(
                "Samples per second",
                f"avg({node('otel_forge.training.samples')})",
                "short",
                "The whole job's samples per second: steps per second x OTEL_FORGE_SAMPLES_PER_STEP (the global "
                "batch). Empty where that is not set.",
            ),
            tile(
                "Tokens per second",
                f"avg({node('otel_forge.training.tokens')})",
                "short",
                "The whole job's tokens per second: steps per second x OTEL_FORGE_TOKENS_PER_STEP. Empty where "
                "that is not set.",
            ),
            tile(
                "MFU",
                f"avg({node('otel_forge.training.mfu')})",
                "percentunit",
                "Model FLOPs utilisation: FLOPs per step (OTEL_FORGE_FLOPS_PER_STEP, else 6 x "
                "OTEL_FORGE_MODEL_PARAMETERS x OTEL_FORGE_TOKENS_PER_STEP) x steps per second / (the job's GPUs x "
                "one GPU's dense BF16 peak, OTEL_FORGE_GPU_PEAK_FLOPS where the model is not known). Empty "
                "without FLOPs per step.",
                decimals=1,
                thresholds=[(None, "orange"), (0.3, "green")],
            ),
            tile(
                "Goodput",
                f"avg({node('otel_forge.training.goodput')})",
                "percentunit",
                "Productive time / wall time since the job started (the mean over the run's nodes); 'Time by "
                "activity' shows where the rest went.",
                decimals=1,
                thresholds=[(None, "red"), (0.8, "orange"), (0.9, "green")],
            ),
            tile(
                "Nodes stalled",
                f"sum({node('otel_forge.training.stalled')})",
                "none",
                "Nodes whose training is stalled now. " + STALL_NOTE,
                thresholds=[(None, "green"), (1, "red")],
            ),
            tile(
                "Slow ranks",
                f"sum({ranks('otel_forge.training.slow_rank')})",
                "none",
                "Ranks named slow now. " + SLOW_RANK_NOTE,
                thresholds=[(None, "green"), (1, "orange")],
            ),
            tile(
                "Energy per step",
                f"sum({node('otel_forge.training.energy.per_step')})",
                "joule",
                "The job's GPU energy per optimizer step since it started: each node's GPU energy (hw.energy) "
                "per step, summed over the run's nodes.",
            ),
            Panel(
                "timeseries",
                "Step, per rank",
                [Query(ranks("otel_forge.training.step"), legend)],
                unit="none",
                description="Each rank's optimizer steps so far (else the last step it logged).",
            ),
            Panel(
                "timeseries",
                "Step time, per rank (p50, p95)",
                [
                    Query(
                        ranks("otel_forge.training.step.duration", by=QUANTILE),
                        legend + " {{otel_forge_training_quantile}}",
                    )
                ],
                unit="s",
                min=0,
                description="Each rank's step time over its last 64 steps: the median and the 95th percentile.",
            ),
            Panel(
                "timeseries",
                "Time since the last step, per rank",
                [Query(ranks("otel_forge.training.step.age"), legend)],
                unit="s",
                min=0,
                description="Time since each rank's last step (or checkpoint, evaluation, logged step): it grows "
                "through a stall. " + STALL_NOTE,
            ),
            Panel(
                "timeseries",
                "Own work per step vs the median rank",
                [
                    Query(ranks("otel_forge.training.step.work"), legend),
                    Query(f"quantile(0.5, {ranks('otel_forge.training.step.work')})", "median rank"),
                ],
                unit="s",
                min=0,
                width=12,
                legend_table=True,
                description="Each rank's own work per step (median over its last steps) and the median of the "
                "run's ranks: in a synchronous job every rank's step takes as long as the slowest one's own work, "
                "so the step times alike and the own work not. " + SLOW_RANK_NOTE,
            ),
            Panel(
                "table",
                "Ranks, slowest first",
                [Query(ranks("otel_forge.training.step.work.ratio"), instant=True, fmt="table")],
                unit="percentunit",
                decimals=0,
                width=12,
                thresholds=[(None, "green"), (1.2, "red")],
                sort_by="own work / median",
                sort_desc=True,
                transformations=table_of(
                    1,
                    exclude=["job"],
                    rename={
                        "otel_forge_node_id": "node id",
                        "instance": "node",
                        RANK: "rank",
                        "Value": "own work / median",
                    },
                ),
                description="Each rank's own work per step / the median rank's of its node (100% = the median), "
                "highest first; red from 120%, the default OTEL_FORGE_SLOW_RANK_RATIO. " + SLOW_RANK_NOTE,
            ),
            Panel(
                "state-timeline",
                "Stalled",
                [
                    Query(
                        ranks("otel_forge.training.stalled"),
                        "{{otel_forge_node_id}} (rank named: {{otel_forge_training_rank}})",
                    )
                ],
                unit="none",
                width=12,
                mappings=STALLED_MAPPINGS,
                thresholds=[(None, "green"), (1, "red")],
                color_mode="thresholds",
                description=STALL_NOTE,
            ),
            Panel(
                "timeseries",
                "Time by activity",
                [Query(f"avg by ({ACTIVITY}) ({activity_share})", "{{otel_forge_training_activity}}")],
                unit="percentunit",
                min=0,
                width=12,
                stack=True,
                legend_table=True,
                description="The job's wall time by activity, as a share of each interval (the mean over the "
                "run's nodes; the legend's mean is the share over the range): productive, startup, checkpointing, "
                "evaluating, stalled, restart_lost (work since the last checkpoint, redone after a restart), "
                "other. Goodput is the productive share since the job started.",
            ),
            Panel(
                "timeseries",
                "Steps per second by node",
                [Query(node("otel_forge.training.steps"), "{{otel_forge_node_id}}")],
                unit="short",
                min=0,
                width=12,
                description="Each node's median rank's steps per second (0 while not productive).",
            ),
            Panel(
                "timeseries",
                "GPU energy per step by node",
                [
                    Query(node("otel_forge.training.energy.per_step"), "{{otel_forge_node_id}}"),
                    Query(f"sum({node('otel_forge.training.energy.per_step')})", "job"),
                ],
                unit="joule",
                min=0,
                width=12,
                description="Each node's GPU energy per optimizer step since the job started, and the job's (their "
                "sum).",
            ),
        ],
    )


def fleet_progress_row() -> Row:
    """The fleet dashboard's training: per job and node, steps per second, stalls, goodput, slow ranks."""
    return Row(
        "Training progress",
        [
            Panel(
                "stat",
                "Nodes stalled",
                [Query(f"count({per_node('otel_forge.training.stalled')} == 1) or vector(0)", instant=True)],
                unit="none",
                width=6,
                height=4,
                thresholds=[(None, "green"), (1, "red")],
                description="Nodes whose training is stalled now. " + STALL_NOTE,
            ),
            Panel(
                "stat",
                "Slow ranks",
                [Query(f"count({per_rank('otel_forge.training.slow_rank')} == 1) or vector(0)", instant=True)],
                unit="none",
                width=6,
                height=4,
                thresholds=[(None, "green"), (1, "orange")],
                description="Ranks named slow now. " + SLOW_RANK_NOTE,
            ),
            Panel(
                "stat",
                "Goodput (mean)",
                [Query(f"avg({per_node('otel_forge.training.goodput')})")],
                unit="percentunit",
                decimals=1,
                width=6,
                height=4,
                thresholds=[(None, "red"), (0.8, "orange"), (0.9, "green")],
                description="Productive time / wall time since each job started, the mean over the nodes. "
                + PROGRESS_NOTE,
            ),
            Panel(
                "stat",
                "MFU (mean)",
                [Query(f"avg({per_node('otel_forge.training.mfu')})")],
                unit="percentunit",
                decimals=1,
                width=6,
                height=4,
                thresholds=[(None, "orange"), (0.3, "green")],
                description="Model FLOPs utilisation, the mean over the nodes that know their job's FLOPs per step.",
            ),
            Panel(
                "timeseries",
                "Steps per second by node",
                [Query(per_node("otel_forge.training.steps"), "{{job}} {{instance}}")],
                unit="short",
                min=0,
                description="Each node's median rank's optimizer steps per second (0 while not productive). "
                + PROGRESS_NOTE,
            ),
            Panel(
                "timeseries",
                "Goodput by node",
                [Query(per_node("otel_forge.training.goodput"), "{{job}} {{instance}}")],
                unit="percentunit",
                min=0,
                max=1,
                description="Productive time / wall time since the job started, per node.",
            ),
            Panel(
                "state-timeline",
                "Stalled, by node",
                [
                    Query(
                        per_rank("otel_forge.training.stalled"),
                        "{{instance}} (rank named: {{otel_forge_training_rank}})",
                    )
                ],
                unit="none",
                mappings=STALLED_MAPPINGS,
                thresholds=[(None, "green"), (1, "red")],
                color_mode="thresholds",
                description=STALL_NOTE,
            ),
            Panel(
                "table",
                "Ranks named slow",
                [
                    Query(
                        f"{per_rank('otel_forge.training.step.work.ratio')} "
                        f"and on (job, instance, {RANK}) ({per_rank('otel_forge.training.slow_rank')} == 1)",
                        instant=True,
                        fmt="table",
                    )
                ],
                unit="percentunit",
                decimals=0,
                width=24,
                height=6,
                thresholds=[(None, "orange")],
                transformations=table_of(1, rename={"instance": "node", RANK: "rank", "Value": "own work / median"}),
                description="The ranks named slow, with their own work per step / the median rank's of their "
                "node. Empty when no rank is. " + SLOW_RANK_NOTE,
            ),
        ],
    )
