"""What a dashboard shows, apart from how its JSON spells it: each row and panel (type, title, place,
unit, thresholds, mappings, links, transformations) and each query (its expression, legend, instant
or range, format), in order; its variables and annotations. ``panels_and_queries.json`` holds the
record of the dashboards as they were hand-built, before Grafana's own builders made their JSON:
``python tests/dashboards/panel_record.py --rewrite`` rewrites it (only ever on purpose)."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RECORD = Path(__file__).resolve().parent / "panels_and_queries.json"
DASHBOARDS_DIR = Path(__file__).resolve().parents[2] / "dashboards"


def _query(target: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "refId": target["refId"], "expr": target["expr"], "legendFormat": target.get("legendFormat"),
        "instant": bool(target.get("instant")), "format": target.get("format", "time_series"),
    }  # fmt: skip


def _panel(panel: Mapping[str, Any]) -> dict[str, Any]:
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    record = {
        "type": panel["type"], "title": panel["title"], "description": panel.get("description", ""),
        "gridPos": panel["gridPos"], "collapsed": panel.get("collapsed"),
        "unit": defaults.get("unit"), "decimals": defaults.get("decimals"), "min": defaults.get("min"),
        "max": defaults.get("max"), "thresholds": defaults.get("thresholds"), "mappings": defaults.get("mappings"),
        "links": defaults.get("links") or None, "noValue": defaults.get("noValue"),
        "transformations": panel.get("transformations") or None,
        "targets": [_query(t) for t in panel.get("targets", ())],
    }  # fmt: skip
    if panel["type"] == "row":
        record["panels"] = [_panel(inner) for inner in panel.get("panels", ())]
    return record


def record(dashboard: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "title": dashboard["title"], "uid": dashboard["uid"], "tags": dashboard.get("tags"),
        "panels": [_panel(panel) for panel in dashboard["panels"]],
        "variables": [
            {key: variable.get(key) for key in ("name", "type", "label", "query", "multi", "includeAll", "regex")}
            for variable in dashboard["templating"]["list"]
        ],
        "annotations": [
            {key: annotation.get(key) for key in ("name", "expr", "titleFormat", "textFormat", "tagKeys")}
            for annotation in dashboard["annotations"]["list"]
        ],
        "links": [
            {key: link.get(key) for key in ("title", "type", "url", "tags")} for link in dashboard.get("links", ())
        ],
    }  # fmt: skip


def main(argv: list[str]) -> int:
    if argv != ["--rewrite"]:
        print(f"usage: {sys.argv[0]} --rewrite  (replaces the record of the hand-built dashboards)", file=sys.stderr)
        return 2
    records = {path.name: record(json.loads(path.read_text())) for path in sorted(DASHBOARDS_DIR.glob("*.json"))}
    RECORD.write_text(json.dumps(records, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
