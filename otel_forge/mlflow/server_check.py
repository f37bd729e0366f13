"""Whether a tracking server takes this process's calls, asked the way MLflow's client asks: with its
credentials (``MLFLOW_TRACKING_USERNAME``/``PASSWORD``, ``MLFLOW_TRACKING_TOKEN``, ~/.mlflow/credentials,
an auth plugin) and its TLS settings (``MLFLOW_TRACKING_SERVER_CERT_PATH``,
``MLFLOW_TRACKING_INSECURE_TLS``), through MLflow's own request code, on an endpoint that needs them.

``/health`` answers anyone, so it cannot tell a wrong password or an untrusted CA from a server that
works. One read of the run's experiment can: a basic-auth server refuses it 401 for a wrong
password and 403 for a user without even READ on it. A user who may read but not write passes
that read; where the server says (MLflow's basic-auth app, to the user about itself), a second
call reads the user's permission on the experiment, so that READ is reported before a run fails.
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from otel_forge.mlflow.client import (
    WRITE_ACCESS_FIX,
    Outage,
    import_mlflow,
    outage_cause,
    outage_of,
    run_gone,
    unanswered_reason,
)
from otel_forge.scrub import error_line, scrub

if TYPE_CHECKING:
    from mlflow.utils.rest_utils import MlflowHostCreds
    from requests import Response

_GET_BY_NAME = "/api/2.0/mlflow/experiments/get-by-name"
_GET_BY_ID = "/api/2.0/mlflow/experiments/get"
# MLflow's basic-auth app (3.x): a user may read their own permission on a resource.
_USER_PERMISSION = "/api/3.0/mlflow/users/permissions/get"
_WRITES = ("EDIT", "MANAGE")  # the permissions that may create runs and log to them


class Verdict(enum.Enum):
    ANSWERS = "answers"
    WRONG_CREDENTIALS = "wrong_credentials"
    NO_PERMISSION = "no_permission"
    UNTRUSTED_CERTIFICATE = "untrusted_certificate"
    UNREACHABLE = "unreachable"
    NOT_ASKED = "not_asked"  # MLflow's client refuses its own settings: no call is made


@dataclass(frozen=True)
class ServerCheck:
    """What the check found; ``summary``: it in words (never a credential)."""

    verdict: Verdict
    summary: str
    user: str | None = None  # the user name the client sends, where it sends one
    experiment: str | None = None
    permission: str | None = None  # the user's on the experiment, where the server says it

    def as_dict(self) -> dict[str, str | None]:
        return {
            "verdict": self.verdict.value,
            "summary": self.summary,
            "user": self.user,
            "experiment": self.experiment,
            "permission": self.permission,
        }


def check_server(
    uri: str, experiment_name: str | None, experiment_id: str | None = None, timeout_s: float = 2.0
) -> ServerCheck:
    """Read the experiment (by name, else by id) from the server at ``uri`` as MLflow's client would,
    within ``timeout_s`` per call and with no retry, and say what that tells."""
    import_mlflow()
    from mlflow.utils.credentials import get_default_host_creds

    experiment = experiment_name or experiment_id
    try:
        creds = get_default_host_creds(uri)
    except Exception as error:  # noqa: BLE001 - e.g. both MLFLOW_TRACKING_INSECURE_TLS and a CA path set
        return ServerCheck(Verdict.NOT_ASKED, f"not asked: {error_line(error)}", experiment=experiment)
    user = creds.username if creds.username and creds.password else None  # as MLflow sends them
    with warnings.catch_warnings():
        # MLFLOW_TRACKING_INSECURE_TLS: urllib3 warns on every call; the summary says it once.
        warnings.filterwarnings("ignore", message="Unverified HTTPS request")
        try:
            found = _read_experiment(creds, experiment_name, experiment_id, timeout_s)
            permission = _user_permission(creds, user, found, timeout_s) if user and found else None
        except Exception as error:  # noqa: BLE001 - every failure is the check's answer
            return _refused(error, experiment, user)
        insecure = bool(creds.ignore_tls_verification) and uri.lower().startswith("https:")
    return ServerCheck(
        Verdict.ANSWERS,
        _answers(user, bool(creds.token), experiment, found, permission, insecure),
        user,
        experiment,
        permission,
    )


def _read_experiment(
    creds: MlflowHostCreds, name: str | None, experiment_id: str | None, timeout_s: float
) -> str | None:
    """The experiment's id; None where it does not exist (yet)."""
    from mlflow.utils.rest_utils import verify_rest_response

    if name:
        endpoint, response = _GET_BY_NAME, _get(creds, _GET_BY_NAME, {"experiment_name": name}, timeout_s)
    else:
        endpoint, response = _GET_BY_ID, _get(creds, _GET_BY_ID, {"experiment_id": experiment_id}, timeout_s)
    try:
        answer = verify_rest_response(response, endpoint).json()
    except Exception as error:
        if run_gone(error):  # RESOURCE_DOES_NOT_EXIST: asked and answered
            return None
        raise
    return str(answer["experiment"]["experiment_id"])


def _user_permission(creds: MlflowHostCreds, user: str, experiment_id: str, timeout_s: float) -> str | None:
    """The user's permission on the experiment, where the server tells it (MLflow's basic-auth app)."""
    params = {"username": user, "resource_type": "experiment", "resource_id": experiment_id}
    try:
        response = _get(creds, _USER_PERMISSION, params, timeout_s)
        permission = response.json().get("permission") if response.status_code == 200 else None
    except Exception:  # noqa: BLE001 - another server, or an older app: the read said what it could
        return None
    return str(permission) if permission else None


def _get(creds: MlflowHostCreds, endpoint: str, params: Mapping[str, str | None], timeout_s: float) -> Response:
    """One GET through MLflow's request code (its headers, auth and TLS), not retried."""
    from mlflow.utils.rest_utils import http_request

    return http_request(
        creds,
        endpoint,
        "GET",
        max_retries=0,
        backoff_factor=0,
        backoff_jitter=0,
        timeout=timeout_s,
        raise_on_status=False,
        params=params,
    )


def _answers(
    user: str | None,
    token: bool,
    experiment: str | None,
    found: str | None,
    permission: str | None,
    insecure: bool,
) -> str:
    who = f", authenticated as {user}" if user else " (with MLFLOW_TRACKING_TOKEN)" if token else ""
    what = experiment or "the default experiment"
    if found is None:
        said = f"; experiment {what} does not exist yet (the first run makes it)"
    elif permission is None:
        said = f"; experiment {what} can be read"
    elif permission in _WRITES:
        said = f"; permission on experiment {what}: {permission}"
    else:
        said = f"; permission on experiment {what}: {permission}, so no run can be logged there: {WRITE_ACCESS_FIX}"
    unchecked = "; the server's certificate is not checked (MLFLOW_TRACKING_INSECURE_TLS)" if insecure else ""
    return scrub(f"answers{who}{said}{unchecked}")


_VERDICTS = {
    Outage.CREDENTIALS: Verdict.WRONG_CREDENTIALS,
    Outage.PERMISSION: Verdict.NO_PERMISSION,
    Outage.CERTIFICATE: Verdict.UNTRUSTED_CERTIFICATE,
}


def _refused(error: BaseException, experiment: str | None, user: str | None) -> ServerCheck:
    outage = outage_of(error)
    verdict = Verdict.UNREACHABLE if outage is None else _VERDICTS[outage]
    cause = outage_cause(error, experiment)
    summary = cause if cause is not None else f"does not answer ({scrub(unanswered_reason(error))})"
    return ServerCheck(verdict, summary, user, experiment)
