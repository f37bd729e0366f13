"""A static check of OpenTelemetry Collector configs, for where no ``otelcol`` binary can be run.

It checks what ``otelcol validate`` would reject for the components these configs use, and what
it would not (an unused component, memory_limiter not first): every component named in a pipeline
is defined, every defined one is used, each type belongs to an official distribution, pipelines
have receivers and exporters, memory_limiter comes first among processors, and each component's
settings are among the keys that component documents (so a misspelt key is caught).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

CORE = "otelcol"
CONTRIB = "otelcol-contrib"

# Component type -> (kind, distributions that ship it, documented top-level settings).
# Sources: the "Distributions" line of each component's README in opentelemetry-collector(-contrib)
# and the manifests of opentelemetry-collector-releases (distributions/otelcol, otelcol-contrib).
_HTTP_CLIENT = {
    "endpoint",
    "tls",
    "headers",
    "timeout",
    "compression",
    "auth",
    "proxy_url",
    "read_buffer_size",
    "write_buffer_size",
    "max_idle_conns",
    "max_idle_conns_per_host",
    "max_conns_per_host",
    "idle_conn_timeout",
    "disable_keep_alives",
    "http2_read_idle_timeout",
    "http2_ping_timeout",
    "cookies",
}
COMPONENTS: dict[str, tuple[str, frozenset[str], frozenset[str]]] = {
    "otlp": ("receiver", frozenset({CORE, CONTRIB}), frozenset({"protocols"})),
    "memory_limiter": (
        "processor",
        frozenset({CORE, CONTRIB}),
        frozenset(
            {
                "check_interval",
                "limit_mib",
                "spike_limit_mib",
                "limit_percentage",
                "spike_limit_percentage",
                "min_gc_interval_when_soft_limited",
                "min_gc_interval_when_hard_limited",
            }
        ),
    ),
    "batch": (
        "processor",
        frozenset({CORE, CONTRIB}),
        frozenset({"timeout", "send_batch_size", "send_batch_max_size", "metadata_keys", "metadata_cardinality_limit"}),
    ),
    # `otlp` is the OTLP/gRPC exporter; v0.144 renamed it `otlp_grpc` and kept `otlp` as an alias.
    "otlp_exporter": (
        "exporter",
        frozenset({CORE, CONTRIB}),
        frozenset(
            {
                "endpoint",
                "tls",
                "headers",
                "compression",
                "timeout",
                "sending_queue",
                "retry_on_failure",
                "balancer_name",
                "auth",
                "keepalive",
                "read_buffer_size",
                "write_buffer_size",
                "wait_for_ready",
                "authority",
            }
        ),
    ),
    "prometheus": (
        "exporter",
        frozenset({CORE, CONTRIB}),
        frozenset(
            {
                "endpoint",
                "tls",
                "const_labels",
                "namespace",
                "send_timestamps",
                "metric_expiration",
                "resource_to_telemetry_conversion",
                "resource_constant_labels",
                "enable_open_metrics",
                "without_scope_info",
                "add_metric_suffixes",
                "translation_strategy",
            }
        ),
    ),
    "prometheusremotewrite": (
        "exporter",
        frozenset({CORE, CONTRIB}),
        frozenset(
            _HTTP_CLIENT
            | {
                "namespace",
                "external_labels",
                "add_metric_suffixes",
                "remote_write_queue",
                "resource_to_telemetry_conversion",
                "target_info",
                "export_created_metric",
                "retry_on_failure",
                "wal",
                "max_batch_size_bytes",
                "send_metadata",
                "protobuf_message",
                "translation_strategy",
            }
        ),
    ),
    "debug": (
        "exporter",
        frozenset({CORE, CONTRIB}),
        frozenset({"verbosity", "sampling_initial", "sampling_thereafter", "use_internal_logger", "sending_queue"}),
    ),
    "health_check": (
        "extension",
        frozenset({CORE, CONTRIB}),
        frozenset({"endpoint", "path", "tls", "response_body", "check_collector_pipeline", "cors", "auth"}),
    ),
}
# The same type name means a different component per kind (otlp receiver / otlp exporter).
_TYPE_KEYS = {("exporter", "otlp"): "otlp_exporter", ("exporter", "otlp_grpc"): "otlp_exporter"}

KINDS = {
    "receivers": "receiver",
    "processors": "processor",
    "exporters": "exporter",
    "connectors": "connector",
    "extensions": "extension",
}
SIGNALS = ("metrics", "traces", "logs")
# A component id is `type` or `type/name`.
_ID = re.compile(r"^([a-z][a-z0-9_]*)(?:/[^/\s]+)?$")


def component_spec(kind: str, type_name: str) -> tuple[str, frozenset[str], frozenset[str]] | None:
    key = _TYPE_KEYS.get((kind, type_name), type_name)
    spec = COMPONENTS.get(key)
    return spec if spec is not None and spec[0] == kind else None


def load(path: Path | str) -> dict[str, Any]:
    with open(path) as handle:
        return yaml.safe_load(handle)


def used_types(config: dict[str, Any]) -> set[tuple[str, str]]:
    """(kind, type) of every defined component."""
    found = set()
    for section, kind in KINDS.items():
        for component_id in config.get(section) or {}:
            match = _ID.match(component_id)
            if match:
                found.add((kind, match.group(1)))
    return found


def problems(config: dict[str, Any]) -> list[str]:
    """Everything wrong with ``config``; empty when it passes."""
    found: list[str] = []
    if not isinstance(config, dict):
        return ["the config is not a mapping"]
    allowed_top = set(KINDS) | {"service"}
    found += [f"unknown top-level key {key!r}" for key in config if key not in allowed_top]

    defined: dict[str, set[str]] = {}
    for section, kind in KINDS.items():
        components = config.get(section) or {}
        if not isinstance(components, dict):
            found.append(f"{section} is not a mapping")
            continue
        defined[section] = set(components)
        for component_id, settings in components.items():
            match = _ID.match(str(component_id))
            if not match:
                found.append(f"{section}: {component_id!r} is not a component id (type[/name])")
                continue
            spec = component_spec(kind, match.group(1))
            if spec is None:
                found.append(
                    f"{section}: {component_id!r}: type {match.group(1)!r} is not among the official "
                    f"{kind}s this project uses ({CORE}, {CONTRIB})"
                )
                continue
            if settings is None:
                continue
            if not isinstance(settings, dict):
                found.append(f"{section}: {component_id!r}: settings are not a mapping")
                continue
            unknown = sorted(set(settings) - spec[2])
            if unknown:
                found.append(f"{section}: {component_id!r}: unknown settings {unknown}")
            if match.group(1) == "otlp" and kind == "receiver":
                protocols = settings.get("protocols") or {}
                if not protocols or set(protocols) - {"grpc", "http"}:
                    found.append(
                        f"receivers: {component_id!r}: protocols must be grpc and/or http, got {sorted(protocols)}"
                    )

    service = config.get("service")
    if not isinstance(service, dict):
        return found + ["no service section"]
    found += [f"service: unknown key {key!r}" for key in service if key not in {"extensions", "pipelines", "telemetry"}]
    used: dict[str, set[str]] = {section: set() for section in KINDS}
    for extension in service.get("extensions") or []:
        used["extensions"].add(extension)
        if extension not in defined.get("extensions", set()):
            found.append(f"service.extensions: {extension!r} is not defined")
    pipelines = service.get("pipelines") or {}
    if not pipelines:
        found.append("service.pipelines is empty")
    for pipeline_id, pipeline in pipelines.items():
        signal = str(pipeline_id).split("/", 1)[0]
        if signal not in SIGNALS:
            found.append(f"pipeline {pipeline_id!r}: {signal!r} is not one of {SIGNALS}")
        if not isinstance(pipeline, dict):
            found.append(f"pipeline {pipeline_id!r} is not a mapping")
            continue
        found += [
            f"pipeline {pipeline_id!r}: unknown key {key!r}"
            for key in pipeline
            if key not in {"receivers", "processors", "exporters"}
        ]
        for section in ("receivers", "exporters"):
            if not pipeline.get(section):
                found.append(f"pipeline {pipeline_id!r}: no {section}")
        for section in ("receivers", "processors", "exporters"):
            names = pipeline.get(section) or []
            if len(names) != len(set(names)):
                found.append(f"pipeline {pipeline_id!r}: a {section[:-1]} is listed twice")
            for name in names:
                used[section].add(name)
                if name not in defined.get(section, set()):
                    found.append(f"pipeline {pipeline_id!r}: {section[:-1]} {name!r} is not defined")
        processors = [str(name).split("/", 1)[0] for name in pipeline.get("processors") or []]
        if "memory_limiter" in processors and processors[0] != "memory_limiter":
            found.append(f"pipeline {pipeline_id!r}: memory_limiter must come first among the processors")
        if "memory_limiter" not in processors:
            found.append(f"pipeline {pipeline_id!r}: no memory_limiter")
    for section in KINDS:
        for component_id in sorted(defined.get(section, set()) - used[section]):
            found.append(f"{section}: {component_id!r} is defined but used by no pipeline")
    return found
