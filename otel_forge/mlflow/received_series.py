"""``ReceivedSeries``: the OTLP metrics one run was sent, as MLflow keys.

Each series (a metric and its point's attributes) keeps its latest state; ``sample()`` gives that
state once per sampling interval, and the run's ``MLflowMetricExporter`` folds the samples into
windows as it folds the node's own: one step per window. How each kind of point becomes keys
(``<prefix><metric>[/<attribute>_<value>...]``):

- a gauge: its value (the window's mean, and max and min where ``mlflow_stats`` asks);
- a monotonic sum (a counter): its total, and ``/rate``, its growth per second over the window;
  a delta sum is added up into its total first;
- a non-monotonic sum (an up-down counter): its value (delta: added up);
- a histogram: ``/count``, ``/mean`` and ``/p50``, ``/p90``, ``/p99`` (interpolated within the
  buckets, as Prometheus's ``histogram_quantile`` does), since the series began (delta: added up);
- an exponential histogram: ``/count`` and ``/mean``; a summary: ``/count``, ``/mean`` and its
  quantiles as sent.

At most ``max_series`` series: the points of a series past the cap are refused (counted, for the
OTLP response's partial success) and said once.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AggregationTemporality,
    HistogramDataPoint,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
)

from otel_forge.mlflow.keys import Sample, key_segment, sanitize_key
from otel_forge.names import Fold

_logger = logging.getLogger(__name__)

QUANTILES = (0.5, 0.9, 0.99)
_DELTA = AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA


@dataclass
class _Histogram:
    """A histogram series added up (delta points) or as last sent (cumulative)."""

    count: int = 0
    total: float = 0.0
    bounds: tuple[float, ...] = ()
    buckets: list[int] = field(default_factory=list)

    def take(self, point: HistogramDataPoint, delta: bool) -> None:
        bounds = tuple(point.explicit_bounds)
        if not delta or bounds != self.bounds or len(self.buckets) != len(point.bucket_counts):
            self.count, self.total, self.bounds, self.buckets = 0, 0.0, bounds, [0] * len(point.bucket_counts)
        self.count += point.count
        self.total += point.sum
        for index, count in enumerate(point.bucket_counts):
            self.buckets[index] += count

    def quantile(self, q: float) -> float | None:
        """As ``histogram_quantile``: linear within the bucket the rank falls in; the last bucket
        (to +Inf) answers its lower bound."""
        if not self.count or not self.bounds:
            return None
        rank, seen = q * self.count, 0
        for index, count in enumerate(self.buckets):
            if count and seen + count >= rank:
                if index >= len(self.bounds):
                    return self.bounds[-1]
                lower = self.bounds[index - 1] if index else min(0.0, self.bounds[0])
                return lower + (self.bounds[index] - lower) * (rank - seen) / count
            seen += count
        return self.bounds[-1]


class ReceivedSeries:
    """The received series of one run, keyed ``prefix``..., at most ``max_series`` of them."""

    def __init__(self, prefix: str, max_series: int, run: str) -> None:
        self._prefix = prefix
        self._max_series = max_series
        self._run = run
        self._lock = threading.Lock()  # a request's points (a receiver's thread) and the sampling tick
        self._values: Sample = {}
        self._totals: dict[str, float] = {}  # delta sums added up
        self._histograms: dict[str, _Histogram] = {}
        self._series: set[str] = set()
        self.refused = 0  # points of series past the cap

    def add(self, resource_metrics: Iterable[ResourceMetrics]) -> int:
        """Take the points; the count of those refused (their series past the cap)."""
        refused = 0
        with self._lock:
            for resource in resource_metrics:
                for scope in resource.scope_metrics:
                    for metric in scope.metrics:
                        refused += self._metric(metric)
            if refused and not self.refused:
                _logger.warning(
                    "OTLP receiver: run %s has %d received series, the most it takes "
                    "(OTEL_FORGE_OTLP_RECEIVER_MAX_SERIES); points of new series are refused",
                    self._run,
                    self._max_series,
                )
            self.refused += refused
        return refused

    def sample(self) -> Sample:
        with self._lock:
            return dict(self._values)

    def _metric(self, metric: Metric) -> int:
        kind = metric.WhichOneof("data")
        name = self._prefix + sanitize_key(metric.name)
        refused = 0
        for point in getattr(metric, kind).data_points if kind else ():
            series = _series_key(name, point.attributes)
            if series not in self._series:
                if len(self._series) >= self._max_series:
                    refused += 1
                    continue
                self._series.add(series)
            self._point(kind, metric, series, point)
        return refused

    def _point(self, kind: str | None, metric: Metric, series: str, point: object) -> None:
        if kind == "gauge":
            self._set(series, Fold.MEAN, _number(point))  # type: ignore[arg-type]
        elif kind == "sum":
            value = _number(point)  # type: ignore[arg-type]
            if metric.sum.aggregation_temporality == _DELTA:
                value = self._totals[series] = self._totals.get(series, 0.0) + value
            if metric.sum.is_monotonic:
                self._set(series, Fold.LAST, value)
                self._set(f"{series}/rate", Fold.RATE, value)
            else:
                self._set(series, Fold.MEAN, value)
        elif kind == "histogram":
            histogram = self._histograms.setdefault(series, _Histogram())
            histogram.take(point, metric.histogram.aggregation_temporality == _DELTA)  # type: ignore[arg-type]
            self._counted(series, histogram.count, histogram.total)
            for q in QUANTILES:
                self._set(f"{series}/p{round(q * 100)}", Fold.LAST, histogram.quantile(q))
        elif kind in ("exponential_histogram", "summary"):
            self._counted(series, point.count, point.sum)  # type: ignore[attr-defined]
            for quantile in getattr(point, "quantile_values", ()):
                self._set(f"{series}/p{quantile.quantile * 100:g}", Fold.LAST, quantile.value)

    def _counted(self, series: str, count: float, total: float) -> None:
        self._set(f"{series}/count", Fold.LAST, count)
        self._set(f"{series}/mean", Fold.LAST, total / count if count else None)

    def _set(self, key: str, fold: Fold, value: float | None) -> None:
        if value is not None and math.isfinite(value):  # NaN and inf are never sent
            self._values[sanitize_key(key)] = (fold, float(value))


def _number(point: NumberDataPoint) -> float:
    return float(point.as_int) if point.WhichOneof("value") == "as_int" else point.as_double


def _series_key(name: str, attributes: Sequence[KeyValue]) -> str:
    """The metric's key and its point's attributes, in their keys' order: ``/<key>_<value>`` each."""
    parts = sorted(f"{key_segment(a.key)}_{key_segment(_text(a.value))}" for a in attributes)
    return "/".join([name, *parts])


def _text(value: AnyValue) -> str:
    kind = value.WhichOneof("value")
    return str(getattr(value, kind)) if kind in ("string_value", "bool_value", "int_value", "double_value") else "_"
