"""The Collector configs of collector-config/: well formed, official components only, and rejected when broken."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import collector_lint
import pytest
from collector_lint import CONTRIB, CORE, load, problems, used_types

CONFIG_DIR = Path(__file__).resolve().parents[2] / "collector-config"
AGENT = CONFIG_DIR / "agent.yaml"
GATEWAY = CONFIG_DIR / "gateway.yaml"

# The component types these configs use, and the official distributions that ship each one
# (the "Distributions" line of the component's README; the otelcol and otelcol-contrib manifests).
USED = {
    ("receiver", "otlp"): {CORE, CONTRIB},
    ("processor", "memory_limiter"): {CORE, CONTRIB},
    ("processor", "batch"): {CORE, CONTRIB},
    ("exporter", "otlp"): {CORE, CONTRIB},
    ("exporter", "prometheus"): {CORE, CONTRIB},
    ("exporter", "prometheusremotewrite"): {CORE, CONTRIB},
    ("exporter", "debug"): {CORE, CONTRIB},
    ("extension", "health_check"): {CORE, CONTRIB},
}


def test_the_component_list_matches_the_checker():
    for (kind, type_name), distributions in USED.items():
        spec = collector_lint.component_spec(kind, type_name)
        assert spec is not None, (kind, type_name)
        assert set(spec[1]) == distributions, (kind, type_name)


@pytest.mark.parametrize("path", [AGENT, GATEWAY], ids=lambda p: p.name)
def test_shipped_config_passes(path):
    config = load(path)
    assert problems(config) == []
    assert used_types(config) <= set(USED), used_types(config) - set(USED)


def test_agent_pipeline_is_otlp_in_limiter_batch_otlp_out():
    config = load(AGENT)
    assert config["service"]["pipelines"] == {
        "metrics": {"receivers": ["otlp"], "processors": ["memory_limiter", "batch"], "exporters": ["otlp"]}
    }
    # OTLP in on localhost only: a node agent is not a network service.
    for protocol in config["receivers"]["otlp"]["protocols"].values():
        assert protocol["endpoint"].startswith("localhost:"), protocol
    assert config["exporters"]["otlp"]["endpoint"].startswith("${env:OTEL_GATEWAY_ENDPOINT")


def test_gateway_pipeline_fans_out_to_prometheus_remote_write_and_debug():
    config = load(GATEWAY)
    pipeline = config["service"]["pipelines"]["metrics"]
    assert pipeline["receivers"] == ["otlp"]
    assert pipeline["processors"] == ["memory_limiter", "batch"]
    assert set(pipeline["exporters"]) == {"prometheus", "prometheusremotewrite", "debug"}
    assert config["exporters"]["prometheus"]["resource_to_telemetry_conversion"] == {"enabled": True}
    assert config["exporters"]["prometheusremotewrite"]["endpoint"].startswith("${env:PROMETHEUS_REMOTE_WRITE_URL")


def _broken(config, change):
    broken = copy.deepcopy(config)
    change(broken)
    return problems(broken)


BREAKAGES = {
    "undefined exporter in a pipeline": (
        lambda c: c["service"]["pipelines"]["metrics"]["exporters"].append("otlphttp/missing"),
        "is not defined",
    ),
    "defined but unused processor": (lambda c: c["processors"].__setitem__("batch/unused", {}), "used by no pipeline"),
    "component from no official distribution": (
        lambda c: c["exporters"].__setitem__("dcgm_fancy", {}),
        "not among the official exporters",
    ),
    "misspelt setting": (
        lambda c: c["processors"]["memory_limiter"].__setitem__("limit_percentag", 80),
        "unknown settings",
    ),
    "memory_limiter not first": (
        lambda c: c["service"]["pipelines"]["metrics"].__setitem__("processors", ["batch", "memory_limiter"]),
        "must come first",
    ),
    "pipeline without receivers": (
        lambda c: c["service"]["pipelines"]["metrics"].__setitem__("receivers", []),
        "no receivers",
    ),
    "unknown pipeline signal": (
        lambda c: c["service"]["pipelines"].__setitem__("profilez", {"receivers": ["otlp"], "exporters": ["debug"]}),
        "is not one of",
    ),
    "undefined extension": (lambda c: c["service"]["extensions"].append("pprof"), "is not defined"),
}


@pytest.mark.parametrize("name", sorted(BREAKAGES))
def test_broken_copy_is_rejected(name):
    change, expected = BREAKAGES[name]
    found = _broken(load(GATEWAY), change)
    assert any(expected in problem for problem in found), found


def _otelcol() -> str | None:
    return shutil.which("otelcol-contrib") or shutil.which("otelcol")


@pytest.mark.parametrize("path", [AGENT, GATEWAY], ids=lambda p: p.name)
def test_otelcol_validate(path, tmp_path):
    binary = _otelcol()
    if binary is None:
        pytest.skip(
            "neither otelcol-contrib nor otelcol is on PATH (no OpenTelemetry Collector can be installed "
            "on this machine): `otelcol validate` not run; the static checks above stand in for it"
        )
    env = {
        **os.environ,
        "OTEL_GATEWAY_ENDPOINT": "localhost:4317",
        "PROMETHEUS_REMOTE_WRITE_URL": "http://localhost:9090/api/v1/write",
    }
    result = subprocess.run(
        [binary, "validate", f"--config={path}"], capture_output=True, text=True, env=env, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
