"""``otel_forge.monitor``: the node agent with the MLflow exporter as one more sink, into a run."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from otel_forge.collectors.base import Collector
from otel_forge.collectors.self_telemetry import ReceivedCollector
from otel_forge.config import ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.companion import CompanionProcess
from otel_forge.mlflow.fluent_runs import fluent_ended_run_ids, fluent_run, fluent_run_id
from otel_forge.mlflow.keys import Sample
from otel_forge.mlflow.system_metrics.exporter import MLflowMetricExporter
from otel_forge.mlflow.system_metrics.one_sampler import stand_down_mlflow_sampler
from otel_forge.mlflow.system_metrics.sampled_node import SampledNode
from otel_forge.mlflow.system_metrics.windows import CLOSE_SPREAD_SHARE, FIRST_WINDOW_SPREAD_S, delivery_phase_s
from otel_forge.node import NodeIdentity
from otel_forge.pipeline import Agent
from otel_forge.scheduler_grace import close_deadline

if TYPE_CHECKING:
    from otel_forge.mlflow.received_runs import ReceivedRuns

_logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5  # looks at MLflow's in-memory active runs only


def _fluent_tracking_uri() -> str:
    import mlflow

    return str(mlflow.get_tracking_uri())


class FluentRunWatch:
    """Waits, without I/O, for the run a framework opens through MLflow's fluent API on any thread
    (HF's callback opens its run inside ``trainer.train()``), and hands it to ``on_run`` once."""

    def __init__(self, on_run: Callable[[str], None], interval_s: float = WATCH_INTERVAL_S) -> None:
        self._on_run = on_run
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._found = False
        self._ended_before: set[str] = set()
        self._thread = threading.Thread(target=self._watch, name="otel-forge-run-watch", daemon=True)

    def start(self) -> None:
        self._ended_before = fluent_ended_run_ids()
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s) and not self._look():
            pass

    def _look(self) -> bool:
        # A short fit may open and end its run between two looks: a run ended since we started counts.
        run_id = fluent_run_id() or next(iter(fluent_ended_run_ids() - self._ended_before), None)
        if run_id is not None and not self._found:
            self._found = True
            self._on_run(run_id)
        return self._found

    def stop(self) -> None:
        """Stop watching, after a last look: a run opened since the last one still gets the windows."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._look()


def run_exporter(
    config: ForgeConfig,
    node: NodeIdentity,
    close_deadline_s: float,
    *,
    merged: Callable[[], Sample] | None = None,
    process_pid: int | None = None,
) -> MLflowMetricExporter:
    """The MLflow exporter of one run's windows of ``node``, as the settings and the job's size say."""
    samples_per_window = config.mlflow_samples_per_window(node.node_count)
    name = node.node_id or node.hostname
    window_s = samples_per_window * config.sampling_interval_s
    spread = (node.node_count or 1) > 1
    return MLflowMetricExporter(
        config.run_id,
        tracking_uri=config.tracking_uri,
        node_id=node.node_id,
        config=config,
        samples_per_window=samples_per_window,
        first_window_samples=2,  # the agent's baseline at its start and its first sample, a second later
        delivery_phase_s=delivery_phase_s(name, window_s),
        first_delivery_phase_s=delivery_phase_s(name, min(window_s, FIRST_WINDOW_SPREAD_S)),
        known=RunInfo(config.experiment_id, "", config.experiment_name),
        node_run=config.mlflow_node_runs(node.node_count),
        # A job's nodes stop together: their last calls spread over a share of the close's deadline.
        close_spread_s=delivery_phase_s(name, close_deadline_s * CLOSE_SPREAD_SHARE) if spread else 0.0,
        close_deadline_s=close_deadline_s,
        pod=node.kubernetes.pod_attributes() if node.kubernetes is not None else None,
        merged=merged,
        process_pid=process_pid,
    )


class SystemMetricsMonitor:
    """The agent plus the MLflow exporter (a sink of its one collect) into one run;
    ``start()``/``stop()`` or a ``with`` block.

    Only local rank 0 of a node samples; elsewhere start/stop do nothing.
    """

    def __init__(
        self,
        config: ForgeConfig,
        node: NodeIdentity | None = None,
        run_pending: bool = False,
        extra_collectors: Sequence[Collector] = (),
    ) -> None:
        self.config = config
        self._extra_collectors = extra_collectors
        self.node = node or NodeIdentity.from_config(config)
        # Sampling starts now; the windows wait in the spool until ``attach`` names the run.
        self._run_pending = run_pending
        self.exporter: MLflowMetricExporter | None = None
        self._sampled: SampledNode | None = None
        self._watch: FluentRunWatch | None = None
        self._pid = os.getpid()
        self.close_deadline_s = config.close_deadline_s()
        self.received: ReceivedRuns | None = None  # OTLP metrics received into runs (``otlp_receiver``)

    @property
    def run_id(self) -> str | None:
        return self.config.run_id

    def start(self) -> SystemMetricsMonitor:
        if self._sampled is not None or not self.node.runs_agent:
            return self
        self._pid = os.getpid()
        self.close_deadline_s, why = close_deadline(self.config, self.node.node_count, self.node.kubernetes)
        _logger.info("the last window's deadline: %g s (%s)", self.close_deadline_s, why)
        if self.config.run_id is None and not self._run_pending:
            if (run := fluent_run()) is not None:
                self.config = self.config.replace(
                    run_id=run.info.run_id, experiment_id=run.info.experiment_id, tracking_uri=self._tracking_uri()
                )
            else:
                # No run yet: sampling starts now, the windows wait for the run the code opens.
                self._run_pending = True
                self._watch = FluentRunWatch(self._run_opened)
                _logger.info(
                    "no MLflow run is open yet: node %s is sampled into the first one this process opens",
                    self.node.node_id or self.node.hostname,
                )
        if self.config.otlp_receiver:
            from otel_forge.mlflow.received_runs import ReceivedRuns  # grpc and protobuf, where asked for

            # The served run's series in the node's windows, unless the node has a run of its own.
            node_windows = not self.config.mlflow_node_runs(self.node.node_count)
            self.received = ReceivedRuns(self.config, self.config.tracking_uri, node_windows=node_windows).start()
            if self.config.run_id is not None:
                self.received.serve(
                    self.config.run_id, RunInfo(self.config.experiment_id, "", self.config.experiment_name)
                )
        merged = self.received.served_sample if self.received is not None and self.received.node_windows else None
        self.exporter = run_exporter(self.config, self.node, self.close_deadline_s, merged=merged)
        collectors = [*self._extra_collectors]
        if self.received is not None:
            collectors.append(ReceivedCollector(self.received.latest))
        self._sampled = SampledNode(self.config, self.node, collectors).start()
        self._sampled.join(self.exporter)
        if self._watch is not None:
            self._watch.start()
        return self

    @property
    def agent(self) -> Agent | None:
        return self._sampled.agent if self._sampled is not None else None

    def _tracking_uri(self) -> str:
        return self.config.tracking_uri or _fluent_tracking_uri()

    def _run_opened(self, run_id: str) -> None:
        """On the watch's thread: the code opened its run; the windows sampled so far go to it."""
        if self.exporter is not None and self.config.tracking_uri is None:
            self.exporter.window_logger.tracking_uri = _fluent_tracking_uri()
        run = fluent_run()
        if run is not None and run.info.run_id == run_id:
            self.attach(run_id, RunInfo(run.info.experiment_id, run.info.run_name or ""))
        else:  # ended before we looked: MLflow's fluent API made it where the environment says
            self.attach(run_id, RunInfo(None, "", self.config.experiment_name))
        stand_down_mlflow_sampler(run_id)
        _logger.info(
            "MLflow run %s opened: node %s is sampled into it", run_id, self.node.node_id or self.node.hostname
        )

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """The run is open: the windows sampled so far, and all after, go to it."""
        self.config = self.config.replace(run_id=run_id)
        known = known or RunInfo(None, "", self.config.experiment_name)
        if self.exporter is not None:
            self.exporter.attach(run_id, known)
        if self.received is not None:
            self.received.serve(run_id, known)

    def follow_process(self, pid: int) -> None:
        """The monitored process tree is rooted at ``pid`` from now on (CMD, once it runs)."""
        if self.agent is not None:
            self.agent.follow_process(pid)

    @property
    def endpoints(self) -> list[str]:
        if self.agent is None or self.exporter is None:
            return []
        return [*self.agent.endpoints, self.mlflow_endpoint, *self.received_endpoints]

    @property
    def received_endpoints(self) -> list[str]:
        """Where OTLP metrics are received (``otlp_receiver``)."""
        return self.received.receiver.endpoints if self.received is not None else []

    @property
    def mlflow_endpoint(self) -> str:
        prefix = self.exporter.window_logger.prefix if self.exporter is not None else "system/"
        return f"mlflow run {self.config.run_id or '(when it opens)'} ({prefix}...)"

    @property
    def absent_collectors(self) -> dict[str, str]:
        return self.agent.absent_collectors if self.agent else {}

    def stop(self) -> None:
        if self._sampled is not None and forked_from(self._pid):
            return  # a forked child's copy: the parent's agent, the parent stops it
        if self._watch is not None:
            self._watch.stop()
        if self.received is not None:
            self.received.stop(self.close_deadline_s)
            self.received = None
        if self._sampled is not None:
            self._sampled.stop(timeout_s=self.close_deadline_s + 5)
            self._sampled = None

    def __enter__(self) -> SystemMetricsMonitor:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


class CompanionMonitor:
    """``otel_forge.monitor()``'s node sampling in a companion process (the calling process runs no
    collector, reader or exporter thread: they took its GIL from the loop, 5-9 ms/s with 8 GPUs),
    into ``config.run_id``, else MLflow's active run, else the first run this process opens (a watch
    of MLflow's in-memory runs, no I/O, hands it to the companion)."""

    def __init__(self, config: ForgeConfig, node: NodeIdentity | None = None) -> None:
        self.config = config
        self.node = node or NodeIdentity.from_config(config)
        self._companion: CompanionProcess | None = None
        self._watch: FluentRunWatch | None = None

    @property
    def run_id(self) -> str | None:
        return self.config.run_id

    def start(self) -> CompanionMonitor:
        if self._companion is not None or not self.node.runs_agent:
            return self
        run = fluent_run() if self.config.run_id is None else None
        uri = self.config.tracking_uri or _fluent_tracking_uri()
        sampled = self.config.replace(run_id=None, tracking_uri=uri)
        self._companion = CompanionProcess(sampled, self.node, sample=True, journal=None, tracking_uri=uri).start()
        if self.config.run_id is not None:
            self.attach(self.config.run_id, RunInfo(self.config.experiment_id, ""))
        elif run is not None:
            self.attach(run.info.run_id, RunInfo(run.info.experiment_id, run.info.run_name or ""))
        else:
            self._watch = FluentRunWatch(self.attach)
            self._watch.start()
        return self

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        self.config = self.config.replace(run_id=run_id)
        if self._companion is not None:
            self._companion.attach(run_id, known)

    def stop(self) -> None:
        """Stop sampling; return once the companion has delivered (or kept) its last windows."""
        if self._watch is not None:
            self._watch.stop()
        if self._companion is not None:
            self._companion.stop()

    def __enter__(self) -> CompanionMonitor:
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
    in_process: bool = False,
    **settings: object,
) -> CompanionMonitor | SystemMetricsMonitor:
    """Sample this node into an MLflow run and start at once: ``run_id``, else ``MLFLOW_RUN_ID``, else
    MLflow's active run, else the first run this process opens (``trainer.train()`` opens its own).

    The sampling runs in a companion process; ``in_process=True`` runs it on threads of this process
    (a ``SystemMetricsMonitor``, whose exporter can be looked at). Use as ``with otel_forge.monitor():
    ...`` or keep the handle and call ``stop()``. Other ``ForgeConfig`` fields may be passed as
    keywords (``stats=`` is ``mlflow_stats``).
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
    resolved = base.replace(**explicit) if explicit else base
    started = (SystemMetricsMonitor if in_process else CompanionMonitor)(resolved).start()
    if started.run_id is not None:  # else once the code opens its run
        stand_down_mlflow_sampler(started.run_id)
    return started
