"""MLflow's client as both subsystems use it: imported lazily (here only), made with bounded HTTP
retries, and its errors told apart: transient, an overloaded server, a run that is gone."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_forge.config import MLFLOW_CLIENT_DEFAULTS
from otel_forge.mlflow.worker import Outcome

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
_OVERLOAD_MARKERS = (
    "QueuePool limit",
    "database is locked",
    "too many connections",
    "could not obtain lock",
    "deadlock detected",
    "server closed the connection unexpectedly",
)


def classify(error: BaseException) -> Outcome:
    """A gone run stops delivery; a server overloaded, failing (5xx) or slow is retried; other client
    errors (4xx), and a missing package (an ImportError: no retry installs it), drop the item."""
    if isinstance(error, RunPending):
        return Outcome.WAIT
    if isinstance(error, ImportError):
        return Outcome.DROP
    if run_gone(error) or "must be in the 'active' state" in str(error):
        return Outcome.STOP
    status = _http_status(error)
    if status is not None and 400 <= status < 500 and status not in (408, 429) and not overloaded(error):
        return Outcome.DROP
    return Outcome.RETRY  # connection refused, timeouts, 5xx, 429, an overloaded store


# What a failed call's text says of why the server did not answer, as a person would say it.
_UNANSWERED_REASONS = (
    (("Connection refused",), "connection refused"),
    (("Name or service not known", "nodename nor servname", "Temporary failure in name resolution",
      "Failed to resolve"), "host name not resolved"),
    (("No route to host",), "no route to host"),
    (("Network is unreachable",), "network unreachable"),
    (("timed out", "Timeout"), "no answer in time"),
    (("Connection reset", "RemoteDisconnected", "Connection aborted"), "connection closed"),
)  # fmt: skip


def unanswered_reason(error: BaseException) -> str:
    """Why the tracking server did not answer, in a few words (``connection refused``, ``HTTP 503``)."""
    text = str(error)
    for markers, reason in _UNANSWERED_REASONS:
        if any(marker in text for marker in markers):
            return reason
    if (status := _http_status(error)) is not None:
        return f"HTTP {status}"
    return "overloaded" if overloaded(error) else type(error).__name__


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


_import_lock = threading.Lock()


def import_mlflow() -> Any:
    """Import mlflow once, under a lock: two threads importing it at once can see it half-made."""
    with _import_lock:
        for name, value in MLFLOW_CLIENT_DEFAULTS.items():
            os.environ.setdefault(name, value)
        import mlflow
        import mlflow.entities

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

    return resolve_tags(dict(tags), ignore=[GitRunContext])  # type: ignore[list-item]  # MLflow takes classes


def upload_texts(artifact_uri: str, tracking_uri: str | None, texts: Mapping[str, str]) -> None:
    """Text files (artifact path -> text) into the artifact store at ``artifact_uri``, as
    ``MlflowClient.log_text`` writes them, without the run read it makes to find that store."""
    import_mlflow()
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repository = get_artifact_repository(artifact_uri, tracking_uri=tracking_uri)
    with tempfile.TemporaryDirectory() as directory:
        for artifact_file, text in texts.items():
            local = Path(directory, Path(artifact_file).name)
            local.write_text(text, encoding="utf-8")
            repository.log_artifact(str(local), str(Path(artifact_file).parent) if "/" in artifact_file else None)


def live_run(client: MlflowClient, run_id: str) -> Any:
    """The run, or ``RunGone`` when it is deleted."""
    run = client.get_run(run_id)
    if run.info.lifecycle_stage == "deleted":
        raise RunGone(f"run {run_id} is deleted")
    return run


@dataclass(frozen=True)
class RunInfo:
    """What the opener of a run knows of it, so that no agent reads the run: its experiment's id
    (None where nothing says it: a rank or a node given only the run id), else the experiment the
    settings name (id or name); the run's name ("" where not known)."""

    experiment_id: str | None
    run_name: str
    experiment: str | None = None
