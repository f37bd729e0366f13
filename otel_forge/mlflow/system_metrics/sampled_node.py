"""``SampledNode``: the node's agent with MLflow as one more sink, for as many runs as join it.

One agent reads the node once an interval and its one collect goes to Prometheus, OTLP and each
run's ``MLflowMetricExporter`` (``RunSinks``). ``SystemMetricsMonitor`` holds one run; the node's
companion holds one for every training process it samples for (a sweep's trials, a notebook beside
a job), each run's windows holding the node and its own process tree (``process.pid``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence

from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData

from otel_forge.collectors.base import Collector
from otel_forge.collectors.inventory import node_inventory
from otel_forge.collectors.self_telemetry import DeliveryStatsCollector, RunInfoCollector
from otel_forge.config import ForgeConfig
from otel_forge.mlflow.leftovers import LeftoverDelivery
from otel_forge.mlflow.spool_files import spool_root
from otel_forge.mlflow.system_metrics.exporter import MLflowMetricExporter
from otel_forge.mlflow.system_metrics.window_logger import WindowLogger
from otel_forge.node import NodeIdentity
from otel_forge.pipeline import Agent, EndpointError
from otel_forge.pipeline.fanout import NonBlockingExporter
from otel_forge.scrub import scrub

_logger = logging.getLogger(__name__)


class RunSinks(NonBlockingExporter):
    """The runs' exporters as one sink of the agent's collect; runs join and leave while it runs. A
    run that left still counts in the delivery's counters (they never go down) and is served as a
    run until its drain is done."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.exporters: tuple[MLflowMetricExporter, ...] = ()  # replaced whole: a collect sees one set
        self._leaving: tuple[MLflowMetricExporter, ...] = ()  # draining: no more collects
        self._left: collections.Counter[str] = collections.Counter()  # the delivery counts of runs gone
        self._alone: dict[int, MLflowMetricExporter] = {}  # by thread: the run a collect there is for

    def add(self, exporter: MLflowMetricExporter) -> None:
        with self._lock:
            self.exporters = (*self.exporters, exporter)

    def remove(self, exporter: MLflowMetricExporter) -> None:
        """No more collects for ``exporter``: it drains."""
        with self._lock:
            self.exporters = tuple(e for e in self.exporters if e is not exporter)
            self._leaving = (*self._leaving, exporter)

    def retire(self, exporter: MLflowMetricExporter) -> None:
        """``exporter`` has drained: its counts stay, it is no longer served."""
        with self._lock:
            self._leaving = tuple(e for e in self._leaving if e is not exporter)
            self._left.update(exporter.delivery_counts())

    @contextlib.contextmanager
    def alone(self, exporter: MLflowMetricExporter) -> Iterator[None]:
        """Meanwhile, a collect on this thread goes to ``exporter`` alone (a leaving run's last)."""
        self._alone[threading.get_ident()] = exporter
        try:
            yield
        finally:
            del self._alone[threading.get_ident()]

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        alone = self._alone.get(threading.get_ident())
        for exporter in self.exporters if alone is None else (alone,):
            try:
                exporter.export(metrics_data)
            except Exception as error:  # noqa: BLE001 - one run's failure is its own
                _logger.warning("run %s: export failed: %s", exporter.run_id, scrub(str(error)))
        return MetricExportResult.SUCCESS

    def delivery_counts(self) -> dict[str, int]:
        """The windows delivered, retried, spooled, dropped: the runs' together, those gone included."""
        with self._lock:
            total, served = collections.Counter(self._left), (*self.exporters, *self._leaving)
        for exporter in served:
            total.update(exporter.delivery_counts())
        return dict(total)

    def runs(self) -> list[WindowLogger]:
        return [exporter.window_logger for exporter in (*self.exporters, *self._leaving)]

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return all(exporter.force_flush(timeout_millis) for exporter in self.exporters)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        """The runs still here end with the agent (one run's monitor): each gets the time left."""
        for exporter in self.exporters:
            exporter.shutdown(timeout_millis=timeout_millis, **kwargs)


class SampledNode:
    """The agent, its ``RunSinks`` and the delivery of what earlier processes left on the node;
    ``start``, then ``join`` and ``leave`` per run, ``stop``. A busy Prometheus port costs the runs
    the endpoint, never their windows."""

    def __init__(self, config: ForgeConfig, node: NodeIdentity, extra_collectors: Sequence[Collector] = ()) -> None:
        self.config = config
        self.node = node
        self.sinks = RunSinks()
        self._extra_collectors = extra_collectors
        self.agent: Agent | None = None
        self._leftovers: LeftoverDelivery | None = None
        self._inventory: dict[str, object] | None = None  # read at the first run's join, given to each

    def start(self) -> SampledNode:
        self.agent = self._agent()
        try:
            self.agent.start()
        except EndpointError as error:
            _logger.warning("%s; continuing without the Prometheus endpoint", error)
            self.config = self.config.replace(prometheus=False)
            self.agent = self._agent()
            self.agent.start()
        name = self.node.node_id or self.node.hostname
        self._leftovers = LeftoverDelivery(spool_root(self.config.spool_dir), name).start()
        return self

    def _agent(self) -> Agent:
        where = self.node.kubernetes.attributes() if self.node.kubernetes is not None else None
        collectors = [
            *self._extra_collectors,
            DeliveryStatsCollector(self.sinks.delivery_counts),
            RunInfoCollector(self.sinks.runs, self.node.node_id, where),
        ]
        return Agent(self.config, node=self.node, extra_collectors=collectors, extra_exporters=[lambda: self.sinks])

    def join(self, exporter: MLflowMetricExporter, pid: int | None = None) -> None:
        """``exporter`` takes each collect from now on; ``pid``: its process tree is read too."""
        assert self.agent is not None
        if pid is not None:
            self.agent.add_process(pid)
        if self._inventory is None and self.agent.collectors is not None:
            self._inventory = node_inventory(self.agent.collectors.present, self.node.kubernetes)
        if self._inventory is not None:
            exporter.record_inventory(self._inventory)
        self.sinks.add(exporter)

    def leave(self, exporter: MLflowMetricExporter, timeout_s: float, pid: int | None = None) -> None:
        """One last collect for ``exporter`` alone (the run's last window ends now), then its drain."""
        if self.agent is not None:
            with self.sinks.alone(exporter):
                self.agent.collect()
        self.sinks.remove(exporter)
        if pid is not None and self.agent is not None:
            self.agent.remove_process(pid)
        exporter.shutdown(timeout_millis=timeout_s * 1000)
        self.sinks.retire(exporter)

    def stop(self, timeout_s: float) -> None:
        """The agent's last collect goes to the runs still joined, which drain within ``timeout_s``."""
        if self._leftovers is not None:
            self._leftovers.stop()
            self._leftovers = None
        if self.agent is not None:
            self.agent.shutdown(timeout_s=timeout_s)
            self.agent = None
