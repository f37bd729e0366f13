"""``otel_forge.monitor``: the node agent with the MLflow exporter as one more sink, into a run."""

from __future__ import annotations

import logging
from typing import Any

from otel_forge.collectors.self_telemetry import DeliveryStatsCollector, RunInfoCollector
from otel_forge.config import ConfigError, ForgeConfig
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.system_metrics.exporter import MLflowMetricExporter
from otel_forge.mlflow.system_metrics.windows import delivery_phase_s
from otel_forge.node import NodeIdentity
from otel_forge.pipeline import Agent, EndpointError

_logger = logging.getLogger(__name__)


def _active_run() -> tuple[str, str]:
    import mlflow

    run = mlflow.active_run()
    if run is None:
        raise ConfigError("invalid run_id (from default): no run id given and no active MLflow run")
    return run.info.run_id, mlflow.get_tracking_uri()


class SystemMetricsMonitor:
    """The agent plus the MLflow exporter (a sink of its one collect) into one run;
    ``start()``/``stop()`` or a ``with`` block.

    Only local rank 0 of a node samples; elsewhere start/stop do nothing.
    """

    def __init__(self, config: ForgeConfig, node: NodeIdentity | None = None, run_pending: bool = False) -> None:
        self.config = config
        self.node = node or NodeIdentity.from_config(config)
        # Sampling starts now; the windows wait in the spool until ``attach`` names the run.
        self._run_pending = run_pending
        self.exporter: MLflowMetricExporter | None = None
        self.agent: Agent | None = None

    @property
    def run_id(self) -> str | None:
        return self.config.run_id

    def start(self) -> SystemMetricsMonitor:
        if self.agent is not None or not self.node.runs_agent:
            return self
        if self.config.run_id is None and not self._run_pending:
            run_id, tracking_uri = _active_run()
            self.config = self.config.replace(run_id=run_id, tracking_uri=self.config.tracking_uri or tracking_uri)
        self.exporter = self._exporter()
        self.agent = self._agent(self.exporter)
        try:
            self.agent.start()
        except EndpointError as error:
            # A busy Prometheus port must not cost the run its system metrics.
            _logger.warning("%s; continuing without the Prometheus endpoint", error)
            self.config = self.config.replace(prometheus=False)
            self.agent = self._agent(self.exporter)
            self.agent.start()
        return self

    def _exporter(self) -> MLflowMetricExporter:
        c = self.config
        samples_per_window = c.mlflow_samples_per_window(self.node.node_count)
        phase_s = delivery_phase_s(self.node.node_id or self.node.hostname, samples_per_window * c.sampling_interval_s)
        return MLflowMetricExporter(
            c.run_id,
            tracking_uri=c.tracking_uri,
            node_id=self.node.node_id,
            config=c,
            samples_per_window=samples_per_window,
            delivery_phase_s=phase_s,
            known=RunInfo(c.experiment_id, "") if c.experiment_id else None,
        )

    def _agent(self, exporter: MLflowMetricExporter) -> Agent:
        collectors = [
            DeliveryStatsCollector(exporter.delivery_counts),
            RunInfoCollector(exporter.window_logger, self.node.node_id),
        ]
        return Agent(self.config, node=self.node, extra_collectors=collectors, extra_exporters=[lambda: exporter])

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """The run is open: the windows sampled so far, and all after, go to it."""
        self.config = self.config.replace(run_id=run_id)
        if self.exporter is not None:
            self.exporter.attach(run_id, known)

    @property
    def endpoints(self) -> list[str]:
        if self.agent is None or self.exporter is None:
            return []
        run = self.config.run_id or "(when it opens)"
        return [*self.agent.endpoints, f"mlflow run {run} ({self.exporter.window_logger.prefix}...)"]

    @property
    def absent_collectors(self) -> dict[str, str]:
        return self.agent.absent_collectors if self.agent else {}

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.shutdown(timeout_s=self.config.drain_deadline_s + 5)
            self.agent = None

    def __enter__(self) -> SystemMetricsMonitor:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def monitor(
    run_id: str | None = None,
    tracking_uri: str | None = None,
    node_id: str | None = None,
    sampling_interval: float | None = None,
    samples_per_window: int | None = None,
    prometheus: bool | None = None,
    otlp: str | None = None,
    config: ForgeConfig | None = None,
    **settings: Any,
) -> SystemMetricsMonitor:
    """Sample this node into an MLflow run (default: MLflow's active run) and start at once.

    Use as ``with otel_forge.monitor(): ...`` or keep the handle and call ``stop()``. Other
    ``ForgeConfig`` fields may be passed as keywords (``stats=`` is ``mlflow_stats``).
    """
    if "stats" in settings:
        settings["mlflow_stats"] = settings.pop("stats")
    explicit = dict(
        run_id=run_id,
        tracking_uri=tracking_uri,
        node_id=node_id,
        sampling_interval_s=sampling_interval,
        samples_per_window=samples_per_window,
        prometheus=prometheus,
        otlp_endpoint=otlp,
        **settings,
    )
    explicit = {k: v for k, v in explicit.items() if v is not None}
    base = config or ForgeConfig.resolve()
    return SystemMetricsMonitor(base.replace(**explicit) if explicit else base).start()
