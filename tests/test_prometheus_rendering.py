"""PrometheusRendering: the bodies of /metrics, prometheus_client's encoding of the OTel exporter's
translation, made once per collect, and of a collect only what changed since the last one."""

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.exposition import choose_encoder

from otel_forge.pipeline.prometheus_rendering import PrometheusRendering
from testkit.servers import PROMETHEUS_ACCEPT

ACCEPTS = (
    PROMETHEUS_ACCEPT,
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8",
    "text/plain;version=0.0.4",
    "",
)


def _rendering_of(attributes: dict[str, str]):
    """A PrometheusRendering holding one collect of a gauge and a counter with these attributes."""
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("otel_forge")
    meter.create_observable_gauge("hw.gpu.memory.usage", [lambda _: [Observation(1.5, attributes)]], unit="By")
    meter.create_counter("system.network.io", unit="By").add(7, {"network.io.direction": 'tx "a"\n'})
    rendering = PrometheusRendering()
    rendering.export(reader.get_metrics_data())
    return rendering


def test_a_body_is_exactly_prometheus_clients_encoding_as_negotiated():
    # Attribute keys that prometheus_client's escapings treat differently, were they not translated first.
    for attributes in ({"hw.id": "GPU-0"}, {"__reserved": "x", "9lives": "y", "a:b": "z", "hw.id": "GPU-0"}):
        for accept in ACCEPTS:
            rendering = _rendering_of(attributes)
            body, headers = rendering.body(accept, None)
            encoder, content_type = choose_encoder(accept)
            assert body == encoder(rendering._latest), (attributes, accept)
            assert headers == (("Content-Type", content_type),)
    assert b'hw_gpu_memory_usage_bytes{_lives="y",_reserved="x",a_b="z",hw_id="GPU-0"' in body


def test_names_units_and_label_keys_are_mapped_once_per_process_not_once_per_collect():
    import opentelemetry.exporter.prometheus as otel_prometheus

    from otel_forge.pipeline.prometheus_translation import NAME_MAPPINGS as _NAME_MAPPINGS

    keys = {"hw.id": "GPU-0", "9lives": "y", "a:b": "z"}
    _rendering_of(keys).body(PROMETHEUS_ACCEPT, None)  # every name of these metrics seen once
    mappings = [getattr(otel_prometheus, name) for name in _NAME_MAPPINGS]
    misses = [mapping.cache_info().misses for mapping in mappings]
    for _ in range(5):
        _rendering_of(keys).body(PROMETHEUS_ACCEPT, None)
    assert [mapping.cache_info().misses for mapping in mappings] == misses
    sanitize = otel_prometheus.sanitize_attribute
    assert sanitize("9lives") == sanitize.__wrapped__("9lives") == "_lives"


def test_a_family_unchanged_since_the_last_collect_is_not_encoded_again():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("otel_forge")
    usage = [1.0]
    meter.create_observable_gauge("system.memory.limit", [lambda _: [Observation(8.0)]], unit="By")
    meter.create_observable_gauge("system.memory.usage", [lambda _: [Observation(usage[0])]], unit="By")
    meter.create_counter("hw.errors").add(2, {"error.type": "uncorrected"})
    rendering = PrometheusRendering()
    encoded = []
    for usage[0] in (1.0, 2.0, 2.0, 3.0):
        rendering.export(reader.get_metrics_data())
        for accept in ACCEPTS[1:3]:  # OpenMetrics and text: each format keeps its own bytes
            body, _ = rendering.body(accept, None)
            encoder, _ = choose_encoder(accept)
            assert body == encoder(rendering._latest), accept  # every body is the whole encoding
        encoded.append(rendering.families_encoded)
    # target_info and 3 families in 2 formats; then only the changed usage, once per format.
    assert encoded == [8, 10, 10, 12]
    scope = 'otel_scope_name="otel_forge",otel_scope_schema_url="",otel_scope_version=""'
    assert f"system_memory_usage_bytes{{{scope}}} 3.0\n".encode() in body  # the last value, not a kept one


def test_a_translation_that_keeps_labels_gives_the_exporters_own_families_collect_after_collect():
    from opentelemetry.exporter.prometheus import _CustomCollector

    from otel_forge.pipeline.prometheus_translation import PrometheusTranslation

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("otel_forge", "1.0")
    cores = [{"cpu": "0"}, {"cpu": "1"}]
    load = [0.0]
    meter.create_observable_gauge(
        "system.cpu.utilization", [lambda _: [Observation(load[0] + i, core) for i, core in enumerate(cores)]]
    )
    errors = meter.create_counter("hw.errors")
    latency = meter.create_histogram("rpc.duration", unit="s")
    ours = PrometheusTranslation()
    for collect in range(6):
        load[0] = collect / 10
        errors.add(collect, {"error.type": "uncorrected" if collect % 2 else "corrected"})
        latency.record(collect / 3, {"rpc.method": "get"})
        if collect == 3:
            cores.append({"cpu": "2"})  # a new series: its labels are built, the others' kept
        if collect == 4:
            cores.pop(0)  # a series gone: the rows follow
        data = reader.get_metrics_data()
        stock = _CustomCollector()
        stock.add_metrics_data(data)
        assert ours.translate(data) == list(stock.collect()), collect
    # 3 metrics' labels built at the first collect; then only where a metric's points changed: the
    # counter's second series (collect 1), the utilisation's new core (3) and its core gone (4)
    assert ours.labels_built == 3 + 3
