"""MLflow's client as both subsystems use it: imported lazily (here only), made with bounded HTTP
retries, and its errors told apart: transient, an overloaded server, a run that is gone, an outage
the user must fix (a refused credential or permission, an untrusted certificate)."""

from __future__ import annotations

import enum
import functools
import logging
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, cast

from otel_forge.config import MLFLOW_CLIENT_DEFAULTS
from otel_forge.mlflow.delivery.retry import Outcome
from otel_forge.mlflow.server_probe import RETRY_AFTER_STATUSES, ServerRefused, insecure_tls, retry_after_s
from otel_forge.scrub import scrub

if TYPE_CHECKING:  # mlflow is imported by import_mlflow() alone, at run time
    from mlflow import MlflowClient
    from mlflow.entities import (
        Experiment,
        LoggedModel,
        LoggedModelOutput,
        LoggedModelStatus,
        Metric,
        Param,
        Run,
        RunTag,
    )

_logger = logging.getLogger(__name__)

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
_RUN_GONE_CODES = ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


class TrackingClient(Protocol):
    """The part of ``mlflow.MlflowClient`` that otel_forge calls, as MLflow declares it (a parameter we
    never pass is left out, keyword-only where MLflow puts one before it). ``make_client`` gives the
    real one; the delivery simulation gives a fake. Returns we ignore are ``object``."""

    def get_experiment(self, experiment_id: str) -> Experiment: ...

    def get_experiment_by_name(self, name: str) -> Experiment | None: ...

    def create_experiment(self, name: str, *, tags: dict[str, str] | None = None) -> str: ...

    def set_experiment_tag(self, experiment_id: str, key: str, value: str) -> None: ...

    def search_experiments(
        self, *, max_results: int | None = ..., order_by: list[str] | None = None
    ) -> Sequence[Experiment]: ...

    def create_run(
        self, experiment_id: str, *, tags: dict[str, str] | None = None, run_name: str | None = None
    ) -> Run: ...

    def get_run(self, run_id: str) -> Run: ...

    def search_runs(
        self, experiment_ids: list[str], filter_string: str = "", *, max_results: int = ...
    ) -> Sequence[Run]: ...

    def update_run(self, run_id: str, status: str | None = None, name: str | None = None) -> None: ...

    def set_terminated(self, run_id: str, status: str | None = None, end_time: int | None = None) -> None: ...

    def log_batch(
        self,
        run_id: str,
        metrics: Sequence[Metric] = (),
        params: Sequence[Param] = (),
        tags: Sequence[RunTag] = (),
        synchronous: bool | None = None,
    ) -> object: ...

    def set_tag(self, run_id: str, key: str, value: str, synchronous: bool | None = None) -> object: ...

    def delete_tag(self, run_id: str, key: str) -> None: ...

    def get_metric_history(self, run_id: str, key: str) -> Sequence[Metric]: ...

    def log_dict(self, run_id: str, dictionary: dict[str, object], artifact_file: str) -> None: ...

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None: ...

    def search_logged_models(
        self, experiment_ids: list[str], filter_string: str | None = None
    ) -> Sequence[LoggedModel]: ...

    def create_logged_model(
        self,
        experiment_id: str,
        *,
        name: str | None = None,
        source_run_id: str | None = None,
        tags: dict[str, str] | None = None,
        model_type: str | None = None,
    ) -> LoggedModel: ...

    def log_outputs(self, run_id: str, models: list[LoggedModelOutput]) -> object: ...

    def log_model_artifacts(self, model_id: str, local_dir: str) -> None: ...

    def finalize_logged_model(self, model_id: str, status: LoggedModelStatus) -> LoggedModel: ...


class RunGone(Exception):
    """The run was deleted or never existed: nothing can be logged to it."""


class TrackingOutage(Exception):
    """A call refused for a reason only the user can end (see ``outage_cause``); its text is the
    cause and the fix, and it is retried like any outage. Raised from the error MLflow raised."""


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
    """A gone run stops delivery; a server overloaded, failing (5xx) or slow is retried, and so is an
    outage only the user can end (a refused credential or permission, an untrusted certificate: see
    ``outage_cause``); other client errors (4xx), and a missing package (an ImportError: no retry
    installs it), drop the item."""
    if isinstance(error, RunPending):
        return Outcome.WAIT
    if isinstance(error, ImportError):
        return Outcome.DROP
    if run_gone(error) or "must be in the 'active' state" in str(error):
        return Outcome.STOP
    if isinstance(error, TrackingOutage) or outage_of(error) is not None:
        return Outcome.RETRY  # what was refused is kept, and delivered once the user fixes it
    status = _http_status(error)
    if status is not None and 400 <= status < 500 and status not in (408, 429) and not overloaded(error):
        return Outcome.DROP
    return Outcome.RETRY  # connection refused, timeouts, 5xx, 429, an overloaded store


WRONG_CREDENTIALS = (
    "wrong credentials (HTTP 401): check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, "
    "or MLFLOW_TRACKING_TOKEN"
)
WRITE_ACCESS_FIX = "ask its owner for EDIT, or use an experiment you can write"
NO_PERMISSION = f"no permission on {{what}} (HTTP 403): {WRITE_ACCESS_FIX}"
UNTRUSTED_CERTIFICATE = (
    "certificate not trusted ({reason}): set MLFLOW_TRACKING_SERVER_CERT_PATH to the CA bundle that signed "
    "the server's certificate"
)
# What ssl says of a certificate it refused: `[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify
# failed: unable to get local issuer certificate (_ssl.c:1006)`, within MLflow's or requests' text.
_CERTIFICATE_REFUSED = re.compile(r"certificate verify failed: ?(?P<reason>[^()'\"]{0,200}?)\s*(?:\(_ssl|['\")]|$)")
_CERTIFICATE_MARKERS = ("CERTIFICATE_VERIFY_FAILED", "SSLCertVerificationError", "certificate verify failed")


class Outage(enum.Enum):
    """A failure the server or the network did not cause, and no wait ends: the user's to fix."""

    CREDENTIALS = "wrong_credentials"  # HTTP 401
    PERMISSION = "no_permission"  # HTTP 403
    CERTIFICATE = "untrusted_certificate"


def outage_cause(error: BaseException, experiment: str | None = None) -> str | None:
    """The cause and its fix in one line, for a failure only the user can end: a refused credential
    (401), a refused permission (403; ``experiment``: the experiment's name or id, where known), a
    certificate the client does not trust. None for any other error. Never holds a credential."""
    if isinstance(error, TrackingOutage):
        return str(error)
    outage = outage_of(error)
    if outage is Outage.CREDENTIALS:
        return WRONG_CREDENTIALS
    if outage is Outage.PERMISSION:
        return scrub(NO_PERMISSION.format(what=f"experiment {experiment}" if experiment else "the run's experiment"))
    if outage is Outage.CERTIFICATE:
        return UNTRUSTED_CERTIFICATE.format(reason=_certificate_reason(error))
    return None


def outage_of(error: BaseException) -> Outage | None:
    """Which outage only the user can end ``error`` is, if any."""
    status = _http_status(error)
    if status in (401, 403):
        return Outage.CREDENTIALS if status == 401 else Outage.PERMISSION
    if any(_is_certificate_error(link) for link in _chain(error)):
        return Outage.CERTIFICATE
    return None


def _is_certificate_error(error: BaseException) -> bool:
    import ssl  # here: 13 ms to import, for a process that may never meet a TLS error

    if isinstance(error, ssl.SSLCertVerificationError):
        return True
    if getattr(error, "json", None) is not None:
        return False  # the server's own answer (a RestException), quoting a TLS error of its own store's
    text = str(error)  # MLflow's client keeps only the text of the error it caught
    return any(marker in text for marker in _CERTIFICATE_MARKERS)


def _certificate_reason(error: BaseException) -> str:
    """ssl's few words of why it refused the certificate (``unable to get local issuer certificate``)."""
    for link in _chain(error):
        reason = getattr(link, "verify_message", None)  # ssl.SSLCertVerificationError's own
        if reason:
            return scrub(str(reason))
        if (match := _CERTIFICATE_REFUSED.search(str(link))) is not None and match.group("reason"):
            return scrub(match.group("reason").strip())
    return "certificate verify failed"


def _chain(error: BaseException, depth: int = 8) -> Iterator[BaseException]:
    """The error and those it wraps: its cause or context, and the errors among its arguments
    (urllib3 and requests wrap one error in another's arguments)."""
    seen: set[int] = set()
    pending = [error]
    while pending and len(seen) < depth:
        link = pending.pop(0)
        if id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        pending.extend(arg for arg in getattr(link, "args", ()) if isinstance(arg, BaseException))
        pending.extend(e for e in (link.__cause__, link.__context__) if e is not None)
        if isinstance(reason := getattr(link, "reason", None), BaseException):
            pending.append(reason)  # urllib3's MaxRetryError


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
_NO_CONNECTION = ("connection refused", "host name not resolved", "no route to host", "network unreachable")
# ssl's words for a TLS failure other than a refused certificate: `[SSL: WRONG_VERSION_NUMBER] wrong
# version number (_ssl.c:1006)`.
_TLS_FAILED = re.compile(r"\[SSL: [A-Z0-9_]{1,64}\] (?P<reason>[^()'\"]{1,200}?)\s*(?:\(_ssl|['\")]|$)")


def open_failure(error: BaseException, experiment: str | None) -> str:
    """What the run's opener says of a server that did not answer: the outage's cause and fix, or
    ``does not answer (why)``."""
    return outage_cause(error, experiment) or f"does not answer ({unanswered_reason(error)})"


def unanswered_reason(error: BaseException) -> str:
    """Why the tracking server did not answer, in a few words (``connection refused``, ``HTTP 503``),
    or, for an outage only the user can end, its cause and fix (``outage_cause``)."""
    if (cause := outage_cause(error)) is not None:
        return cause
    text = str(error)
    for markers, reason in _UNANSWERED_REASONS:
        if any(marker in text for marker in markers):
            return reason
    if (tls := _TLS_FAILED.search(text)) is not None:
        return f"TLS failed ({tls.group('reason').strip()})"  # e.g. https:// to a plain HTTP port
    if (status := _http_status(error)) is not None:
        return f"HTTP {status}"
    if isinstance(error, TimeoutError):  # a wait of ours ran out; its text, if any, says how long
        return str(error) or "no answer in time"
    return "overloaded" if overloaded(error) else type(error).__name__


def overloaded(error: BaseException) -> bool:
    """The server's answer says its store is overloaded, whatever the status code."""
    text = str(error)
    return any(marker in text for marker in _OVERLOAD_MARKERS)


# urllib3's words when MLflow's client ran out of its own retries of a status it retries (429, 5xx):
# MLflow then reports the call as failed with 500, whatever the server answered.
_RETRIED_STATUS = re.compile(r"too many (\d{3}) error responses")


def _http_status(error: BaseException) -> int | None:
    if (retried := _RETRIED_STATUS.search(str(error))) is not None:
        return int(retried.group(1))
    get_status = getattr(error, "get_http_status_code", None)
    if get_status is None:
        return None
    try:
        return int(get_status())
    except (TypeError, ValueError):
        return None


def asked_pause_s(tracking_uri: str | None, error: BaseException) -> float | None:
    """How long the server asked callers to wait (its ``Retry-After``, capped), where ``error`` is
    its 429 or 503; None otherwise."""
    if _http_status(error) not in RETRY_AFTER_STATUSES:
        return None
    return retry_after_s(tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))


def refuses_connections(error: BaseException) -> bool:
    """The server took no connection: nothing sent was received (a refused port, an unreachable host)."""
    return isinstance(error, ServerRefused) or unanswered_reason(error) in _NO_CONNECTION


_import_lock = threading.Lock()


def import_mlflow() -> ModuleType:
    """Import mlflow once, under a lock: two threads importing it at once can see it half-made.
    Typed uses import what they need from it afterwards (``from mlflow.entities import Metric``)."""
    with _import_lock:
        for name, value in MLFLOW_CLIENT_DEFAULTS.items():
            os.environ.setdefault(name, value)
        import mlflow
        import mlflow.entities

        return mlflow


def make_client(tracking_uri: str | None) -> MlflowClient:
    """MLflow's client of ``tracking_uri`` (a ``TrackingClient``)."""
    import_mlflow()
    from mlflow import MlflowClient

    _insecure_tls_notice(tracking_uri)
    return MlflowClient(tracking_uri)


class _LazyClient:
    """A ``TrackingClient`` made at its first use."""

    def __init__(self, tracking_uri: str | None) -> None:
        self._tracking_uri = tracking_uri
        self._client: MlflowClient | None = None

    def __getattr__(self, name: str) -> Any:
        if self._client is None:
            self._client = make_client(self._tracking_uri)
        return getattr(self._client, name)


def lazy_client(tracking_uri: str | None) -> TrackingClient:
    """MLflow's client of ``tracking_uri``, imported and made at its first call: a process that may
    never call the server (a rank attached to the run it was given) imports no MLflow for it."""
    return cast("TrackingClient", _LazyClient(tracking_uri))


def _insecure_tls_notice(tracking_uri: str | None) -> None:
    """Under ``MLFLOW_TRACKING_INSECURE_TLS`` an HTTPS server's certificate is not checked: said once
    per process, in place of the warning urllib3 gives on every call."""
    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI", "")
    if insecure_tls() and uri.lower().startswith("https:"):
        _tell_insecure_tls()


@functools.cache  # once per process
def _tell_insecure_tls() -> None:
    from urllib3.exceptions import InsecureRequestWarning

    # urllib3 shows its security warnings "always": a line per call, thousands over a job.
    warnings.filterwarnings("ignore", category=InsecureRequestWarning)
    _logger.warning(
        "MLFLOW_TRACKING_INSECURE_TLS is set: the tracking server's certificate is not checked; "
        "set MLFLOW_TRACKING_SERVER_CERT_PATH to the CA bundle that signed it instead"
    )


def upload_texts(artifact_uri: str, tracking_uri: str | None, texts: Mapping[str, str]) -> None:
    """Text files (artifact path -> text) into the artifact store at ``artifact_uri``, as
    ``MlflowClient.log_text`` writes them, without the run read it makes to find that store."""
    import_mlflow()
    _insecure_tls_notice(tracking_uri)
    from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

    repository = get_artifact_repository(artifact_uri, tracking_uri=tracking_uri)
    with tempfile.TemporaryDirectory() as directory:
        for artifact_file, text in texts.items():
            local = Path(directory, Path(artifact_file).name)
            local.write_text(text, encoding="utf-8")
            repository.log_artifact(str(local), str(Path(artifact_file).parent) if "/" in artifact_file else None)


def live_run(client: TrackingClient, run_id: str) -> Run:
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
