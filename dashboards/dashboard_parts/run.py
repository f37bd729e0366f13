"""The run dashboard: the nodes of one MLflow run, the slow one first, and its training's progress."""

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
    link,
    node_variable,
    prometheus_annotation,
    query_variable,
    table_of,
    textbox_variable,
)
from dashboard_parts.queries import (
    GENERAL,
    GPM_NOTE,
    GPUS,
    HOST,
    IB_NOTE,
    JOB,
    MEM_USED,
    NODE,
    PCIE,
    PCIE_NOTE,
    RECEIVED_NOTE,
    RUN,
    SIGNAL,
    SM_CLOCK,
    TENSOR,
    ZERO_IS_NORMAL,
    gpu_activity,
    in_run,
    per_gpu,
    run_info,
    sel,
)
from dashboard_parts.rows import run_progress_row


def run_dashboard() -> dict[str, Any]:
    info_all = sel("otel_forge.run.info", JOB)
    # MLflow's direct run page (route runPageDirect, /runs/:runUuid) finds the run's experiment itself:
    # no link needs the experiment id, which an agent may not know.
    mlflow_run_url = "${tracking_uri}/#/runs/${run}"
    row_link = "${tracking_uri}/#/runs/${__data.fields.mlflow_run_id}"

    def gpus(metric: str, by: str = "", *matchers: str) -> str:
        return in_run(per_gpu(metric, *GPUS, *matchers, by=by))

    def host(expr: str) -> str:
        return in_run(f"max by (job, instance) ({expr})")

    def node_mean(metric: str, *matchers: str) -> str:
        return in_run(f"avg by (job, instance) ({sel(metric, *GPUS, *matchers)})")

    # Nodes of this job: each node against the run's median (recording-rules.yml computes the same).
    activity_range = in_run(gpu_activity("$__range"), over_range=True)
    activity_ratio = (
        f"max by (job, instance, otel_forge_node_id) ({activity_range} / on ({SIGNAL}) group_left () "
        f"(quantile by ({SIGNAL}) (0.5, {activity_range}) > 0))"
    )

    def ratio_to_median(expr: str) -> str:
        return f"{expr} / on () group_left () (quantile(0.5, {expr}) > 0)"

    power_range = in_run(f"sum by (job, instance) (avg_over_time({sel('hw.power', *GPUS)}[$__range]))", over_range=True)
    network_range = in_run(
        f"sum by (job, instance) (increase({sel('system.network.io', *HOST)}[$__range]))", over_range=True
    )
    iowait = sel("system.cpu.utilization", *HOST, 'cpu_mode="iowait"', 'cpu_logical_number=""')
    iowait_range = in_run(f"max by (job, instance) (avg_over_time({iowait}[$__range]))", over_range=True)
    iowait_now = in_run(f"max by (job, instance) ({iowait})")
    activity_now = in_run(gpu_activity())
    power_now = in_run(f"sum by (job, instance) ({sel('hw.power', *GPUS)})")

    run_energy = in_run(f"sum by (job, instance) (increase({sel('hw.energy', *GPUS)}[$__range]))", over_range=True)

    # What the agents received over OTLP for the run (--otlp-receiver): the run's otlp/... keys, by key.
    received = f"max by (otel_forge_mlflow_key) ({sel('otel_forge.otlp.received', JOB, RUN)})"
    rows = [
        Row(
            "Run",
            [
                Panel(
                    "table",
                    "Run and its nodes",
                    [
                        Query(
                            "max by (mlflow_run_id, mlflow_run_name, mlflow_experiment_id, otel_forge_node_id, "
                            "instance) "
                            f"(last_over_time({sel('otel_forge.run.info', JOB, NODE, RUN)}[$__range]))",
                            instant=True,
                            fmt="table",
                        ),
                        Query(
                            f"min by (instance) (min_over_time(timestamp({sel('otel_forge.run.info', JOB, NODE, RUN)})"
                            f"[$__range:$__interval])) * 1000",
                            instant=True,
                            fmt="table",
                        ),
                        Query(
                            f"max by (instance) (max_over_time(timestamp({sel('otel_forge.run.info', JOB, NODE, RUN)})"
                            f"[$__range:$__interval])) * 1000",
                            instant=True,
                            fmt="table",
                        ),
                    ],
                    unit="none",
                    width=16,
                    height=6,
                    links=[link("Open the run in MLflow", row_link)],
                    transformations=table_of(
                        3,
                        exclude=["Value #A"],
                        time_fields=["Value #B", "Value #C"],
                        rename={
                            "mlflow_run_id": "run id",
                            "mlflow_run_name": "run name",
                            "mlflow_experiment_id": "experiment",
                            "otel_forge_node_id": "node id",
                            "instance": "node",
                            "Value #B": "first seen in range",
                            "Value #C": "last seen in range",
                        },
                    ),
                    description="The run's nodes, from otel_forge_run_info (1 while an agent serves the run); "
                    "click a row to open the run in the MLflow UI at $tracking_uri. The run name and experiment "
                    "are empty where the agent was not told them (a standalone otel-forge monitor --run-id "
                    "without MLFLOW_EXPERIMENT_ID).",
                ),
                Panel(
                    "stat",
                    "Nodes in the run",
                    [Query(f"count({run_info(over_range=True)})", instant=True)],
                    unit="none",
                    width=4,
                    height=6,
                ),
                Panel(
                    "stat",
                    "GPU energy of the run's nodes over the range",
                    [Query(f"sum({run_energy})", instant=True)],
                    unit="joule",
                    width=4,
                    height=6,
                ),
            ],
        ),
        run_progress_row(),
        Row(
            "GPUs of the run",
            [
                Panel(
                    "heatmap",
                    "GPU utilization by node and GPU",
                    [Query(gpus("hw.gpu.utilization", "", GENERAL), "{{otel_forge_node_id}} GPU {{hw_id}}")],
                    unit="percentunit",
                    width=24,
                    height=9,
                ),
                Panel(
                    "timeseries",
                    "GPU utilization",
                    [Query(gpus("hw.gpu.utilization", "", GENERAL), "{{otel_forge_node_id}} GPU {{hw_id}}")],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                ),
                Panel(
                    "timeseries",
                    "GPU memory used",
                    [Query(gpus("hw.gpu.memory.utilization"), "{{otel_forge_node_id}} GPU {{hw_id}}")],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                ),
                Panel(
                    "timeseries",
                    "GPU activity vs utilization",
                    [
                        Query(node_mean("otel_forge.gpu.sm.activity"), "{{otel_forge_node_id}} SM activity"),
                        Query(node_mean("hw.gpu.utilization", GENERAL), "{{otel_forge_node_id}} utilization"),
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                    description="Each node's mean over its GPUs. " + GPM_NOTE,
                ),
                Panel(
                    "timeseries",
                    "Tensor and DRAM activity",
                    [
                        Query(node_mean("otel_forge.gpu.pipe.activity", TENSOR), "{{otel_forge_node_id}} tensor pipe"),
                        Query(node_mean("otel_forge.gpu.dram.activity"), "{{otel_forge_node_id}} DRAM"),
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                    description="Each node's mean over its GPUs: tensor-core pipe and DRAM activity (NVML GPM, "
                    "Hopper and later; empty on older GPUs).",
                ),
                Panel(
                    "timeseries",
                    "GPU power vs limit, per node",
                    [
                        Query(
                            in_run(f"sum by (job, instance) ({sel('hw.power', *GPUS)})"), "{{otel_forge_node_id}} power"
                        ),
                        Query(
                            in_run(f"sum by (job, instance) ({sel('otel_forge.gpu.power.limit', *GPUS)})"),
                            "{{otel_forge_node_id}} limit",
                        ),
                    ],
                    unit="watt",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "GPU temperature",
                    [Query(gpus("hw.temperature"), "{{otel_forge_node_id}} GPU {{hw_id}}")],
                    unit="celsius",
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "SM clock",
                    [
                        Query(
                            in_run(
                                f"max by (job, instance, hw_id) "
                                f"({sel('otel_forge.gpu.clock.frequency', *GPUS, SM_CLOCK)})"
                            ),
                            "{{otel_forge_node_id}} GPU {{hw_id}}",
                        )
                    ],
                    unit="hertz",
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "PCIe throughput",
                    [
                        Query(
                            in_run(
                                f"sum by (job, instance, network_io_direction) "
                                f"(rate({sel('hw.gpu.io', *GPUS, PCIE)}[$__rate_interval]))"
                            ),
                            "{{otel_forge_node_id}} {{network_io_direction}}",
                        )
                    ],
                    unit="Bps",
                    min=0,
                    width=12,
                    description=PCIE_NOTE,
                ),
                Panel(
                    "table",
                    "XID and ECC events",
                    [
                        Query(
                            in_run(
                                f"max by (job, instance, hw_id, otel_forge_gpu_xid) "
                                f"(max_over_time({sel('otel_forge.gpu.xid.errors', *GPUS)}[$__range])) > 0",
                                over_range=True,
                            ),
                            instant=True,
                            fmt="table",
                        ),
                        Query(
                            in_run(
                                f"sum by (job, instance, hw_id, error_type) "
                                f"(increase({sel('hw.errors', *GPUS)}[$__range])) > 0",
                                over_range=True,
                            ),
                            instant=True,
                            fmt="table",
                        ),
                    ],
                    unit="none",
                    width=12,
                    thresholds=[(None, "red")],
                    transformations=table_of(
                        2,
                        exclude=["job", "instance"],
                        rename={
                            "otel_forge_node_id": "node",
                            "hw_id": "GPU",
                            "otel_forge_gpu_xid": "XID",
                            "error_type": "ECC",
                            "Value #A": "XID events since agent start",
                            "Value #B": "ECC errors in range",
                        },
                    ),
                    description="XID events and ECC errors on the run's GPUs. " + ZERO_IS_NORMAL,
                ),
            ],
        ),
        Row(
            "Nodes of this job",
            [
                Panel(
                    "table",
                    "Nodes of this job, slowest first",
                    [
                        Query(activity_ratio, instant=True, fmt="table"),
                        Query(ratio_to_median(power_range), instant=True, fmt="table"),
                        Query(ratio_to_median(network_range), instant=True, fmt="table"),
                    ],
                    unit="percentunit",
                    decimals=1,
                    width=14,
                    height=9,
                    thresholds=[(None, "red"), (0.8, "orange"), (0.9, "green")],
                    sort_by="GPU activity / median",
                    transformations=table_of(
                        3,
                        exclude=["job"],
                        rename={
                            "otel_forge_node_id": "node id",
                            "instance": "node",
                            "Value #A": "GPU activity / median",
                            "Value #B": "GPU power / median",
                            "Value #C": "network / median",
                        },
                    ),
                    description="Each node of the run over the range against the run's median node (100% = the "
                    "median): GPU activity (SM activity where the GPUs have NVML GPM, else utilization), GPU "
                    "power and network bytes. Below 80% of the median GPU activity (red) the node is the slow "
                    "one: in a synchronous job the others wait for it (alert OtelForgeStragglerNode).",
                ),
                Panel(
                    "stat",
                    "GPU activity / job median",
                    [Query(activity_ratio, "{{otel_forge_node_id}}", instant=True)],
                    unit="percentunit",
                    decimals=0,
                    width=10,
                    height=9,
                    thresholds=[(None, "red"), (0.8, "orange"), (0.9, "green")],
                    description="One tile per node: its mean GPU activity over the range / the run's median.",
                ),
                Panel(
                    "timeseries",
                    "Node GPU activity vs the job's median",
                    [
                        Query(activity_now, "{{otel_forge_node_id}} ({{otel_forge_gpu_activity_signal}})"),
                        Query(
                            f"quantile by ({SIGNAL}) (0.5, {activity_now})",
                            "median ({{otel_forge_gpu_activity_signal}})",
                        ),
                    ],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=12,
                    legend_table=True,
                    description="Each node's mean GPU activity (SM activity with NVML GPM, else utilization) and "
                    "the median of the run's nodes.",
                ),
                Panel(
                    "timeseries",
                    "Node GPU power vs the job's median",
                    [
                        Query(power_now, "{{otel_forge_node_id}}"),
                        Query(f"quantile(0.5, {power_now})", "median"),
                    ],
                    unit="watt",
                    min=0,
                    width=12,
                    legend_table=True,
                ),
                Panel(
                    "timeseries",
                    "CPU iowait per node",
                    [
                        Query(iowait_now, "{{otel_forge_node_id}}"),
                        Query(f"quantile(0.5, {iowait_now})", "median"),
                    ],
                    unit="percentunit",
                    min=0,
                    width=12,
                    legend_table=True,
                    description="Fraction of CPU time waiting on I/O: a node above the others reads its data "
                    "(or writes its checkpoints) slower.",
                ),
                Panel(
                    "table",
                    "CPU iowait over the range",
                    [Query(iowait_range, instant=True, fmt="table")],
                    unit="percentunit",
                    decimals=2,
                    width=12,
                    transformations=table_of(
                        1,
                        exclude=["job"],
                        rename={"otel_forge_node_id": "node id", "instance": "node", "Value": "iowait"},
                    ),
                ),
            ],
        ),
        Row(
            "Hosts of the run",
            [
                Panel(
                    "timeseries",
                    "CPU busy",
                    [Query(host(sel("otel_forge.cpu.utilization", *HOST)), "{{otel_forge_node_id}}")],
                    unit="percentunit",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Memory used",
                    [Query(host(sel("system.memory.utilization", *HOST, MEM_USED)), "{{otel_forge_node_id}}")],
                    unit="percentunit",
                    min=0,
                    max=1,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Training process CPU",
                    [
                        Query(
                            in_run(f"sum by (job, instance) ({sel('process.cpu.utilization', *HOST)})"),
                            "{{otel_forge_node_id}}",
                        )
                    ],
                    unit="percentunit",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Disk throughput",
                    [
                        Query(
                            in_run(
                                f"sum by (job, instance, disk_io_direction) "
                                f"(rate({sel('system.disk.io', *HOST)}[$__rate_interval]))"
                            ),
                            "{{otel_forge_node_id}} {{disk_io_direction}}",
                        )
                    ],
                    unit="Bps",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "Network throughput",
                    [
                        Query(
                            in_run(
                                f"sum by (job, instance, network_io_direction) "
                                f"(rate({sel('system.network.io', *HOST)}[$__rate_interval]))"
                            ),
                            "{{otel_forge_node_id}} {{network_io_direction}}",
                        )
                    ],
                    unit="Bps",
                    min=0,
                    width=8,
                ),
                Panel(
                    "timeseries",
                    "InfiniBand throughput",
                    [
                        Query(
                            in_run(
                                f"sum by (job, instance, network_io_direction) "
                                f"(rate({sel('otel_forge.infiniband.io', *HOST)}[$__rate_interval]))"
                            ),
                            "{{otel_forge_node_id}} {{network_io_direction}}",
                        )
                    ],
                    unit="Bps",
                    min=0,
                    width=8,
                    description="Bytes per second over each node's InfiniBand and RoCE ports, summed: the fabric "
                    "the job's collectives use. " + IB_NOTE,
                ),
                Panel(
                    "timeseries",
                    "MLflow delivery",
                    [
                        Query(
                            in_run(
                                f"sum by (job, instance, otel_forge_delivery_outcome) "
                                f"(increase({sel('otel_forge.delivery.windows', *HOST)}[$__rate_interval]))"
                            ),
                            "{{otel_forge_node_id}} {{otel_forge_delivery_outcome}}",
                        )
                    ],
                    unit="short",
                    min=0,
                    width=8,
                    description="The run's MLflow windows per interval by outcome (delivered, retried, spooled, "
                    "dropped).",
                ),
            ],
        ),
        Row(
            "Received over OTLP",
            [
                Panel(
                    "timeseries",
                    "The run's otlp/ keys",
                    [Query(received, "{{otel_forge_mlflow_key}}")],
                    width=14,
                    legend_table=True,
                    description=RECEIVED_NOTE,
                ),
                Panel(
                    "table",
                    "The run's otlp/ keys now",
                    [Query(received, instant=True, fmt="table")],
                    width=10,
                    transformations=table_of(
                        1,
                        exclude=["job", "instance"],
                        rename={"otel_forge_mlflow_key": "MLflow key", "Value": "latest"},
                    ),
                    description=RECEIVED_NOTE,
                ),
            ],
        ),
    ]
    variables = [
        datasource_variable(),
        job_variable(),
        query_variable(
            "run",
            "MLflow run",
            f"label_values({info_all}, mlflow_run_id)",
            sort=0,
            description="An MLflow run that otel_forge agents served (otel_forge_run_info).",
        ),
        query_variable(
            "run_name", "Run name", f"label_values({sel('otel_forge.run.info', JOB, RUN)}, mlflow_run_name)", hide=1
        ),
        node_variable(multi=True, selector=sel("otel_forge.run.info", JOB, RUN)),
        gpu_variable(),
        textbox_variable(
            "tracking_uri",
            "MLflow tracking URI",
            "http://localhost:5000",
            "Base URL of the MLflow UI that the links open.",
        ),
    ]
    annotation = prometheus_annotation(
        "MLflow run",
        f"max by (mlflow_run_id) ({sel('otel_forge.run.info', JOB, RUN)})",
        "MLflow run {{mlflow_run_id}}",
        "run {{mlflow_run_id}}: start and end of the agents serving it",
        "mlflow_run_id",
        "rgba(255, 152, 48, 1)",
    )
    # One link: a dashboard link cannot depend on a variable's value, and the experiment (for an
    # "Experiment in MLflow" link) and the run page's tabs (/runs/<id>/system-metrics) need the
    # experiment id, which a standalone agent may not know. The run page links to both.
    links = [
        link(
            "Run in MLflow",
            mlflow_run_url,
            "The selected run in the MLflow UI (its experiment, and its System metrics tab: the same readings "
            "as MLflow metrics system/<node>/...)",
        )
    ]
    return dashboard(
        "otel-forge-run",
        "otel-forge / MLflow run",
        "One MLflow run: its nodes' GPUs and hosts over the run's time (a group_left join on "
        "otel_forge_run_info), the run's start and end as an annotation, links back to the MLflow UI.",
        variables,
        rows,
        annotations=[annotation],
        links=links,
        time_from="now-6h",
    )
