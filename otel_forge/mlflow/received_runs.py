"""``ReceivedRuns``: OTLP metrics received by this process, into MLflow runs.

A request's metrics go to the run its ``x-mlflow-run-id`` header names (MLflow's own convention for
OTLP traces), else to the run its resource's ``mlflow.run_id`` attribute names, else to the run this
process serves (``serve``: the job's run of ``otel-forge run``, the node agent's ``--run-id``), which
may open later: its windows wait in the spool meanwhile. Each run gets its ``ReceivedSeries``. The
served run's are sampled into the node's own windows where the process samples its node into that
run (``served_sample``: one step per window with the node's ``system/`` metrics); every other run's get
an ``MLflowMetricExporter`` of their own under the receiver's prefix, sampled once an interval by a
thread. Either way the same windows, spool and delivery as the node's, so an outage loses nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.metrics.v1.metrics_pb2 import ResourceMetrics

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.keys import Sample
from otel_forge.mlflow.received_series import ReceivedSeries
from otel_forge.mlflow.system_metrics.exporter import MLflowMetricExporter
from otel_forge.pipeline.otlp_receiver import RUN_HEADER, OtlpReceiver, Received

_logger = logging.getLogger(__name__)

RUN_ATTRIBUTE = "mlflow.run_id"  # a resource attribute naming the run
MAX_RUNS = 64  # distinct runs one receiver delivers to: each holds an exporter and its spool
_SERVED = ""  # the run this process serves, whichever it is


@dataclass(frozen=True)
class _RunSink:
    series: ReceivedSeries
    exporter: MLflowMetricExporter | None  # None: the served run's, sampled by the node's exporter


class ReceivedRuns:
    """The OTLP receiver (``start``, ``stop``), its requests routed to runs, and each run's series
    sampled once an interval."""

    def __init__(
        self, config: ForgeConfig, tracking_uri: str | None, serves_a_run: bool = True, node_windows: bool = False
    ) -> None:
        """``serves_a_run``: this process serves a run (False: a node agent with no run: a request
        must name its run). ``node_windows``: the node's exporter takes ``served_sample`` with each
        of its samples."""
        self._config = config
        self._serves_a_run = serves_a_run
        self.node_windows = serves_a_run and node_windows
        self._tracking_uri = tracking_uri
        self._sinks: dict[str, _RunSink] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._served: tuple[str, RunInfo | None] | None = None
        self._ticks = threading.Thread(target=self._tick, name="otel-forge-otlp-windows", daemon=True)
        self.receiver = OtlpReceiver(config, self.receive)

    def start(self) -> ReceivedRuns:
        self._ticks.start()
        self.receiver.start()
        return self

    def serve(self, run_id: str, known: RunInfo | None = None) -> None:
        """The run this process serves is open: what came for it so far, and all after, go to it."""
        with self._lock:
            self._served = (run_id, known)
            sink = self._sinks.get(_SERVED)
        if sink is not None and sink.exporter is not None:
            sink.exporter.attach(run_id, known)

    def served_sample(self) -> Sample:
        """The served run's series, now (``node_windows``: the node's exporter calls it per sample)."""
        sink = self._sinks.get(_SERVED)
        return sink.series.sample() if sink is not None else {}

    def receive(self, request: ExportMetricsServiceRequest, run_id: str | None) -> Received:
        """``request``'s points into their runs; ``run_id``: its ``x-mlflow-run-id``."""
        routed: dict[str, list[ResourceMetrics]] = {}
        served = self._served[0] if self._served else None
        for resource in request.resource_metrics:
            named = run_id or _attribute(resource, RUN_ATTRIBUTE) or _SERVED
            routed.setdefault(_SERVED if named == served else named, []).append(resource)
        refused, reasons = 0, []
        for target, resources in routed.items():
            if target == _SERVED and not self._serves_a_run:
                refused += _points(resources)
                reasons.append(f"no run named: set the {RUN_HEADER} header or the {RUN_ATTRIBUTE} resource attribute")
                continue
            sink = self._sink(target)
            if sink is None:
                refused += _points(resources)
                reasons.append(f"no more than {MAX_RUNS} runs are received into; run {target} refused")
                continue
            if taken := sink.series.add(resources):
                refused += taken
                most = self._config.otlp_receiver_max_series
                reasons.append(f"run {target or served or '(opening)'} has the most series it takes ({most})")
        return Received(refused, "; ".join(reasons))

    def _sink(self, target: str) -> _RunSink | None:
        with self._lock:
            if (sink := self._sinks.get(target)) is not None:
                return sink
            if len(self._sinks) >= MAX_RUNS:
                return None
            served = self._served if target == _SERVED else None
            run_id = served[0] if served else (target or None)
            config = self._config
            series = ReceivedSeries(config.otlp_receiver_prefix, config.otlp_receiver_max_series, run_id or "(opening)")
            if target == _SERVED and self.node_windows:
                sink = self._sinks[target] = _RunSink(series, None)
                return sink
            sink = self._sinks[target] = _RunSink(
                series,
                MLflowMetricExporter(
                    run_id,
                    tracking_uri=self._tracking_uri,
                    config=config,
                    known=served[1] if served else None,
                    prefix=config.otlp_receiver_prefix,
                    what="OTLP",
                ),
            )
            return sink

    def latest(self) -> Iterator[tuple[str, str, float]]:
        """(run id, MLflow key, latest value) of each key of each open run."""
        with self._lock:
            sinks = list(self._sinks.values())
            served = self._served[0] if self._served else None
        for sink in sinks:
            if (run_id := sink.exporter.run_id if sink.exporter is not None else served) is not None:
                for key, (_fold, value) in sink.series.sample().items():
                    yield run_id, key, value

    def _exporting(self) -> list[tuple[ReceivedSeries, MLflowMetricExporter]]:
        """The sinks with windows of their own."""
        with self._lock:
            return [(sink.series, sink.exporter) for sink in self._sinks.values() if sink.exporter is not None]

    def _tick(self) -> None:
        while not self._stop.wait(self._config.sampling_interval_s):
            for series, exporter in self._exporting():
                exporter.export_sample(series.sample())

    def stop(self, timeout_s: float) -> None:
        """Receive no more; the last windows delivered within ``timeout_s`` (the rest kept in the spool)."""
        self.receiver.stop()
        self._stop.set()
        if self._ticks.is_alive():
            self._ticks.join()
        for series, exporter in self._exporting():
            exporter.export_sample(series.sample())
            exporter.shutdown(timeout_millis=timeout_s * 1000)


def _attribute(resource: ResourceMetrics, name: str) -> str | None:
    for attribute in resource.resource.attributes:
        if attribute.key == name and attribute.value.WhichOneof("value") == "string_value":
            return attribute.value.string_value or None
    return None


def _points(resources: Iterable[ResourceMetrics]) -> int:
    count = 0
    for resource in resources:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                kind = metric.WhichOneof("data")
                count += len(getattr(metric, kind).data_points) if kind else 0
    return count
