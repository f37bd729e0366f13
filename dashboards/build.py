"""Builds the Grafana dashboards of ``dashboards/`` from one description: ``python dashboards/build.py``.

Every metric a query names is looked up in otel_forge's metric table (``otel_forge.names.METRICS``)
and turned into the name the OTel Prometheus exporter gives it (``hw.power`` W -> ``hw_power_watts``,
``hw.energy`` J counter -> ``hw_energy_joules_total``). Unit-1 gauges are selected as
``{__name__=~"hw_gpu_utilization(_ratio)?"}``: scraped from the agent they carry no suffix, through an
OpenTelemetry Collector's Prometheus exporter they end in ``_ratio``; one query reads both.

Variables every dashboard has: ``datasource`` (a Prometheus data source; no uid is hard-coded),
``job`` and ``node`` (the ``job`` and ``instance`` labels: scrape job and ``host:port`` when
Prometheus scrapes the agent, ``service.name`` and ``service.instance.id`` through a Collector) and
``gpu`` (``hw_id``). The run dashboard adds ``run`` (an MLflow run id) and ``tracking_uri``.

``python dashboards/build.py --check`` exits 1 when a JSON file differs from what this file builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_forge.names import INFINIBAND_LINK_ERRORS, METRICS, Kind, MetricSpec

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 41  # Grafana 12.0
TAG = "otel-forge"
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}

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


# --- panels -----------------------------------------------------------------------------------------


@dataclass
class Query:
    expr: str
    legend: str = ""
    instant: bool = False
    fmt: str = "time_series"


@dataclass
class Panel:
    """One panel before layout; ``json()`` renders it at a grid position."""

    kind: str  # timeseries | stat | table | heatmap | state-timeline
    title: str
    queries: list[Query]
    description: str = ""
    unit: str = "short"
    width: int = 8
    height: int = 8
    stack: bool = False
    decimals: int | None = None
    min: float | None = None
    max: float | None = None
    thresholds: list[tuple[float | None, str]] = field(default_factory=lambda: [(None, "green")])
    mappings: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    transformations: list[dict[str, Any]] = field(default_factory=list)
    color_mode: str | None = None
    legend_table: bool = False
    no_value: str | None = None
    sort_by: str | None = None  # table: the column to sort by, ascending
    sort_desc: bool = False  # ... descending

    def json(self, panel_id: int, x: int, y: int) -> dict[str, Any]:
        defaults: dict[str, Any] = {
            "unit": self.unit,
            "color": {
                "mode": self.color_mode or ("thresholds" if self.kind in ("stat", "table") else "palette-classic")
            },
            "thresholds": {
                "mode": "absolute",
                "steps": [{"value": value, "color": color} for value, color in self.thresholds],
            },
            "mappings": self.mappings,
        }
        for key in ("decimals", "min", "max"):
            if getattr(self, key) is not None:
                defaults[key] = getattr(self, key)
        if self.links:
            defaults["links"] = self.links
        if self.no_value is not None:
            defaults["noValue"] = self.no_value
        custom, options = _KIND_OPTIONS[self.kind](self)
        if custom is not None:
            defaults["custom"] = custom
        panel: dict[str, Any] = {
            "type": self.kind,
            "id": panel_id,
            "title": self.title,
            "description": self.description,
            "datasource": DS,
            "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "targets": [_target(query, chr(ord("A") + index)) for index, query in enumerate(self.queries)],
            "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options,
        }
        if self.transformations:
            panel["transformations"] = self.transformations
        return panel


def _target(query: Query, ref_id: str) -> dict[str, Any]:
    return {
        "datasource": DS,
        "refId": ref_id,
        "expr": query.expr,
        "legendFormat": query.legend or "__auto",
        "range": not query.instant,
        "instant": query.instant,
        "format": query.fmt,
        "editorMode": "code",
    }


def _timeseries(panel: Panel) -> tuple[dict[str, Any], dict[str, Any]]:
    custom = {
        "drawStyle": "line",
        "lineInterpolation": "linear",
        "lineWidth": 1,
        "fillOpacity": 25 if panel.stack else 8,
        "gradientMode": "none",
        "showPoints": "never",
        "pointSize": 4,
        "spanNulls": False,
        "insertNulls": False,
        "stacking": {"mode": "normal" if panel.stack else "none", "group": "A"},
        "axisPlacement": "auto",
        "axisLabel": "",
        "axisColorMode": "text",
        "axisBorderShow": False,
        "axisCenteredZero": False,
        "barAlignment": 0,
        "scaleDistribution": {"type": "linear"},
        "hideFrom": {"tooltip": False, "legend": False, "viz": False},
        "thresholdsStyle": {"mode": "off"},
    }
    legend = {
        "showLegend": True,
        "displayMode": "table" if panel.legend_table else "list",
        "placement": "right" if panel.legend_table else "bottom",
        "calcs": ["mean", "max", "lastNotNull"] if panel.legend_table else [],
    }
    return custom, {"legend": legend, "tooltip": {"mode": "multi", "sort": "desc"}}


def _stat(panel: Panel) -> tuple[None, dict[str, Any]]:
    return None, {
        "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
        "orientation": "auto",
        "textMode": "auto",
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "wideLayout": True,
        "showPercentChange": False,
    }


def _table(panel: Panel) -> tuple[dict[str, Any], dict[str, Any]]:
    options: dict[str, Any] = {
        "showHeader": True,
        "cellHeight": "sm",
        "footer": {"show": False, "reducer": ["sum"], "fields": ""},
    }
    if panel.sort_by:
        options["sortBy"] = [{"displayName": panel.sort_by, "desc": panel.sort_desc}]
    return {"align": "auto", "cellOptions": {"type": "color-text"}, "inspect": False}, options


def _heatmap(panel: Panel) -> tuple[dict[str, Any], dict[str, Any]]:
    # Not calculated: every series (one per node and GPU) is one row of the heatmap.
    return (
        {"hideFrom": {"tooltip": False, "legend": False, "viz": False}, "scaleDistribution": {"type": "linear"}},
        {
            "calculate": False,
            "cellGap": 1,
            "cellValues": {"unit": panel.unit},
            "color": {
                "mode": "scheme",
                "scheme": "RdYlGn",
                "fill": "dark-orange",
                "scale": "linear",
                "exponent": 0.5,
                "steps": 64,
                "reverse": False,
                "min": 0,
                "max": 1,
            },
            "exemplars": {"color": "rgba(255,0,255,0.7)"},
            "filterValues": {"le": 1e-9},
            "legend": {"show": True},
            "rowsFrame": {"layout": "auto"},
            "showValue": "never",
            "tooltip": {"mode": "single", "yHistogram": False, "showColorScale": True},
            "yAxis": {"axisPlacement": "left", "reverse": True},
        },
    )


def _state_timeline(panel: Panel) -> tuple[dict[str, Any], dict[str, Any]]:
    # One band per series, coloured (and named) by the value mappings: a state over time.
    return (
        {"lineWidth": 0, "fillOpacity": 70, "hideFrom": {"tooltip": False, "legend": False, "viz": False}},
        {
            "showValue": "auto",
            "rowHeight": 0.9,
            "mergeValues": True,
            "alignValue": "left",
            "legend": {"showLegend": False, "displayMode": "list", "placement": "bottom", "calcs": []},
            "tooltip": {"mode": "single", "sort": "none"},
        },
    )


_KIND_OPTIONS = {
    "timeseries": _timeseries,
    "stat": _stat,
    "table": _table,
    "heatmap": _heatmap,
    "state-timeline": _state_timeline,
}


def table_of(
    queries: int = 1, rename: dict[str, str] | None = None, exclude: Sequence[str] = (), time_fields: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Transformations of a table of ``queries`` instant queries: merge them on their labels, tidy the columns."""
    steps: list[dict[str, Any]] = []
    if queries > 1:
        steps.append({"id": "merge", "options": {}})
    if time_fields:
        steps.append(
            {
                "id": "convertFieldType",
                "options": {
                    "fields": {},
                    "conversions": [{"targetField": name, "destinationType": "time"} for name in time_fields],
                },
            }
        )
    steps.append(
        {
            "id": "organize",
            "options": {
                "excludeByName": {
                    "Time": True,
                    "__name__": True,
                    "otel_scope_name": True,
                    "otel_scope_version": True,
                    "otel_scope_schema_url": True,
                    **{name: True for name in exclude},
                },
                "indexByName": {},
                "renameByName": rename or {},
            },
        }
    )
    return steps


def state_mappings(zero: tuple[str, str], one: tuple[str, str]) -> list[dict[str, Any]]:
    """Value mappings of a 0/1 state: (text, colour) for each."""
    return [
        {
            "type": "value",
            "options": {
                "0": {"text": zero[0], "color": zero[1], "index": 0},
                "1": {"text": one[0], "color": one[1], "index": 1},
            },
        }
    ]


def up_down_mappings() -> list[dict[str, Any]]:
    return state_mappings(("DOWN", "red"), ("UP", "green"))


def link(title: str, url: str, tooltip: str = "", blank: bool = True) -> dict[str, Any]:
    """A link (dashboard, panel or data link) in the shape the dashboard schema asks for."""
    return {
        "title": title,
        "type": "link",
        "url": url,
        "icon": "external link",
        "tooltip": tooltip,
        "tags": [],
        "asDropdown": False,
        "targetBlank": blank,
        "includeVars": False,
        "keepTime": False,
    }


def dashboards_link() -> dict[str, Any]:
    return {
        "title": "otel-forge dashboards",
        "type": "dashboards",
        "icon": "external link",
        "tooltip": "",
        "tags": [TAG],
        "asDropdown": True,
        "targetBlank": False,
        "includeVars": True,
        "keepTime": True,
    }


@dataclass
class Row:
    title: str
    panels: list[Panel]


def layout(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """Rows (expanded) and their panels, left to right, wrapping at Grafana's 24 columns."""
    out: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in rows:
        out.append(
            {
                "type": "row",
                "id": next_id,
                "title": row.title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        next_id, y = next_id + 1, y + 1
        x, line_height = 0, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, line_height = 0, y + line_height, 0
            out.append(panel.json(next_id, x, y))
            next_id += 1
            x += panel.width
            line_height = max(line_height, panel.height)
        y += line_height
    return out


# --- variables ------------------------------------------------------------------------------------------


def datasource_variable() -> dict[str, Any]:
    return {
        "type": "datasource",
        "name": "datasource",
        "label": "Data source",
        "query": "prometheus",
        "current": {"text": "default", "value": "default"},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }


def query_variable(
    name: str,
    label: str,
    query: str,
    multi: bool = False,
    include_all: bool = False,
    hide: int = 0,
    description: str = "",
    sort: int = 7,
) -> dict[str, Any]:
    variable: dict[str, Any] = {
        "type": "query",
        "name": name,
        "label": label,
        "description": description,
        "datasource": DS,
        "query": query,
        "definition": query,
        "refresh": 2,
        "sort": sort,
        "multi": multi,
        "includeAll": include_all,
        "current": ({"text": ["All"], "value": ["$__all"]} if multi else {"text": "All", "value": "$__all"})
        if include_all
        else {"text": "", "value": ""},
        "options": [],
        "regex": "",
        "hide": hide,
        "skipUrlSync": False,
    }
    if include_all:
        variable["allValue"] = ".*"
    return variable


def job_variable() -> dict[str, Any]:
    return query_variable(
        "job",
        "Job",
        f"label_values({sel('otel_forge.collector.reads')}, job)",
        multi=True,
        include_all=True,
        description="Prometheus job: the scrape job of the agents, or "
        "service.name when they export through an OpenTelemetry Collector.",
    )


def node_variable(multi: bool, selector: str | None = None) -> dict[str, Any]:
    query = f"label_values({selector or sel('otel_forge.collector.reads', JOB)}, instance)"
    return query_variable(
        "node",
        "Node (instance)",
        query,
        multi=multi,
        include_all=multi,
        description="An agent: host:port of its /metrics endpoint, or service.instance.id "
        "through an OpenTelemetry Collector.",
    )


def gpu_variable() -> dict[str, Any]:
    return query_variable(
        "gpu",
        "GPU",
        f"label_values({sel('hw.gpu.utilization', JOB, NODE)}, hw_id)",
        multi=True,
        include_all=True,
        sort=3,
        description="GPU index (hw.id).",
    )


def custom_variable(name: str, label: str, values: Sequence[str], default: str, description: str) -> dict[str, Any]:
    return {
        "type": "custom",
        "name": name,
        "label": label,
        "description": description,
        "query": ",".join(values),
        "current": {"text": default, "value": default},
        "options": [{"text": value, "value": value, "selected": value == default} for value in values],
        "multi": False,
        "includeAll": False,
        "hide": 0,
        "skipUrlSync": False,
    }


def textbox_variable(name: str, label: str, default: str, description: str) -> dict[str, Any]:
    return {
        "type": "textbox",
        "name": name,
        "label": label,
        "description": description,
        "query": default,
        "current": {"text": default, "value": default},
        "options": [{"text": default, "value": default}],
        "hide": 0,
        "skipUrlSync": False,
    }


BUILTIN_ANNOTATION: dict[str, Any] = {
    "builtIn": 1,
    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
    "enable": True,
    "hide": True,
    "iconColor": "rgba(0, 211, 255, 1)",
    "name": "Annotations & Alerts",
    "type": "dashboard",
}


def prometheus_annotation(name: str, expr: str, title: str, text: str, tags: str, color: str) -> dict[str, Any]:
    """A Prometheus annotation: while the series is >= 1, Grafana draws one region (start to end)."""
    return {
        "name": name,
        "datasource": DS,
        "enable": True,
        "hide": False,
        "iconColor": color,
        "expr": expr,
        "step": "$__interval",
        "titleFormat": title,
        "textFormat": text,
        "tagKeys": tags,
        "useValueForTime": False,
        "target": {"refId": "Anno", "expr": expr, "interval": "", "legendFormat": title},
    }


def dashboard(
    uid: str,
    title: str,
    description: str,
    variables: list[dict[str, Any]],
    rows: Sequence[Row],
    annotations: Iterable[dict[str, Any]] = (),
    links: Iterable[dict[str, Any]] = (),
    time_from: str = "now-1h",
) -> dict[str, Any]:
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": [TAG],
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "refresh": "30s",
        "timezone": "browser",
        "weekStart": "",
        "time": {"from": time_from, "to": "now"},
        "timepicker": {},
        "templating": {"list": variables},
        "annotations": {"list": [BUILTIN_ANNOTATION, *annotations]},
        "links": [*links, dashboards_link()],
        "panels": layout(rows),
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
STALLED_MAPPINGS = state_mappings(("training", "green"), ("STALLED", "red"))


def per_node(metric: str, *m: str, by: str = "") -> str:
    """One series per agent (job, instance) of a metric of the selected nodes (the training's figures)."""
    extra = f", {by}" if by else ""
    return f"max by (job, instance{extra}) ({sel(metric, *HOST, *m)})"


def per_rank(metric: str, *m: str, by: str = "") -> str:
    """One series per rank (job, instance, rank) of a per-rank metric of the selected nodes."""
    return per_node(metric, *m, by=RANK + (f", {by}" if by else ""))


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


# --- the node dashboard -------------------------------------------------------------------------------


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


# --- the fleet dashboard ------------------------------------------------------------------------------


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


# --- the run dashboard --------------------------------------------------------------------------------


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


DASHBOARDS = {
    "otel-forge-node.json": node_dashboard,
    "otel-forge-fleet.json": fleet_dashboard,
    "otel-forge-run.json": run_dashboard,
}


def render(build: Any) -> str:
    return json.dumps(build(), indent=2, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs from the builder's output")
    args = parser.parse_args(argv)
    stale = []
    for name, build in DASHBOARDS.items():
        path, text = HERE / name, render(build)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(stale)}; run python dashboards/build.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
