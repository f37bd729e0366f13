"""The agent's periodic reader (``parent_only_reader``): its last collect, at shutdown, gets the
export timeout, as every other collect does. The SDK's own ticker gives the last one only the
interval: a collect that outlasts a short interval (a loaded machine) lost the run's last sample
and printed "Metric collection timed out"."""

from __future__ import annotations

import logging
import time

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from otel_forge.pipeline.provider import parent_only_reader

INTERVAL_MS = 50


class _Collected(MetricExporter):
    def __init__(self) -> None:
        super().__init__()
        self.values: list[float] = []

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        for resource in metrics_data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    self.values.extend(point.value for point in metric.data.data_points)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        pass


def test_the_last_collect_outlasting_the_interval_still_reaches_the_sinks(caplog) -> None:
    exporter = _Collected()
    reader = parent_only_reader(exporter, export_interval_millis=INTERVAL_MS, export_timeout_millis=5_000)
    provider = MeterProvider(metric_readers=[reader])
    stopping = False

    def observe(options: CallbackOptions) -> list[Observation]:
        if stopping:
            time.sleep(4 * INTERVAL_MS / 1000)  # the last collect, on a loaded machine
            return [Observation(2.0)]
        return [Observation(1.0)]

    meter = provider.get_meter("test")
    meter.create_observable_gauge("slow", callbacks=[observe])
    # The SDK checks its deadline before each callback: the one after the slow one finds it past.
    meter.create_observable_gauge("next", callbacks=[lambda options: [Observation(3.0)]])
    reader.begin(lambda: None)
    deadline = time.monotonic() + 10
    while not exporter.values and time.monotonic() < deadline:
        time.sleep(0.01)
    stopping = True
    with caplog.at_level(logging.WARNING):
        provider.shutdown(timeout_millis=5_000)

    assert 2.0 in exporter.values, exporter.values  # the last collect's
    assert not [r for r in caplog.records if "timed out" in r.getMessage()], caplog.text
