"""``MLflowMetricExporter``: OTel metric exports -> windows -> MLflow steps, never waiting.

Fed by a ``PeriodicExportingMetricReader`` at the sampling interval. ``export`` converts and
enqueues; delivery (retries, the spool, deadlines) happens on the ``DeliveryWorker``'s threads.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from opentelemetry.sdk.metrics.export import Gauge, MetricExportResult, MetricsData, Sum

from otel_forge.collectors.inventory import inventory_tags
from otel_forge.config import ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.mlflow.client import RunInfo, asked_pause_s, classify, refuses_connections, unanswered_reason
from otel_forge.mlflow.delivery.worker import DeliveryWorker
from otel_forge.mlflow.keys import DataPoint, KeyMapper, Sample, key_segment, node_host_tags, system_prefix
from otel_forge.mlflow.spool_files import kept_notice_level, spool_root, writer_identity
from otel_forge.mlflow.system_metrics.node_run import SYSTEM_PREFIX
from otel_forge.mlflow.system_metrics.window_logger import WindowLogger
from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
from otel_forge.mlflow.system_metrics.windows import CLOSE_SPREAD_SHARE, ChangedValues, Window, WindowFolder
from otel_forge.mlflow.system_metrics.writer_lock import NodeWriterLock
from otel_forge.names import PROCESS_PID
from otel_forge.pipeline.fanout import NonBlockingExporter
from otel_forge.scrub import scrub, uri_without_credentials

_logger = logging.getLogger(__name__)
# An unchanged value is sent again after this many windows: a chart's line never stops for long.
_SPOOLS = itertools.count()  # this process's window spools
REFRESH_WINDOWS = 10


class MLflowMetricExporter(NonBlockingExporter):
    """Exports OTel metrics into an MLflow run as ``system/[<node>/]<key>`` metrics, one step a window.

    ``samples_per_window`` exports make a window; its step is the window index after the node's
    last step in the run; its timestamp the window's end. Gauges are averaged (and ``<key>_max`` /
    ``<key>_min`` added as the ``mlflow_stats`` setting asks). A value that did not change since it
    was last sent waits up to ``refresh_windows`` windows; the last window, at shutdown, sends all.
    Delivery is asynchronous and ordered, ``delivery_phase_s`` into the next window (nodes spread
    their calls over the window); windows wait in a spool directory that ``otel-forge replay`` can
    deliver later.
    """

    def __init__(
        self,
        run_id: str | None,
        *,
        tracking_uri: str | None = None,
        node_id: str | None = None,
        config: ForgeConfig | None = None,
        samples_per_window: int | None = None,
        first_window_samples: int | None = None,
        delivery_phase_s: float = 0.0,
        first_delivery_phase_s: float | None = None,
        refresh_windows: int = REFRESH_WINDOWS,
        known: RunInfo | None = None,
        node_run: bool = False,
        close_spread_s: float = 0.0,
        close_deadline_s: float | None = None,
        pod: Mapping[str, str] | None = None,
        prefix: str | None = None,
        what: str = "system-metrics",
        merged: Callable[[], Sample] | None = None,
        process_pid: int | None = None,
    ) -> None:
        """``config``: the settings (statistics, spool, queue and deadlines), by default resolved
        from the environment now; ``tracking_uri`` and ``samples_per_window`` default to its own.
        ``node_run``: the node logs ``system/<key>`` into a child run of its own under the run
        (``node_run.py``), not ``system/<node>/<key>`` into the run. ``close_spread_s``: how long the
        close waits before its last calls (the node's share of a spread: nodes stop together);
        ``close_deadline_s``: how long the close waits in all (default: the config's, for one node). ``pod``:
        on Kubernetes, the node's pod (``k8s.pod.name``, ``k8s.node.name``), tagged beside its host.
        ``first_window_samples``: samples in the first window (the agent's baseline and first sample);
        ``first_delivery_phase_s``: its delivery phase (a spread shorter than a long window's).
        ``prefix``: the keys' prefix, for windows that are not the node's (received OTLP metrics: then
        they come through ``export_sample``); ``what`` names them in the lines the exporter says.
        ``merged``: another source's sample (whole keys) taken with each export, into the same windows
        (received OTLP metrics: one step per window with the node's). ``process_pid``: of the monitored
        process trees, the one rooted at this pid alone (the node's companion samples one per training
        process, each into its run)."""
        # Cumulative temporality (the exporter default): counters fold as growth since start.
        super().__init__()
        config = config or ForgeConfig.resolve()
        tracking_uri = tracking_uri or config.tracking_uri
        samples_per_window = samples_per_window or config.mlflow_samples_per_window(node_count=None)
        self.run_id = run_id
        self.node_id = node_id
        self._schedule = _Schedule(
            delivery_phase_s,
            delivery_phase_s if first_delivery_phase_s is None else first_delivery_phase_s,
            close_spread_s,
            config.close_deadline_s() if close_deadline_s is None else close_deadline_s,
        )
        node_run_name = key_segment(node_id or "node") if node_run else None
        self._lock_prefix = prefix or system_prefix(node_id)
        self.what = what
        self._merged = merged
        self._process_pid = process_pid
        prefix = prefix or (SYSTEM_PREFIX if node_run else system_prefix(node_id))
        self._mapper = KeyMapper(prefix)
        self._folder = WindowFolder(samples_per_window, config.mlflow_stats, first_window_samples)
        self._changed = ChangedValues(refresh_windows)
        root = spool_root(config.spool_dir)
        self.spool = WindowSpool(
            # One process may hold several (the node's companion, one per run it samples into).
            root / f"{run_id or 'pending'}-{key_segment(node_id or 'node')}-{os.getpid()}-{next(_SPOOLS)}",
            config.spool_max_bytes,
            header={
                "run_id": run_id,
                "node_id": node_id,
                "prefix": prefix,
                "node_run": node_run_name,
                "tracking_uri": uri_without_credentials(tracking_uri) if tracking_uri else None,
                **writer_identity(),  # a spool whose writer is gone is left: `otel-forge replay --all` takes it
            },
        )
        # Which host (and pod) the node's prefix samples, in the node's first call (node_0 says nothing of it).
        host_tags = node_host_tags(node_id, pod=pod) if node_id else {}
        self.window_logger = WindowLogger(run_id, tracking_uri, prefix, tags=host_tags, node_run=node_run_name)
        self.window_logger.on_first_step.append(self._first_step_known)
        self.worker: DeliveryWorker[Window] = DeliveryWorker(
            self.window_logger,
            name="mlflow-system-metrics",
            max_queue=config.queue_size,
            call_deadline_s=config.call_deadline_s,
            classify=classify,
            overflow=self.spool,
            write_ahead=True,
            due=self._schedule.due,
            join=self.window_logger.joined,
            asked_pause=lambda error: asked_pause_s(tracking_uri, error),
            describe=unanswered_reason,
            hopeless_at_close=refuses_connections,
        )
        self._shut_down = False
        self._pid = os.getpid()  # a forked child exports nothing of the parent's run
        self._job_run: dict[str, str] | None = None  # how replay finds the run, if it never opens here
        self._writer_lock: NodeWriterLock | None = None
        self.standing_down = False
        if run_id is not None:
            self.attach(run_id, known)

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """The run the windows go to, once it is open: windows made before wait in the spool.
        ``known``: what the run's opener knows of it (then the run itself is never read)."""
        self.run_id = run_id
        experiment = (known.experiment_id or known.experiment) if known is not None else None
        self.spool.update_header(run_id=run_id, experiment=experiment)
        self._writer_lock = NodeWriterLock(run_id, self._lock_prefix)
        self.standing_down = not self._acquire_writer_lock()
        if self.standing_down:
            self.spool.discard()  # windows the other agent writes
        else:
            self.window_logger.attach(run_id, known)

    def record_inventory(self, inventory: dict[str, object]) -> None:
        """The machine's inventory, into the run with the next window: ``<prefix>inventory.json``, and a
        few tags where the run is the node's alone (a job's run of many nodes gets no per-node tags)."""
        alone = self.window_logger.node_run is not None or self.node_id is None
        artifact = {f"{self.window_logger.prefix}inventory.json": json.dumps(inventory, indent=2, sort_keys=True)}
        self.window_logger.record(inventory_tags(inventory) if alone else {}, artifact)

    def _first_step_known(self, step: int) -> None:
        """What a replay needs to continue where delivery stopped: the step, and the node's run."""
        self.spool.update_header(first_step=step, node_run_id=self.window_logger.node_run_id)

    def _acquire_writer_lock(self) -> bool:
        assert self._writer_lock is not None
        try:
            if self._writer_lock.acquire():
                return True
        except OSError as error:
            _logger.debug("writer lock %s not usable (%s): writing unchecked", self._writer_lock.path, error)
            return True
        _logger.warning(
            "another agent (pid %s) already writes %s of MLflow run %s on this host: this one stands "
            "down from MLflow (its other sinks go on). Run one agent per node.",
            self._writer_lock.holder(),
            self.window_logger.prefix,
            self.run_id,
        )
        return False

    def keep_for_job_run(self, experiment: str, job_key: str) -> None:
        """Should the run never open here, keep the windows at shutdown for the run the job key names
        (``otel-forge replay`` finds it once the job's run is replayed), rather than discard them."""
        self._job_run = {"experiment": experiment, "job_key": job_key}

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        if forked_from(self._pid):
            return MetricExportResult.SUCCESS
        if self._shut_down or self.worker.stopped:
            return MetricExportResult.FAILURE
        if self.standing_down:
            return MetricExportResult.SUCCESS
        sample = self._mapper.sample(_points(metrics_data, self._process_pid))
        if self._merged is not None:
            sample.update(self._merged())
        self.export_sample(sample)
        return MetricExportResult.SUCCESS

    def export_sample(self, sample: Sample) -> None:
        """One sample of ``{key: (fold, value)}`` (whole keys, the prefix included), taken now."""
        if forked_from(self._pid) or self._shut_down or self.worker.stopped or self.standing_down:
            return
        self._submit(self._folder.add(sample, time.time()))

    def _submit(self, window: Window | None, *, last: bool = False) -> None:
        """A closed window to the delivery worker, with only its changed values (all of them if it is
        the ``last``); before it, the held values of the keys it no longer has, at the step they were
        last in. The ``last`` without a window: what the previous one held back."""
        if window is not None and (ended := self._changed.ended(window)) is not None:
            self.worker.submit(ended)
        if last:
            window = self._changed.close(window)
            if window is not None:
                window = dataclasses.replace(window, last=True)
            elif self.window_logger.node_run is not None:  # nothing to send, but the node's run to end
                window = Window(0, int(time.time() * 1000), (), last=True)
        elif window is not None:
            window = self._changed.keep(window)
        if window is not None:
            self.worker.submit(window)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        """Close the open window (however few samples it has) and wait, at most ``timeout_millis``,
        until every window is delivered: True then, False on timeout or with no run to deliver to."""
        if self._shut_down or self.standing_down or forked_from(self._pid):
            return not self._shut_down
        self._submit(self._folder.flush())
        if self.run_id is None:
            return False  # windows wait in the spool for the run to open
        return self.worker.flush(timeout_millis / 1000)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        """Close the open window, whole (every chart ends at the last step), deliver what is pending
        under the drain deadline, spool the rest."""
        if self._shut_down or forked_from(self._pid):
            return
        self._shut_down = True
        self._submit(self._folder.flush(), last=True)
        if self.run_id is None or self.standing_down:
            self.worker.close(0.0)
            if self.run_id is None and self._job_run is not None:
                self._keep_for_job_run(self._job_run)
            elif (discarded := self.spool.discard()) and self.run_id is None:
                _logger.warning("%d %s window(s) discarded: the run never opened", discarded, self.what)
            return
        timeout_s = kwargs.get("timeout", timeout_millis)  # the SDK passes `timeout` (ms left)
        drain_s = min(self._schedule.drain_deadline_s, float(timeout_s) / 1000)  # type: ignore[arg-type]
        left = self.worker.close(drain_s, spread_s=min(self._schedule.close_spread_s, drain_s * CLOSE_SPREAD_SHARE))
        self._report_leftovers(left)
        if self._writer_lock is not None:
            self._writer_lock.release()

    def _keep_for_job_run(self, job_run: dict[str, str]) -> None:
        if not (kept := len(self.spool)):
            self.spool.remove_if_empty()
            return
        self.spool.update_header(job_run=job_run)
        _logger.log(
            kept_notice_level(self.spool.path),
            "%d %s window(s) were not delivered: the run of job %s never opened; they are "
            "kept in %s. Deliver them after the job's run with: otel-forge replay %s",
            kept,
            self.what,
            job_run["job_key"],
            self.spool.path,
            self.spool.path,
        )

    def _report_leftovers(self, left: int) -> None:
        if self.worker.stopped:
            # The run is gone: what waits in the spool can never be delivered.
            if discarded := self.spool.discard():
                _logger.warning("run %s is gone: %d spooled %s window(s) discarded", self.run_id, discarded, self.what)
            return
        self.spool.write_stats(self.delivery_counts())
        if left:
            _logger.log(
                kept_notice_level(self.spool.path),
                "%d %s window(s) for run %s were not delivered; they are kept in %s. "
                "Deliver them with: otel-forge replay %s",
                left,
                self.what,
                self.run_id,
                self.spool.path,
                self.spool.path,
            )
        else:
            self.spool.remove_if_empty()

    def delivery_counts(self) -> dict[str, int]:
        stats = self.worker.stats
        return {
            "delivered": stats.delivered,
            "retried": stats.retried,
            "spooled": stats.spooled,
            "dropped": stats.dropped,
            "pending": self.worker.pending(),
        }

    def __repr__(self) -> str:
        return scrub(f"MLflowMetricExporter(run_id={self.run_id!r}, node_id={self.node_id!r})")


def _points(metrics_data: MetricsData, process_pid: int | None) -> Iterator[tuple[str, Sequence[DataPoint]]]:
    """(metric name, its number data points): the agent's instruments are gauges and sums alone (a
    histogram's points hold no single value to log). ``process_pid``: the points of other monitored
    process trees are left out."""
    for resource_metrics in metrics_data.resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                data = metric.data
                points = data.data_points if isinstance(data, (Gauge, Sum)) else ()
                if process_pid is not None:
                    points = [p for p in points if (p.attributes or {}).get(PROCESS_PID, process_pid) == process_pid]
                yield metric.name, points


@dataclass(frozen=True)
class _Schedule:
    """When the node's windows go: each at its end plus the node's phase (the first window's own:
    a spread shorter than a long window's); at the close, after its spread, within its deadline."""

    phase_s: float
    first_phase_s: float
    close_spread_s: float
    drain_deadline_s: float

    def due(self, window: Window) -> float:
        return window.timestamp_ms / 1000 + (self.first_phase_s if window.index == 0 else self.phase_s)
