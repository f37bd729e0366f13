"""The MLflow side of system-metrics delivery: log a window, find where a node resumes, and
tell a transient failure from a run that is gone. mlflow is imported here, lazily, only."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from otel_forge.mlflow.windows import Window
from otel_forge.worker import Outcome

if TYPE_CHECKING:
    from mlflow import MlflowClient

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
_RUN_GONE_CODES = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


class RunGone(Exception):
    """The run was deleted or never existed: nothing can be logged to it."""


class RunPending(Exception):
    """The run is not open yet (the server did not answer, rank 0 has not made it): windows wait."""


def run_gone(error: BaseException) -> bool:
    """The error says the run does not exist (or was deleted): no retry can help."""
    return isinstance(error, RunGone) or str(getattr(error, "error_code", "") or "") in _RUN_GONE_CODES


# A tracking server under load answers some requests 400 with its store's error: a full connection
# pool, a locked database. The request was fine; sent again later it succeeds. Only these: a store
# error that would fail again every time (a schema mismatch) must not hold the queue forever.
_OVERLOAD_MARKERS = ("QueuePool limit", "database is locked", "too many connections", "could not obtain lock",
                     "deadlock detected", "server closed the connection unexpectedly")


def classify(error: BaseException) -> Outcome:
    """A gone run stops delivery; a server overloaded, failing (5xx) or slow is retried; other client
    errors (4xx) drop the item."""
    if isinstance(error, RunPending):
        return Outcome.WAIT
    if run_gone(error) or "must be in the 'active' state" in str(error):
        return Outcome.STOP
    status = _http_status(error)
    if status is not None and 400 <= status < 500 and status not in (408, 429) and not overloaded(error):
        return Outcome.DROP
    return Outcome.RETRY  # connection refused, timeouts, 5xx, 429, an overloaded store


def overloaded(error: BaseException) -> bool:
    """The server's answer says its store is overloaded, whatever the status code."""
    text = str(error)
    return any(marker in text for marker in _OVERLOAD_MARKERS)


def _http_status(error: BaseException) -> int | None:
    get_status = getattr(error, "get_http_status_code", None)
    if get_status is None:
        return None
    try:
        return int(get_status())
    except (TypeError, ValueError):
        return None


# MLflow's HTTP defaults (2 min timeout, 7 retries with growing backoff) would hide a down server
# inside one call for minutes: bounded. Ending a run prints its URL, credentials included: not.
# The user's own settings win.
MLFLOW_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "30", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
                   "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}


_import_lock = threading.Lock()


def import_mlflow() -> Any:
    """Import mlflow once, under a lock: two threads importing it at once can see it half-made."""
    with _import_lock:
        for name, value in MLFLOW_DEFAULTS.items():
            os.environ.setdefault(name, value)
        import mlflow
        import mlflow.entities  # noqa: F401 - the entities every caller needs, imported here once

        return mlflow


def make_client(tracking_uri: str | None) -> MlflowClient:
    return import_mlflow().MlflowClient(tracking_uri)


def context_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags ``mlflow.start_run`` gives a run it creates here (``mlflow.user``, ``mlflow.source.name``,
    ``mlflow.source.type``, any provider plugin's), with ``tags`` applied over them.

    Git state is left to ``run_metadata.git_tags``: MLflow reads the repository of ``sys.argv[0]``,
    which under ``otel-forge run`` is otel-forge's own entry point, not the job's working directory.
    """
    import_mlflow()
    from mlflow.tracking.context.git_context import GitRunContext
    from mlflow.tracking.context.registry import resolve_tags

    return resolve_tags(dict(tags), ignore=[GitRunContext])


def live_run(client: MlflowClient, run_id: str) -> Any:
    """The run, or ``RunGone`` when it is deleted."""
    run = client.get_run(run_id)
    if run.info.lifecycle_stage == "deleted":
        raise RunGone(f"run {run_id} is deleted")
    return run


def next_system_step(run: Any, prefix: str) -> int:
    """The step after the last one this node logged (``prefix`` = ``system/[<node>/]``), else 0.

    The run's latest metrics carry their steps: no history is read.
    """
    last = -1
    for metric in run.data._metric_objs:  # noqa: SLF001 - the latest Metric objects, with steps
        rest = metric.key[len(prefix):]
        # Without a node id, system/node_0/... belongs to another node, not to us.
        if metric.key.startswith(prefix) and "/" not in rest:
            last = max(last, metric.step)
    return last + 1


@dataclass(frozen=True)
class RunInfo:
    """What the opener of a run knows of it ("" where it does not: a rank that only found it)."""

    experiment_id: str
    run_name: str


class WindowLogger:
    """Logs windows to one run: ``log_batch`` chunks of at most 1000, step = first step + index.

    The first step is found on the first delivery (on the delivery thread, never the reader's):
    after a resume it continues the node's own steps. Where the run's opener said what it knows of
    the run (``attach(run_id, known)``), only the anchor key's history is read (every window holds
    the anchor): a job of many nodes never has each read the whole run. Else the run is read once,
    which also tells ``experiment_id`` and ``run_name``. Without a run id yet,
    deliveries wait (``RunPending``) until ``attach``.
    """

    def __init__(self, run_id: str | None, tracking_uri: str | None, prefix: str,
                 first_step: int | None = None) -> None:
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.prefix = prefix
        self.first_step = first_step
        self.experiment_id: str | None = None
        self.run_name: str | None = None
        self._client: Any = None
        self._read_run = True
        self._lock = threading.Lock()
        self.on_first_step: list[Any] = []

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """Log to ``run_id`` from now on; ``known``: what the run's opener knows of it, so the run
        is never read here (None: read it once)."""
        if known is not None:
            self.experiment_id, self.run_name, self._read_run = known.experiment_id, known.run_name, False
        self.run_id = run_id

    def _ensure_ready(self, window: Window) -> tuple[Any, int]:
        if self.run_id is None:
            raise RunPending("the run is not open yet")
        with self._lock:
            if self._client is None:
                self._client = make_client(self.tracking_uri)
            if self.first_step is None:
                self.first_step = self._resume_step(window)
                for callback in self.on_first_step:
                    callback(self.first_step)
            return self._client, self.first_step

    def _resume_step(self, window: Window) -> int:
        if self._read_run:
            run = live_run(self._client, self.run_id)  # type: ignore[arg-type]
            self.experiment_id, self.run_name = run.info.experiment_id, run.info.run_name
            return next_system_step(run, self.prefix)
        if not window.values:
            return 0
        anchor = min(key for key, _ in window.values)
        return max((m.step for m in self._client.get_metric_history(self.run_id, anchor)), default=-1) + 1

    def __call__(self, window: Window) -> None:
        client, first_step = self._ensure_ready(window)
        Metric = import_mlflow().entities.Metric
        if not window.values:
            return
        step = first_step + window.index
        metrics = [Metric(key, value, window.timestamp_ms, step) for key, value in window.values]
        for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=metrics[start:start + MAX_METRICS_PER_BATCH], synchronous=True)
