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

The parts live in ``dashboard_parts/``: ``queries`` (names, selectors), ``panels`` (a panel and its
JSON, rows, variables, the dashboard), ``rows`` (rows more than one dashboard shows), and one module
per dashboard (``node``, ``fleet``, ``run``).

``python dashboards/build.py --check`` exits 1 when a JSON file differs from what it builds.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dashboard_parts.fleet import fleet_dashboard
from dashboard_parts.node import node_dashboard
from dashboard_parts.queries import GPM_METRICS, SPECS, gpu_activity, has_ratio_form, prometheus_name, sel
from dashboard_parts.run import run_dashboard

__all__ = [
    "DASHBOARDS",
    "GPM_METRICS",
    "SPECS",
    "gpu_activity",
    "has_ratio_form",
    "main",
    "prometheus_name",
    "render",
    "sel",
]

HERE = Path(__file__).resolve().parent
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
