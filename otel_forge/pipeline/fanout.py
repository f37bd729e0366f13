"""``FanOutExporter``: one collect, every sink.

The agent's one periodic reader collects once per interval and hands that ``MetricsData`` to
``FanOutExporter``, which gives it to each sink. A sink that never blocks (the Prometheus rendering,
the MLflow exporter: both only convert and enqueue) is called inline; any other (OTLP, an exporter
a user adds) runs on a thread of its own with a mailbox of one collect, so a hung endpoint delays
no other sink: while it is busy, a newer collect replaces the one waiting (cumulative data loses
nothing by that) and the skip is counted.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from opentelemetry.sdk.metrics.export import AggregationTemporality, MetricExporter, MetricExportResult, MetricsData

from otel_forge.scrub import scrub

_logger = logging.getLogger(__name__)


class NonBlockingExporter(MetricExporter):
    """An exporter whose ``export`` only converts and enqueues: the fan-out calls it inline."""


class _SinkThread:
    """One blocking sink on its own thread, fed the latest collect."""

    def __init__(self, exporter: MetricExporter) -> None:
        self.exporter = exporter
        self.skipped = 0  # collects replaced before this sink could take them
        self._pending: MetricsData | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"otel-forge-sink-{type(exporter).__name__}", daemon=True
        )
        self._thread.start()

    def offer(self, data: MetricsData) -> None:
        with self._cond:
            self.skipped += self._pending is not None
            self._pending = data
            self._cond.notify()

    def _run(self) -> None:
        while (data := self._take()) is not None:
            try:
                self.exporter.export(data)
            except Exception as error:  # noqa: BLE001 - one sink's failure is its own
                _logger.warning("%s: export failed: %s", type(self.exporter).__name__, scrub(str(error)))

    def _take(self) -> MetricsData | None:
        with self._cond:
            while self._pending is None and not self._closed:
                self._cond.wait()
            data, self._pending = self._pending, None
            return data

    def close(self, timeout_s: float) -> None:
        """Export what waits, within ``timeout_s``, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout_s)


class FanOutExporter(MetricExporter):
    """Gives each collect to every sink: inline for a ``NonBlockingExporter``, else on its thread."""

    def __init__(self, sinks: Sequence[MetricExporter]) -> None:
        super().__init__()  # the SDK's default, cumulative: what Prometheus and MLflow need
        self.sinks = tuple(sinks)
        self._inline = [sink for sink in self.sinks if isinstance(sink, NonBlockingExporter)]
        self._threads = [_SinkThread(sink) for sink in self.sinks if not isinstance(sink, NonBlockingExporter)]
        self.exports = 0  # collects handed out: one per interval, whatever the number of sinks

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        self.exports += 1
        for thread in self._threads:
            thread.offer(metrics_data)
        for sink in self._inline:
            try:
                sink.export(metrics_data)
            except Exception as error:  # noqa: BLE001 - one sink's failure is its own
                _logger.warning("%s: export failed: %s", type(sink).__name__, scrub(str(error)))
        return MetricExportResult.SUCCESS

    @property
    def skipped(self) -> dict[str, int]:
        """Per threaded sink, the collects a newer one replaced while it was busy."""
        return {type(thread.exporter).__name__: thread.skipped for thread in self._threads}

    def skipped_by(self, exporter: MetricExporter) -> int:
        """The collects a newer one replaced while ``exporter`` (a threaded sink) was busy."""
        return sum(thread.skipped for thread in self._threads if thread.exporter is exporter)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return all(sink.force_flush(timeout_millis) for sink in self.sinks)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        """Each sink gets the time left: threaded ones export what waits, then every sink shuts down."""
        timeout_s = float(kwargs.get("timeout", timeout_millis)) / 1000  # type: ignore[arg-type]
        for thread in self._threads:
            thread.close(timeout_s)
        for sink in self.sinks:
            sink.shutdown(timeout_millis=timeout_s * 1000)


def cumulative_only(exporter: MetricExporter) -> bool:
    """Whether ``exporter`` takes the cumulative data the fan-out gives (an OTLP exporter set to
    delta by ``OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE`` needs a reader of its own)."""
    preferred = getattr(exporter, "_preferred_temporality", None) or {}
    return all(value is AggregationTemporality.CUMULATIVE for value in preferred.values())
