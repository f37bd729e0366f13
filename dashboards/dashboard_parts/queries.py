"""Metric names as the Prometheus exporter names them, the selectors and the query fragments every
dashboard shares (a node's GPUs, its job's nodes, a run's nodes), and the notes panels repeat."""

from __future__ import annotations

from typing import Any

from otel_forge.names import METRICS, Kind, MetricSpec

# --- metric names ---------------------------------------------------------------------------------

# NVML GPM metrics (Hopper and later): the "GPU activity" panels, where the GPU has them.
GPM_METRIC_NAMES = (
    "otel_forge.gpu.sm.activity",
    "otel_forge.gpu.sm.occupancy",
    "otel_forge.gpu.pipe.activity",
    "otel_forge.gpu.dram.activity",
    "otel_forge.gpu.io.rate",
)
GPM_METRICS: tuple[MetricSpec, ...] = tuple(
    spec for spec in METRICS if spec.name in GPM_METRIC_NAMES and spec.source == "nvidia"
)
SPECS: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}


def prometheus_name(spec: MetricSpec) -> str:
    """The name the OTel Prometheus exporter gives ``spec`` (without the Collector's ``_ratio``)."""
    from opentelemetry.exporter.prometheus import map_unit  # the exporter's own UCUM -> suffix table

    name = spec.name.replace(".", "_")
    suffix = map_unit(spec.unit)
    if suffix and not name.endswith("_" + suffix):
        name += "_" + suffix
    if spec.kind is Kind.COUNTER:
        name += "_total"
    return name


def has_ratio_form(spec: MetricSpec) -> bool:
    """Through a Collector a unit-1 metric may end in ``_ratio`` (gauges do; matching all unit-1 is harmless)."""
    return spec.unit == "1"


def sel(metric: str, *matchers: str) -> str:
    """A selector of otel_forge metric ``metric`` (its OTel name) that matches both name forms."""
    spec = SPECS[metric]  # KeyError: the dashboards name a metric otel_forge does not have
    name = prometheus_name(spec)
    if has_ratio_form(spec):
        return "{" + ", ".join((f'__name__=~"{name}(_ratio)?"', *matchers)) + "}"
    return name + ("{" + ", ".join(matchers) + "}" if matchers else "")


# Label matchers, as the dashboards' variables fill them.
JOB = 'job=~"$job"'
NODE = 'instance=~"$node"'
GPU = 'hw_id=~"$gpu"'
RUN = 'mlflow_run_id="$run"'
HOST = (JOB, NODE)
MEM_USED = 'system_memory_state="used"'
GPU_OK = 'hw_state="ok"'
NOT_IDLE = 'otel_forge_gpu_throttle_reason!="gpu_idle"'
SM_CLOCK = 'otel_forge_gpu_clock="sm"'
GENERAL = 'hw_gpu_task="general"'  # hw.gpu.utilization of the GPU itself, not its video encoder / decoder
PCIE = 'otel_forge_gpu_link="pcie"'
GPU_LINKS = 'otel_forge_gpu_link=~"nvlink|xgmi"'  # GPU-to-GPU links: NVIDIA's NVLink, AMD's XGMI
MEMORY_SENSOR = 'hw_sensor_location="memory"'
NOT_MEMORY_SENSOR = 'hw_sensor_location!="memory"'
TENSOR = 'otel_forge_gpu_pipe="tensor"'
SIGNAL = "otel_forge_gpu_activity_signal"  # which GPU activity a node's series is (recording-rules.yml's label)

GPUS = (JOB, NODE, GPU)


def agent_up(*matchers: str, rate_window: str = "$__rate_interval") -> str:
    """1 per agent that answers, 0 per agent that does not, by (job, instance).

    Scraped directly, Prometheus's ``up`` says it. Through a Collector ``up`` is the Collector's own,
    so an agent counts as up while its hardware-read counter grows (a dead agent's series stay
    frozen in the Collector until they expire).
    """
    reads = sel("otel_forge.collector.reads", *matchers)
    return (
        f"max by (job, instance) (up{{{', '.join(matchers)}}})"
        f" or max by (job, instance) (rate({reads}[{rate_window}]) > bool 0)"
    )


def run_info(*matchers: str, over_range: bool = False) -> str:
    """The run's info series, one per (job, instance); ``over_range``: present anywhere in the range.

    Only job, instance and the node id are kept: the join needs no more, and the experiment id and
    run name may be empty (a standalone ``otel-forge monitor --run-id`` told neither).
    """
    info = sel("otel_forge.run.info", JOB, NODE, RUN, *matchers)
    if over_range:
        info = f"last_over_time({info}[$__range])"
    return f"max by (job, instance, otel_forge_node_id) ({info})"


def in_run(expr: str, over_range: bool = False) -> str:
    """``expr`` (keeping job and instance) restricted to the run's nodes and, as a range query, to its time.

    The join: ``otel_forge_run_info`` is 1 while an agent serves the run; ``group_left`` copies the
    node id onto every series of that agent.
    """
    return f"({expr}) * on (job, instance) group_left (otel_forge_node_id) {run_info(over_range=over_range)}"


BUILTIN_ANNOTATION: dict[str, Any] = {
    "builtIn": 1,
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "enable": True,
    "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)",
    "name": "Annotations & Alerts",
    "type": "dashboard",
}


# --- shared queries -----------------------------------------------------------------------------------


def gpu_util(*m: str) -> str:
    return sel("hw.gpu.utilization", GENERAL, *m)


def per_gpu(metric: str, *m: str, by: str = "") -> str:
    extra = f", {by}" if by else ""
    return f"max by (job, instance, hw_id{extra}) ({sel(metric, *m)})"


def gpu_activity(window: str = "") -> str:
    """Each node's GPU activity by (job, instance), as recording-rules.yml computes it.

    The mean over the node's GPUs of SM activity (NVML GPM, Hopper and later) where the node reports
    it, else of GPU utilization; the label ``otel_forge_gpu_activity_signal`` says which. ``window``:
    each GPU's mean over it first (``$__range`` for "over the range" panels).
    """

    def over(selector: str) -> str:
        return f"avg_over_time({selector}[{window}])" if window else selector

    sm = over(sel("otel_forge.gpu.sm.activity", *GPUS))
    util = over(gpu_util(*GPUS))
    return (
        f'label_replace(avg by (job, instance) ({sm}), "{SIGNAL}", "sm_activity", "", "")'
        f" or on (job, instance) "
        f'label_replace(avg by (job, instance) ({util}), "{SIGNAL}", "utilization", "", "")'
    )


GPM_NOTE = (
    "NVML GPM (Hopper and later): empty on older NVIDIA GPUs and on AMD. Utilization is the fraction of time "
    "a kernel ran; SM activity the fraction of the SMs' time with work resident: a GPU 100% utilized with "
    "its SMs 10% active runs small kernels or waits (memory, communication)."
)
PCIE_NOTE = "Host-to-GPU traffic over PCIe; GPU-to-GPU traffic over NVLink / XGMI has its own panel."
LINKS_NOTE = "GPU-to-GPU traffic over NVLink (NVIDIA, all links summed) or XGMI (AMD). Empty on PCIe-only boards."
REMAP_NOTE = (
    "Memory rows remapped to spares (by the error that caused it), a remap waiting for a GPU reset (pending), "
    "and a remap that failed (no spare left: the GPU needs service). "
)


ZERO_IS_NORMAL = "Empty or zero on a healthy machine."

# InfiniBand and RoCE ports (/sys/class/infiniband): a port is its device and number.
IB_PORT = "otel_forge_infiniband_device, otel_forge_infiniband_port"
IB_LEGEND = "{{otel_forge_infiniband_device}}/{{otel_forge_infiniband_port}}"
IB_ACTIVE = 'otel_forge_infiniband_state="active"'
IB_NOTE = "Empty on a node without InfiniBand or RoCE adapters."


CONTAINER_NOTE = (
    "Empty where the monitored process's cgroup has no CPU or memory limit smaller than the machine (a node "
    "agent beside the jobs: OTEL_FORGE_CGROUP=machine)."
)


# --- training progress ----------------------------------------------------------------------------------

# The training's progress (otel_forge.training.*): each node's `otel-forge run` follows the ranks it starts.
RANK = "otel_forge_training_rank"
ACTIVITY = "otel_forge_training_activity"
QUANTILE = "otel_forge_training_quantile"
PROGRESS_NOTE = (
    "From each node's otel-forge run, which follows the ranks it starts (OTEL_FORGE_PROGRESS, on by default): "
    "empty for nodes whose agent follows no training (a standalone otel-forge monitor)."
)
STALL_NOTE = (
    "A node's training is stalled while none of its ranks has advanced (a step, a checkpoint, an evaluation) for "
    "max(OTEL_FORGE_STALL_FACTOR x the median step, OTEL_FORGE_STALL_FLOOR), 10 x and 120 s by default (alert "
    "OtelForgeTrainingStalled). The rank named is the odd one out of the ranks' stacks (not waiting in a "
    "collective while the others do), none where no single one is; every rank's stacks are in the run's "
    "stalls/ artifacts."
)
SLOW_RANK_NOTE = (
    "A rank's own work per step is its step time less its waits in collectives and backward, where its peers' "
    "slowness shows. A rank at OTEL_FORGE_SLOW_RANK_RATIO (1.2 by default) times the median rank of its node or "
    "more, the slowest for 30 s, is named the slow rank (alert OtelForgeSlowRank)."
)


def per_node(metric: str, *m: str, by: str = "") -> str:
    """One series per agent (job, instance) of a metric of the selected nodes (the training's figures)."""
    extra = f", {by}" if by else ""
    return f"max by (job, instance{extra}) ({sel(metric, *HOST, *m)})"


def per_rank(metric: str, *m: str, by: str = "") -> str:
    """One series per rank (job, instance, rank) of a per-rank metric of the selected nodes."""
    return per_node(metric, *m, by=RANK + (f", {by}" if by else ""))


RECEIVED_NOTE = (
    "The MLflow keys that OTLP metrics sent to the run's agents feed (otel-forge run --otlp-receiver: a "
    "Collector, NCCL Inspector, a trainer's own OpenTelemetry SDK), with the values the run's otlp/... charts "
    "show. Empty where nothing is sent over OTLP."
)
