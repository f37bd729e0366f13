"""Attach mode: the collectors on an application's own MeterProvider and reader."""

import sys
import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.resources import Resource

import otel_forge


def names_and_resource(reader):
    data = reader.get_metrics_data()
    if data is None:
        return set(), None
    names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    return names, data.resource_metrics[0].resource


def test_instrument_registers_on_the_apps_provider_and_unregisters():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "my-trainer"}))
    handle = otel_forge.instrument(provider, collectors=["cpu", "memory"], sampling_interval_s=1)
    time.sleep(0.1)  # a few clock ticks, so CPU utilization has an interval to measure
    names, resource = names_and_resource(reader)
    assert {"system.cpu.utilization", "system.memory.usage", "otel_forge.collector.reads"} <= names
    assert not any(n.startswith(("system.network", "process.")) for n in names)
    # The app's resource, not ours.
    assert resource.attributes["service.name"] == "my-trainer"
    handle.unregister()
    handle.unregister()  # idempotent
    assert names_and_resource(reader)[0] == set()
    provider.shutdown()


def test_instrument_again_after_unregister_on_the_same_provider_exports_again():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    first = otel_forge.instrument(provider, collectors=["memory"])
    assert "system.memory.usage" in names_and_resource(reader)[0]
    first.unregister()
    assert names_and_resource(reader)[0] == set()
    second = otel_forge.instrument(provider, collectors=["memory"])  # the SDK hands back the same instruments
    assert {"system.memory.usage", "otel_forge.collector.reads"} <= names_and_resource(reader)[0]
    first.unregister()  # the old handle no longer silences the new registration
    assert "system.memory.usage" in names_and_resource(reader)[0]
    second.unregister()
    assert names_and_resource(reader)[0] == set()
    provider.shutdown()


def test_instrument_twice_on_one_provider_is_a_clear_error():
    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    handle = otel_forge.instrument(provider, collectors=["memory"])
    try:
        otel_forge.instrument(provider, collectors=["memory"])
        raised = None
    except RuntimeError as error:
        raised = str(error)
    assert raised is not None and "already registered on this MeterProvider" in raised and "unregister()" in raised
    handle.unregister()
    otel_forge.instrument(provider, collectors=["memory"]).unregister()  # and once unregistered, it works
    provider.shutdown()


def test_import_is_cheap():
    """`import otel_forge` pulls neither mlflow, the exporters, nor NVML."""
    import subprocess

    code = (
        "import sys, otel_forge; heavy = [m for m in sys.modules if m.split('.')[0] in "
        "('mlflow', 'pynvml', 'amdsmi', 'prometheus_client', 'grpc') or "
        "m.startswith(('opentelemetry.exporter', 'opentelemetry.sdk'))]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
