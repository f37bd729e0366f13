"""A program instrumented with the OpenTelemetry SDK, exporting OTLP to otel_forge's receiver: a
counter, a gauge, an up-down counter and a histogram, over gRPC or HTTP (argv[1]); argv[2], where
given, goes in the ``x-mlflow-run-id`` header. It records, exports, records again, exports, and exits."""

from __future__ import annotations

import os
import sys

from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

protocol = sys.argv[1]
headers = {"x-mlflow-run-id": sys.argv[2]} if len(sys.argv) > 2 else None
if protocol == "grpc":
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    exporter = OTLPMetricExporter(
        endpoint=f"localhost:{os.environ['OTEL_FORGE_OTLP_RECEIVER_GRPC_PORT']}", insecure=True, headers=headers
    )
else:
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    exporter = OTLPMetricExporter(
        endpoint=f"http://127.0.0.1:{os.environ['OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT']}/v1/metrics", headers=headers
    )
reader = PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)
provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": "sender"}))
meter = provider.get_meter("sender")
samples = meter.create_counter("samples", unit="1")
queue = meter.create_up_down_counter("queue.depth")
latency = meter.create_histogram("step.latency", unit="ms")
temperature = [61.5]
meter.create_observable_gauge(
    "loader.temperature", callbacks=[lambda _options: [Observation(temperature[0], {"loader": "a"})]]
)

samples.add(100, {"split": "train"})
queue.add(5)
for value in (1.0, 2.0, 3.0):
    latency.record(value)
assert provider.force_flush(10_000), "the first export"
samples.add(50, {"split": "train"})
queue.add(-2)
latency.record(6.0)
temperature[0] = 63.5
assert provider.force_flush(10_000), "the second export"
provider.shutdown()
print("sent", flush=True)
