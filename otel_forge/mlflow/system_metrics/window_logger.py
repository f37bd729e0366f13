"""Windows into one run: ``log_batch`` per window, steps continuing the node's own after a resume."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from otel_forge.mlflow.client import (
    MAX_METRICS_PER_BATCH,
    RunInfo,
    RunPending,
    TrackingClient,
    TrackingOutage,
    import_mlflow,
    make_client,
    outage_cause,
    upload_texts,
)
from otel_forge.mlflow.system_metrics.node_run import (
    DEFAULT_EXPERIMENT_ID,
    experiment_id_for,
    last_anchor_step,
    open_node_run,
    run_artifact_uri,
)
from otel_forge.mlflow.system_metrics.windows import Window
from otel_forge.scrub import error_line

if TYPE_CHECKING:
    from mlflow.entities import Metric

_logger = logging.getLogger(__name__)


class WindowLogger:
    """Logs windows to one run: ``log_batch`` chunks of at most 1000, step = first step + index.

    The first step is found on the first delivery (on the delivery thread, never the reader's):
    after a resume it continues the node's own steps, from one key's history (every window holds
    its smallest key). The run is never read whole: a job's run may hold every node of the job.
    With ``node_run`` (the node id), the windows go to the node's own child run of the job's run
    (``node_run.open_node_run``), which the last window ends. Without a run id yet, deliveries
    wait (``RunPending``) until ``attach``.
    """

    def __init__(
        self,
        run_id: str | None,
        tracking_uri: str | None,
        prefix: str,
        first_step: int | None = None,
        tags: Mapping[str, str] | None = None,
        node_run: str | None = None,
        node_run_id: str | None = None,
    ) -> None:
        self.run_id = run_id
        # What the node records in the run once, with the window after they change (each run anew).
        self._tags = dict(tags or {})
        self._artifacts: dict[str, str] = {}  # artifact file -> text
        self._version = 0  # of what there is to record
        self._recorded: tuple[str, int] | None = None  # (run, version) recorded last
        self.tracking_uri = tracking_uri
        self.prefix = prefix
        self.first_step = first_step
        self.node_run = node_run
        self.node_run_id = node_run_id  # the node's own run, once open (node runs only)
        self._artifact_uri: str | None = None  # of the run the windows go to
        self.known = RunInfo(None, "")
        self._client: TrackingClient | None = None
        self._lock = threading.Lock()
        self.on_first_step: list[Callable[[int], object]] = []  # called with the first step, once found

    @property
    def experiment_id(self) -> str | None:
        return self.known.experiment_id

    @property
    def run_name(self) -> str:
        return self.known.run_name

    def record(self, tags: Mapping[str, str], artifacts: Mapping[str, str]) -> None:
        """Tags and text artifacts for the run, sent with the next window (the inventory, once known)."""
        with self._lock:
            self._tags.update(tags)
            self._artifacts.update(artifacts)
            self._version += 1

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """Log to ``run_id`` from now on; ``known``: what the run's opener knows of it."""
        if run_id != self.run_id:
            self.node_run_id = self._artifact_uri = None
        self.known = known or RunInfo(None, "")
        self.run_id = run_id

    def _ensure_ready(self, window: Window) -> tuple[TrackingClient, str, int]:
        if self.run_id is None:
            raise RunPending("the run is not open yet")
        with self._lock:
            if self._client is None:
                self._client = make_client(self.tracking_uri)
            if self.known.experiment_id is None:  # "" once nothing named it
                experiment_id = experiment_id_for(self._client, self.known.experiment)
                self.known = dataclasses.replace(self.known, experiment_id=experiment_id)
            resume_step = None
            if self.node_run is not None and self.node_run_id is None:
                opened = open_node_run(self._client, self.run_id, self._node_runs_experiment(), self.node_run)
                self.node_run_id, self._artifact_uri, resume_step = opened.run_id, opened.artifact_uri, opened.next_step
            if self.first_step is None:
                self.first_step = self._resume_step(window) if resume_step is None else resume_step
                for callback in self.on_first_step:
                    callback(self.first_step)
            return self._client, self.node_run_id or self.run_id, self.first_step

    def _node_runs_experiment(self) -> str:
        """The job's run's experiment, where its node runs go; MLflow's default where nothing says it."""
        if self.known.experiment_id:
            return self.known.experiment_id
        _logger.warning(
            "the experiment of MLflow run %s is not known (MLFLOW_EXPERIMENT_ID or MLFLOW_EXPERIMENT_NAME names "
            "it): node %s's run goes to MLflow's default experiment, %s",
            self.run_id,
            self.node_run,
            DEFAULT_EXPERIMENT_ID,
        )
        return DEFAULT_EXPERIMENT_ID

    def _log_artifacts(self, client: TrackingClient, run_id: str, artifacts: Mapping[str, str]) -> None:
        """Best effort: an artifact store that refuses costs the artifact, never the windows. The run's
        artifact location comes from its experiment (``MlflowClient.log_text`` would read the run)."""
        if not artifacts:
            return
        if self._artifact_uri is None and not self.known.experiment_id:
            _logger.info("%s not recorded: the experiment of MLflow run %s is not known", ", ".join(artifacts), run_id)
            return
        try:
            if self._artifact_uri is None:
                self._artifact_uri = run_artifact_uri(client, self.known.experiment_id, run_id)  # type: ignore[arg-type]
            upload_texts(self._artifact_uri, self.tracking_uri, artifacts)
        except Exception as error:  # noqa: BLE001 - the metrics are delivered; this is their context
            _logger.warning("%s not recorded in MLflow run %s: %s", ", ".join(artifacts), run_id, error_line(error))

    def _resume_step(self, window: Window) -> int:
        if not window.values:
            return 0
        # The node's own keys: a window may also hold another source's (received OTLP metrics, new to the run).
        keys = [key for key, _ in window.values]
        anchor = min((key for key in keys if key.startswith(self.prefix)), default=min(keys))
        return last_anchor_step(self._client, self.run_id, anchor) + 1  # type: ignore[arg-type]

    def __call__(self, window: Window) -> None:
        """Deliver one window. A refused credential or permission, or an untrusted certificate,
        raises ``TrackingOutage``, whose text (what the worker's retry warning shows) is the cause
        and its fix."""
        try:
            self._deliver(window)
        except Exception as error:
            cause = outage_cause(error, self.known.experiment or self.known.experiment_id)
            if cause is None:
                raise
            raise TrackingOutage(cause) from error

    def _deliver(self, window: Window) -> None:
        parts = window.parts
        client, run_id, first_step = self._ensure_ready(parts[0])
        metrics = [metric for part in parts for metric in self._metrics(part, first_step)]
        if metrics:
            with self._lock:
                version, tag_items, artifacts = self._version, list(self._tags.items()), dict(self._artifacts)
            unrecorded = self._recorded != (run_id, version)
            from mlflow.entities import RunTag  # imported by _metrics' import_mlflow()

            tags = [RunTag(k, v) for k, v in tag_items] if unrecorded else []
            # The tags ride in the first call, in room its metrics leave: a call carries 1000 entries.
            first = MAX_METRICS_PER_BATCH - len(tags)
            client.log_batch(run_id, metrics=metrics[:first], tags=tags, synchronous=True)
            for start in range(first, len(metrics), MAX_METRICS_PER_BATCH):
                client.log_batch(run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH], synchronous=True)
            if unrecorded:
                self._log_artifacts(client, run_id, artifacts)
            self._recorded = (run_id, version)
        if window.last and self.node_run_id is not None:
            client.set_terminated(self.node_run_id, "FINISHED", end_time=window.timestamp_ms)

    @staticmethod
    def _metrics(window: Window, first_step: int) -> list[Metric]:
        """A window's MLflow metrics: its held-back values at the step before, then its own."""
        import_mlflow()
        from mlflow.entities import Metric

        step = first_step + window.index
        if not window.values:
            return []
        earlier = [Metric(key, value, window.before_timestamp_ms, step - 1) for key, value in window.before]
        return earlier + [Metric(key, value, window.timestamp_ms, step) for key, value in window.values]

    @staticmethod
    def joined(window: Window, later: Window) -> Window | None:
        """``window`` and ``later`` as one call, where their metrics fit in one (else None)."""
        return window.joined(later) if window.size + later.size <= MAX_METRICS_PER_BATCH else None
