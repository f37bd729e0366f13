"""``PrometheusTranslation``: opentelemetry-exporter-prometheus's own OTel -> Prometheus translation
(names, units, ``target_info``, ``otel_scope_*`` labels), fed one collect at a time, at the cost of
what a collect changes.

Two things it redoes every collect give the same result each time, and are kept:
- the name mappings (a metric's name and unit, each label key: regexes), memoized once per process
  (re-mapping them was half the translation's CPU);
- a metric's label keys and rows, built from its points' attributes a label at a time: the SDK's
  aggregations keep their attribute objects from one collect to the next, so points with the same
  attribute objects (and the same scope and resource labels) have the labels of the last collect.
A collect then translates its values.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from types import ModuleType
from typing import Any

import opentelemetry.exporter.prometheus as otel_prometheus
from opentelemetry.exporter.prometheus import _CustomCollector
from opentelemetry.sdk.metrics.export import HistogramDataPoint, MetricsData

# The translation's name mappings: pure functions (a string in, its Prometheus form out) that run
# regexes over every label key of every data point, and every metric name and unit, each collect.
NAME_MAPPINGS = ("sanitize_attribute", "sanitize_full_name", "map_unit")

# A metric's points' attribute objects (held, so that their ids stay theirs), label keys, label rows.
_Labels = tuple[tuple[Any, ...], list[str], list[list[str]]]


def memoize(module: ModuleType, names: Iterable[str]) -> None:
    """Replace each of ``names``, a pure function of ``module`` over names and label values (a string
    and flags in, its Prometheus form out), by its memoized self, once per process: the same few dozen
    strings come every collect. Same function, same output; a caller that looks it up in the module
    at each call (as the exporter and prometheus_client do) gets the memoized one."""
    for name in names:
        function = getattr(module, name)
        if not hasattr(function, "cache_info"):
            setattr(module, name, functools.lru_cache(maxsize=4096)(function))


def _value(point: Any) -> Any:
    """A point's value as the exporter's families take it."""
    if isinstance(point, HistogramDataPoint):
        return {"bucket_counts": point.bucket_counts, "explicit_bounds": point.explicit_bounds, "sum": point.sum}
    return point.value


class PrometheusTranslation(_CustomCollector):
    """One collect's ``MetricsData`` in, its Prometheus families (prometheus_client's) out."""

    def __init__(self) -> None:
        memoize(otel_prometheus, NAME_MAPPINGS)
        super().__init__()
        # By (the points' attribute ids, scope labels, resource labels): this collect's, the last one's.
        self._labels: dict[Any, _Labels] = {}
        self._last_labels: dict[Any, _Labels] = {}
        self.labels_built = 0  # metrics whose labels were built, not kept

    def translate(self, data: MetricsData) -> list[Any]:
        self._last_labels, self._labels = self._labels, {}  # what no point uses any more goes
        self.add_metrics_data(data)
        return list(self.collect())

    def _collect_data_points(
        self, metric_data: Any, scope_attrs: dict[str, Any], resource_attrs: dict[str, Any]
    ) -> tuple[list[str], list[list[str]], list[Any]]:
        points = metric_data.data_points
        attributes = tuple(point.attributes for point in points)
        try:
            key = (tuple(map(id, attributes)), tuple(scope_attrs.items()), tuple(resource_attrs.items()))
            kept = self._labels.get(key) or self._last_labels.get(key)
        except TypeError:  # a label value that cannot be hashed (a list): built each time
            return super()._collect_data_points(metric_data, scope_attrs, resource_attrs)
        if kept is None:
            label_keys, label_rows, values = super()._collect_data_points(metric_data, scope_attrs, resource_attrs)
            self._labels[key] = (attributes, label_keys, label_rows)
            self.labels_built += 1
            return label_keys, label_rows, values
        self._labels[key] = kept
        return kept[1], kept[2], [_value(point) for point in points]
