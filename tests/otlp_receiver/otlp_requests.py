"""OTLP requests for the receiver's tests: gauges made as protobuf, and a POST of a body."""

from __future__ import annotations

import http.client

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Gauge, Metric, NumberDataPoint, ResourceMetrics, ScopeMetrics


def gauges(count: int, name: str = "load", value: float = 1.0, first: int = 0) -> ExportMetricsServiceRequest:
    points = [
        NumberDataPoint(as_double=value, attributes=[KeyValue(key="i", value=AnyValue(int_value=i))])
        for i in range(first, first + count)
    ]
    metric = Metric(name=name, gauge=Gauge(data_points=points))
    return ExportMetricsServiceRequest(
        resource_metrics=[ResourceMetrics(scope_metrics=[ScopeMetrics(metrics=[metric])])]
    )


def post(port: int, body: bytes, content_type: str = "application/x-protobuf", **headers: str):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        connection.request("POST", "/v1/metrics", body, {"Content-Type": content_type, **headers})
        reply = connection.getresponse()
        return reply.status, reply.getheader("Content-Type"), reply.read(), reply.getheader("Retry-After")
    finally:
        connection.close()
