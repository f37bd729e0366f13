"""The dashboards of ``dashboards/`` are well-formed Grafana JSON: they validate against Grafana's
JSON Schemas (``../shared/grafana``), are exactly what ``dashboards/build.py`` builds, and follow the
rules every dashboard shares (Prometheus datasource variable, no hard-coded uid, both name forms)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from grafana_queries import (
    DASHBOARD_FILES,
    DASHBOARDS_DIR,
    REPO_ROOT,
    annotation_queries,
    label_values,
    load,
    load_builder,
    panels,
    targets,
    variables,
)
from panel_record import RECORD, record

SCHEMA_DIR = REPO_ROOT.parent / "shared" / "grafana"
PANEL_TYPES = {"timeseries", "stat", "heatmap", "table", "state-timeline"}

builder = load_builder()


@pytest.fixture(scope="module")
def schemas() -> dict[str, object]:
    if not (SCHEMA_DIR / "dashboard.jsonschema.json").is_file():
        pytest.skip(f"Grafana JSON Schemas not found at {SCHEMA_DIR} (CI lays shared/ beside the checkout)")
    from jsonschema import Draft7Validator

    dashboard_schema = json.loads((SCHEMA_DIR / "dashboard.jsonschema.json").read_text())
    timeseries = json.loads((SCHEMA_DIR / "timeseries.jsonschema.json").read_text())
    Draft7Validator.check_schema(dashboard_schema)
    Draft7Validator.check_schema(timeseries)
    definitions = timeseries["definitions"]
    return {
        "dashboard": Draft7Validator(dashboard_schema),
        "timeseries options": Draft7Validator({"$ref": "#/definitions/Options", "definitions": definitions}),
        "timeseries custom": Draft7Validator({"$ref": "#/definitions/FieldConfig", "definitions": definitions}),
    }


def _errors(validator: object, instance: object) -> list[str]:
    return [
        f"{'/'.join(map(str, error.absolute_path)) or '.'}: {error.message[:300]}"
        for error in validator.iter_errors(instance)
    ]  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_dashboard_validates_against_grafana_schema(name: str, schemas: dict[str, object]) -> None:
    dashboard = load(name)
    assert _errors(schemas["dashboard"], dashboard) == []
    checked = 0
    for panel in panels(dashboard):
        if panel["type"] == "timeseries":
            assert _errors(schemas["timeseries options"], panel["options"]) == [], panel["title"]
            assert _errors(schemas["timeseries custom"], panel["fieldConfig"]["defaults"]["custom"]) == [], panel[
                "title"
            ]
            checked += 1
    assert checked > 0, "no timeseries panel was checked"


def test_committed_json_is_the_builders_output() -> None:
    for name, build in builder.DASHBOARDS.items():
        assert (DASHBOARDS_DIR / name).read_text() == builder.render(build), (
            f"{name} is stale: run python dashboards/build.py"
        )
    assert sorted(builder.DASHBOARDS) == sorted(DASHBOARD_FILES)
    assert builder.main(["--check"]) == 0


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_datasource_is_a_variable_and_panels_are_of_the_allowed_types(name: str) -> None:
    dashboard = load(name)
    defined = variables(dashboard)
    assert defined["datasource"]["type"] == "datasource" and defined["datasource"]["query"] == "prometheus"
    assert {"datasource", "job", "node", "gpu"} <= set(defined)
    assert defined["node"]["query"].endswith(", instance)")
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == name.removesuffix(".json")
    # No data source uid anywhere but the variable: every reference is ${datasource} or Grafana's own.
    text = json.dumps(dashboard)
    uids = set(re.findall(r'"uid": "([^"]*)"', text)) - {dashboard["uid"]}
    assert uids <= {"${datasource}", "-- Grafana --"}, uids
    ids = []
    for panel in panels(dashboard):
        assert panel["type"] in PANEL_TYPES, panel["title"]
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        assert all(target["datasource"] == panel["datasource"] for target in panel["targets"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        ids.append(panel["id"])
    assert len(ids) == len(set(ids))
    for variable in defined.values():
        if variable["type"] == "query":
            assert variable["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def _queries(dashboard: dict) -> list[str]:
    """Every PromQL text of a dashboard: panel targets, query variables, annotations."""
    found = [target.expr for target in targets(dashboard)]
    for variable in variables(dashboard).values():
        if variable["type"] == "query":
            selector, _ = label_values(variable["query"])
            found.append(selector)
    return found + [annotation["expr"] for annotation in annotation_queries(dashboard)]


def _metric_references(expr: str) -> tuple[list[str], list[str]]:
    """(metric names written as ``name{...}`` or bare, ``__name__=~`` patterns) of ``expr``."""
    patterns = re.findall(r'__name__=~"([^"]+)"', expr)
    names = re.findall(r"(?<![\w\"])([a-zA-Z_:][a-zA-Z0-9_:]*)\{", expr)
    if re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr.strip()):
        names.append(expr.strip())
    return names, patterns


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_queries_read_both_name_forms_and_use_rate_interval(name: str) -> None:
    """A unit-1 metric is only ever matched as ``name(_ratio)?``; rates use ``$__rate_interval``."""
    ratio_names = {builder.prometheus_name(spec) for spec in builder.SPECS.values() if spec.unit == "1"}
    seen_ratio = 0
    for expr in _queries(load(name)):
        names, patterns = _metric_references(expr)
        assert not set(names) & ratio_names, f"a unit-1 metric by its plain name only: {expr}"
        assert not any(n.endswith("_ratio") for n in names), expr
        for pattern in patterns:
            if any(re.fullmatch(pattern, metric) for metric in ratio_names):
                assert pattern.endswith("(_ratio)?"), f"{pattern} misses the Collector's form"
                assert any(re.fullmatch(pattern, metric + "_ratio") for metric in ratio_names)
                seen_ratio += 1
        for window in re.findall(r"\b(?:rate|irate)\([^\[]*\[([^\]]+)\]", expr):
            assert window == "$__rate_interval", expr
    assert seen_ratio > 0


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_every_metric_named_is_in_otel_forges_metric_table(name: str) -> None:
    known = {builder.prometheus_name(spec) for spec in builder.SPECS.values()} | {"up", "target_info"}
    for expr in _queries(load(name)):
        names, patterns = _metric_references(expr)
        for metric in names:
            assert metric in known, f"{metric} is not a metric otel_forge exports: {expr}"
        for pattern in patterns:
            assert any(re.fullmatch(pattern, metric) for metric in known), f"{pattern} matches no metric: {expr}"


def test_pcie_panels_say_there_is_no_nvlink_metric() -> None:
    found = [panel for name in DASHBOARD_FILES for panel in panels(load(name)) if "PCIe" in panel["title"]]
    assert len(found) >= 2
    assert all("NVLink" in panel["description"] for panel in found)


def test_run_dashboard_joins_on_run_info_annotates_the_run_and_links_to_mlflow() -> None:
    dashboard = load("otel-forge-run.json")
    defined = variables(dashboard)
    assert {"run", "tracking_uri", "run_name"} <= set(defined)
    assert "experiment" not in defined  # no link needs it: an agent may not know the run's experiment
    gpu_and_host = [t for t in targets(dashboard) if "otel_forge_run_info" in t.expr]
    assert len(gpu_and_host) >= 15
    joined = [t for t in gpu_and_host if "group_left (otel_forge_node_id)" in t.expr]
    assert len(joined) >= 12, [t.panel for t in gpu_and_host]
    (annotation,) = annotation_queries(dashboard)
    assert 'mlflow_run_id="$run"' in annotation["expr"] and annotation["target"]["expr"] == annotation["expr"]
    urls = [entry["url"] for entry in dashboard["links"] if entry["type"] == "link"]
    assert urls == ["${tracking_uri}/#/runs/${run}"]  # MLflow's direct run page: no experiment id needed
    # Every series of the run is listed, also where its experiment and name are empty (a standalone agent).
    assert not [t.expr for t in targets(dashboard) if "mlflow_experiment_id" in t.expr and "!=" in t.expr]


def test_builder_maps_otel_names_to_the_exporters_prometheus_names() -> None:
    name = builder.prometheus_name
    assert name(builder.SPECS["hw.gpu.utilization"]) == "hw_gpu_utilization"
    assert name(builder.SPECS["hw.power"]) == "hw_power_watts"
    assert name(builder.SPECS["hw.energy"]) == "hw_energy_joules_total"
    assert name(builder.SPECS["hw.temperature"]) == "hw_temperature_celsius"
    assert name(builder.SPECS["otel_forge.gpu.clock.frequency"]) == "otel_forge_gpu_clock_frequency_hertz"
    assert name(builder.SPECS["hw.gpu.io"]) == "hw_gpu_io_bytes_total"
    assert name(builder.SPECS["hw.errors"]) == "hw_errors_total"
    assert name(builder.SPECS["otel_forge.run.info"]) == "otel_forge_run_info"
    assert builder.sel("hw.gpu.utilization", 'job=~"$job"') == '{__name__=~"hw_gpu_utilization(_ratio)?", job=~"$job"}'
    assert builder.sel("hw.power") == "hw_power_watts"
    with pytest.raises(KeyError):
        builder.sel("hw.gpu.nvlink.throughput")


def test_gpm_metrics_have_their_fixed_prometheus_names() -> None:
    """NVML GPM metrics are drawn before otel_forge's table may list them: the names are fixed, and where
    the table has a row its Prometheus name is the one the dashboards use."""
    from otel_forge.names import METRICS

    expected = {
        "otel_forge.gpu.sm.activity": "otel_forge_gpu_sm_activity",
        "otel_forge.gpu.sm.occupancy": "otel_forge_gpu_sm_occupancy",
        "otel_forge.gpu.pipe.activity": "otel_forge_gpu_pipe_activity",
        "otel_forge.gpu.dram.activity": "otel_forge_gpu_dram_activity",
        "otel_forge.gpu.io.rate": "otel_forge_gpu_io_rate_bytes_per_second",
    }
    assert {spec.name: builder.prometheus_name(spec) for spec in builder.GPM_METRICS} == expected
    for spec in METRICS:
        if spec.name in expected:
            assert builder.prometheus_name(spec) == expected[spec.name], spec
            assert builder.has_ratio_form(spec) == (spec.unit == "1")
    used = {
        name
        for dashboard in ("otel-forge-node.json", "otel-forge-run.json")
        for target in targets(load(dashboard))
        for name in expected.values()
        if name in target.expr
    }
    assert {"otel_forge_gpu_sm_activity", "otel_forge_gpu_pipe_activity", "otel_forge_gpu_dram_activity"} <= used


def test_gpu_activity_is_the_recording_rules_choice() -> None:
    """The run dashboard's node GPU activity is recording-rules.yml's: SM activity, else utilization."""
    import yaml

    rules = yaml.safe_load((REPO_ROOT / "collector-config" / "recording-rules.yml").read_text())
    (rule,) = [
        r for g in rules["groups"] for r in g["rules"] if r.get("record") == "run_node:otel_forge_gpu_activity:avg5m"
    ]
    expr = builder.gpu_activity("5m")
    for part in ('"otel_forge_gpu_activity_signal", "sm_activity"', '"otel_forge_gpu_activity_signal", "utilization"'):
        assert part in expr and part in rule["expr"]
    assert "or on (job, instance)" in expr and "or on (job, instance)" in rule["expr"]
    titles = {panel["title"] for panel in dashboard_rows(load("otel-forge-run.json"))}
    assert "Nodes of this job" in titles


def dashboard_rows(dashboard: dict) -> list[dict]:
    return [panel for panel in dashboard["panels"] if panel["type"] == "row"]


def test_readme_describes_every_dashboard_and_variable() -> None:
    readme = (DASHBOARDS_DIR / "README.md").read_text()
    for name in DASHBOARD_FILES:
        assert name in readme
        for variable in variables(load(name)):
            assert f"`{variable}`" in readme, variable
    assert "python dashboards/build.py" in readme


def test_the_builder_runs_as_a_script(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, str(DASHBOARDS_DIR / "build.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_the_dashboards_show_the_panels_and_queries_they_showed_when_hand_built(name: str) -> None:
    """Built with Grafana's own builders, each dashboard has the rows, panels (type, title, place, unit,
    thresholds, mappings, links, transformations), queries, variables and annotations of the
    hand-built JSON it replaced (recorded in panels_and_queries.json before the change)."""
    recorded = json.loads(RECORD.read_text())[name]
    now = record(load(name))
    # Added since (issue 44), after every panel it had: the run's keys received over OTLP.
    now["panels"] = now["panels"][: len(recorded["panels"])]
    for index, (before, after) in enumerate(zip(recorded["panels"], now["panels"], strict=True)):
        assert after == before, (name, index, before["title"])
    assert now == recorded
