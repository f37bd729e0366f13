"""The metric table against the OpenTelemetry semantic-conventions package (the reference).

Every semconv-named row must be the package's metric: same instrument kind and unit; every
attribute key a row declares or a real collect emits is a semconv attribute (or ours, under
``otel_forge.``); and an attribute with a semconv enum only takes that enum's values.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import time
from enum import Enum
from types import ModuleType

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.semconv import _incubating

from otel_forge import ForgeConfig, instrument
from otel_forge.names import METRICS, Kind
from testkit.gpu_fakes import fake_amdsmi, fake_nvml

OURS = "otel_forge."
# Not semconv, on purpose: the OpenTelemetry Collector hostmetrics receiver's load-average names
# (semconv defines none; dashboards built for the Collector read ours), and MLflow's identifiers of
# a run, named as MLflow names them (otel_forge.run.info joins a node's series to its run).
COLLECTOR_HOSTMETRICS = {"system.cpu.load_average.1m", "system.cpu.load_average.5m", "system.cpu.load_average.15m"}
MLFLOW_IDS = "mlflow."
_DOC = re.compile(r"Instrument: (\w+)\s+Unit: (\S+)")
_KINDS = {"gauge": Kind.GAUGE, "counter": Kind.COUNTER, "updowncounter": Kind.UP_DOWN_COUNTER, "histogram": None}


def _modules(package_name: str) -> list[ModuleType]:
    package = importlib.import_module(package_name)
    return [importlib.import_module(f"{package_name}.{info.name}") for info in pkgutil.iter_modules(package.__path__)]


def _semconv_metrics() -> dict[str, tuple[Kind, str]]:
    """name -> (kind, unit), from the constants' docstrings ("Instrument: counter / Unit: By")."""
    metrics: dict[str, tuple[Kind, str]] = {}
    for module in _modules(f"{_incubating.__name__}.metrics") + _modules("opentelemetry.semconv.metrics"):
        source = importlib.util.find_spec(module.__name__).loader.get_source(module.__name__)  # type: ignore[union-attr]
        for name, body in re.findall(r'^\w+: Final = "([^"]+)"\n"""(.*?)"""', source, re.S | re.M):
            if match := _DOC.search(body):
                metrics[name] = (_KINDS[match.group(1)], match.group(2))
    return metrics


def _semconv_attributes() -> tuple[set[str], dict[str, set[str]]]:
    """Every semconv attribute key, and the allowed values of those with an enum."""
    keys: set[str] = set()
    enums: dict[str, set[str]] = {}
    for module in _modules(f"{_incubating.__name__}.attributes") + _modules("opentelemetry.semconv.attributes"):
        for constant, value in vars(module).items():
            if constant.isupper() and isinstance(value, str):
                keys.add(value)
                enum = getattr(module, "".join(part.title() for part in constant.split("_")) + "Values", None)
                is_enum = isinstance(enum, type) and issubclass(enum, Enum)
                values = {str(member.value) for member in enum} if is_enum else set()
                if values - {"_OTHER"}:  # an enum of "_OTHER" alone (error.type) is open: any value
                    enums.setdefault(value, set()).update(values)
    return keys, enums


SEMCONV_METRICS = _semconv_metrics()
SEMCONV_KEYS, SEMCONV_ENUMS = _semconv_attributes()


def test_the_reference_is_loaded() -> None:
    assert not COLLECTOR_HOSTMETRICS & set(SEMCONV_METRICS)  # the day semconv defines them, check them
    assert SEMCONV_METRICS["system.cpu.utilization"] == (Kind.GAUGE, "1")
    assert SEMCONV_METRICS["hw.gpu.io"] == (Kind.COUNTER, "By")
    assert "interrupt" in SEMCONV_ENUMS["cpu.mode"] and "hw.serial_number" in SEMCONV_KEYS


@pytest.mark.parametrize(
    "spec",
    [spec for spec in METRICS if not spec.name.startswith(OURS) and spec.name not in COLLECTOR_HOSTMETRICS],
    ids=lambda spec: f"{spec.name}[{spec.source}]",
)
def test_a_semconv_named_row_is_the_semconv_metric(spec) -> None:  # type: ignore[no-untyped-def]
    assert spec.name in SEMCONV_METRICS, f"{spec.name} is not a semconv metric: name it otel_forge.*"
    assert (spec.kind, spec.unit) == SEMCONV_METRICS[spec.name]


@pytest.mark.parametrize("spec", METRICS, ids=lambda spec: f"{spec.name}[{spec.source}]")
def test_every_attribute_a_row_declares_is_semconv_or_ours(spec) -> None:  # type: ignore[no-untyped-def]
    unknown = [key for key in spec.attributes if not key.startswith((OURS, MLFLOW_IDS)) and key not in SEMCONV_KEYS]
    assert unknown == []


@pytest.fixture(scope="module")
def collected_points() -> list[tuple[str, dict[str, object]]]:
    """(metric, attributes) of every data point of a real collect: every collector, both GPU vendors (fakes)."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with fake_nvml({"count": 2}), fake_amdsmi({"count": 1}):
        handle = instrument(
            provider,
            ForgeConfig.resolve(environ={}),
            per_cpu=True,
            collectors=["cpu", "memory", "disk", "network", "process", "nvidia", "amd"],
        )
        try:
            time.sleep(0.1)  # the CPU collector reports time deltas: let a few clock ticks (10 ms) elapse
            reader.collect()
            data = reader.get_metrics_data()
        finally:
            handle.unregister()
            provider.shutdown()
    return [
        (metric.name, dict(point.attributes or {}))
        for resource_metrics in data.resource_metrics
        for scope in resource_metrics.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    ]


def test_a_collect_emits_only_declared_attributes_and_semconv_enum_values(collected_points) -> None:  # type: ignore[no-untyped-def]
    declared = {}
    for spec in METRICS:
        declared.setdefault(spec.name, set()).update(spec.attributes)
    names = {name for name, _ in collected_points}
    assert {"system.cpu.utilization", "hw.gpu.utilization", "hw.errors"} <= names, sorted(names)
    problems = []
    for name, attributes in collected_points:
        for key, value in attributes.items():
            if key not in declared[name]:
                problems.append(f"{name}: {key} not declared in the metric table")
            elif key in SEMCONV_ENUMS and str(value) not in SEMCONV_ENUMS[key]:
                problems.append(f"{name}: {key}={value!r} is not in semconv's {sorted(SEMCONV_ENUMS[key])}")
    assert sorted(set(problems)) == []
