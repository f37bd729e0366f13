"""A panel described once (``Panel``, ``Query``) and rendered as Grafana's JSON; rows and their layout,
variables, links, annotations, and the dashboard around them."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dashboard_parts.grafana_builders import panel_json
from dashboard_parts.queries import BUILTIN_ANNOTATION, JOB, NODE, sel

SCHEMA_VERSION = 41  # Grafana 12.0
TAG = "otel-forge"
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}


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
        return panel_json(self, panel_id, x, y)


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


STALLED_MAPPINGS = state_mappings(("training", "green"), ("STALLED", "red"))
