"""Build OpenTelemetry SDK ``MetricsData`` by hand: what a ``PeriodicExportingMetricReader`` would
hand to an exporter, with exactly the points a test wants."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

# (attributes, value)
Point = tuple[Mapping[str, Any], float]


def points(values: Iterable[Point]) -> list[NumberDataPoint]:
    now = time.time_ns()
    return [NumberDataPoint(dict(attributes), now, now, value) for attributes, value in values]


def gauge(name: str, values: Iterable[Point], unit: str = "1") -> Metric:
    return Metric(name, "", unit, Gauge(points(values)))


def counter(name: str, values: Iterable[Point], unit: str = "By") -> Metric:
    return Metric(name, "", unit, Sum(points(values), AggregationTemporality.CUMULATIVE, True))


def metrics_data(*metrics: Metric) -> MetricsData:
    scope = ScopeMetrics(InstrumentationScope("otel_forge"), list(metrics), "")
    return MetricsData([ResourceMetrics(Resource.create({"service.name": "test"}), [scope], "")])


def as_named_points(data: MetricsData) -> list[tuple[str, list[NumberDataPoint]]]:
    """What ``KeyMapper.sample`` takes: (metric name, data points)."""
    return [
        (metric.name, list(metric.data.data_points))
        for resource in data.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    ]
