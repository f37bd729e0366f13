"""``Agent``: the collectors on a MeterProvider of its own whose one reader feeds every sink.

Each collect goes to the Prometheus endpoint's rendering, the OTLP exporter and any extra exporters
(the MLflow exporter) through ``FanOutExporter``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from otel_forge.collectors import Collector, CollectorUnavailable, OpenedCollectors, open_collectors
from otel_forge.config import ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.node import NodeIdentity, build_resource
from otel_forge.pipeline.instruments import INSTRUMENTATION_SCOPE, InstrumentSet
from otel_forge.pipeline.provider import begin_sampling, build_meter_provider, parent_only_reader

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricExporter, MetricReader

    from otel_forge.pipeline.fanout import FanOutExporter
    from otel_forge.pipeline.prometheus_endpoint import PrometheusEndpoint
    from otel_forge.pipeline.prometheus_rendering import PrometheusRendering

_logger = logging.getLogger(__name__)

# Builds an extra sink (the MLflow exporter) at each start: a shut-down exporter is not reused.
ExporterFactory = Callable[[], "MetricExporter"]

# A baseline this long after the start (the counters' start, and an endpoint with values; a moment
# later, as CPU time counts in 10 ms ticks), the first sample this long after it, then one each
# interval (each at most an interval): a run holds its hardware after a second, rates included.
BASELINE_S, FIRST_SAMPLE_S = 0.25, 1.0


_PORT_FIX = (
    "serve another port (--prometheus-port 0 or OTEL_EXPORTER_PROMETHEUS_PORT=0 picks a free one) or none "
    "(--no-prometheus or OTEL_FORGE_PROMETHEUS=false)"
)


class EndpointError(OSError):
    """An endpoint could not be served (e.g. the Prometheus port is in use)."""


def serve_prometheus(config: ForgeConfig, rendering: PrometheusRendering) -> PrometheusEndpoint:
    """The endpoint on the configured host and port, or ``EndpointError`` saying which setting named them."""
    from otel_forge.pipeline.prometheus_endpoint import PrometheusEndpoint

    try:
        return PrometheusEndpoint.serve(rendering, config.prometheus_host, config.prometheus_port)
    except OSError as error:
        raise _endpoint_error(config, error) from None


def check_prometheus_port(config: ForgeConfig) -> None:
    """``EndpointError`` now where the configured port cannot be served, for a caller that starts its agent
    a moment later (``otel-forge run``, after CMD): bound as the endpoint binds it, and let go."""
    from otel_forge.pipeline.prometheus_endpoint import bind

    if not config.prometheus or not config.prometheus_port:
        return
    try:
        bind(config.prometheus_host, config.prometheus_port).close()
    except OSError as error:
        raise _endpoint_error(config, error) from None


def _endpoint_error(config: ForgeConfig, error: OSError) -> EndpointError:
    where = f"{config.prometheus_host}:{config.prometheus_port}"
    return EndpointError(
        f"cannot serve Prometheus on {where} "
        f"(prometheus_port from {config.source('prometheus_port')}): {error.strerror or error}; {_PORT_FIX}"
    )


class Agent:
    """The node agent. ``start()`` opens collectors and serves them; ``shutdown()`` undoes it all.

    Only local rank 0 of a node samples: on other ranks ``start()`` does nothing, so the same
    code can run in every rank of a job. A stopped agent can be started again.
    """

    def __init__(
        self,
        config: ForgeConfig | None = None,
        extra_exporters: Sequence[ExporterFactory] = (),
        node: NodeIdentity | None = None,
        extra_collectors: Sequence[Collector] = (),
    ) -> None:
        self.config = config or ForgeConfig.resolve()
        self.node = node or NodeIdentity.from_config(self.config)
        self._extra_exporters = extra_exporters
        self._extra_collectors = extra_collectors
        self.collectors: OpenedCollectors | None = None
        self.instruments: InstrumentSet | None = None
        self.meter_provider: MeterProvider | None = None
        self.endpoints: list[str] = []
        self._prometheus: PrometheusEndpoint | None = None
        self.fan_out: FanOutExporter | None = None  # the one collect's sinks
        self._fan_out_reader: MetricReader | None = None
        self._pid = os.getpid()

    @property
    def running(self) -> bool:
        return self.meter_provider is not None

    def start(self) -> Agent:
        if self.running:
            return self
        self._pid = os.getpid()
        if not self.node.runs_agent:
            _logger.info("local rank %s: the node's agent runs on local rank 0", self.node.local_rank)
            return self
        collectors = open_collectors(self.config)
        resource = build_resource(self.config, self.node)
        try:
            # Last before the provider: a periodic reader's timer runs from its construction.
            readers = self._build_readers()
        except BaseException:
            collectors.close()
            raise
        self.collectors = collectors
        self.meter_provider = build_meter_provider(readers, resource)
        self.instruments = InstrumentSet(
            self.meter_provider.get_meter(INSTRUMENTATION_SCOPE),
            (*self.collectors.present, *self._extra_collectors),
            self.config.snapshot_max_age_s,
        )
        begin_sampling(readers, self.instruments.expire)
        return self

    def _build_readers(self) -> list[MetricReader]:
        """One periodic reader whose one collect per interval goes to every sink (Prometheus's
        rendering, OTLP, MLflow, extra exporters); an OTLP exporter set to delta gets its own."""
        from otel_forge.pipeline.fanout import FanOutExporter, cumulative_only

        # Ours, not the SDK's reading of OTEL_METRIC_EXPORT_*: the settings table resolved those.
        interval_ms, timeout_ms = self.config.sampling_interval_s * 1000, self.config.export_timeout_s * 1000
        baseline_s, first_s = (min(s, self.config.sampling_interval_s) for s in (BASELINE_S, FIRST_SAMPLE_S))
        timing: dict[str, Any] = dict(
            export_interval_millis=interval_ms,
            export_timeout_millis=timeout_ms,
            first_collects_s=(baseline_s, baseline_s + first_s),
        )
        sinks: list[MetricExporter] = []
        readers: list[MetricReader] = []
        self.endpoints = []
        rendering = None
        if self.config.prometheus:
            from otel_forge.pipeline.prometheus_rendering import PrometheusRendering

            rendering = PrometheusRendering()
            self._prometheus = serve_prometheus(self.config, rendering)
            sinks.append(rendering)
            self.endpoints.append(f"prometheus {self._prometheus.url}")
        if self.config.otlp_endpoint:
            from otel_forge.pipeline.otlp import otlp_exporter

            otlp = otlp_exporter(self.config)
            if cumulative_only(otlp):
                sinks.append(otlp)
            else:
                readers.append(parent_only_reader(otlp, **timing))
            self.endpoints.append(f"otlp {self.config.otlp_protocol} {self.config.otlp_metrics_url}")
        sinks.extend(factory() for factory in self._extra_exporters)
        if sinks:
            self.fan_out = FanOutExporter(sinks)
            reader = parent_only_reader(self.fan_out, **timing)
            if rendering is not None:
                rendering.collect_now = reader.collect
            readers.append(reader)
            self._fan_out_reader = reader
        return readers

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop readers (each exports one last time), free the port, close the collectors. In a
        forked child, nothing: the agent is its parent's."""
        if forked_from(self._pid):
            return
        closing: threading.Thread | None = None
        if self._prometheus is not None:
            # Its serve loop notices shutdown only at its next 0.5 s poll: wait for it alongside.
            closing = threading.Thread(target=self._prometheus.close, name="otel-forge-prometheus-close")
            closing.start()
            self._prometheus = None
        if self.meter_provider is not None:
            self.meter_provider.shutdown(timeout_millis=timeout_s * 1000)
            self.meter_provider = None
            self._fan_out_reader = None
        if closing is not None:
            closing.join()
        if self.instruments is not None:
            self.instruments.unregister()
            self.instruments = None
        if self.collectors is not None:
            self.collectors.close()
            self.collectors = None

    def collect(self) -> None:
        """One collect now, to the fan-out's sinks (as a scrape before the first collect does)."""
        if self._fan_out_reader is not None and self.meter_provider is not None:
            self._fan_out_reader.collect()

    def stop(self) -> None:
        """``shutdown`` with a short deadline: what the CLI calls on SIGTERM."""
        self.shutdown(timeout_s=2.0)

    def follow_process(self, pid: int) -> None:
        """The monitored process tree is rooted at ``pid`` from now on."""
        self._each_collector(lambda collector: collector.follow_process(pid))

    def add_process(self, pid: int) -> None:
        """The process tree rooted at ``pid`` is monitored too, reported apart (``process.pid``)."""
        self._each_collector(lambda collector: collector.add_process(pid))

    def remove_process(self, pid: int) -> None:
        self._each_collector(lambda collector: collector.remove_process(pid))

    def _each_collector(self, change: Callable[[Collector], None]) -> None:
        for collector in self.collectors.present if self.collectors else ():
            try:
                change(collector)
            except CollectorUnavailable as error:
                _logger.warning("collector %s: the monitored process is not read: %s", collector.name, error)

    @property
    def absent_collectors(self) -> dict[str, str]:
        """Each configured collector that did not open, with the reason."""
        return dict(self.collectors.absent) if self.collectors else {}

    def __enter__(self) -> Agent:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
