"""A refused credential (401), a refused permission (403) and an untrusted certificate are outages,
not bad input: classified against the errors MLflow's REAL client raises from a real basic-auth
``mlflow server`` and a real TLS proxy, named in one line with their fix, and what was refused is
kept and delivered once fixed. No credential in any line, spool file or output.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from otel_points import gauge, metrics_data

from otel_forge.config import ForgeConfig
from otel_forge.mlflow import MLflowMetricExporter
from otel_forge.mlflow.client import (
    WRONG_CREDENTIALS,
    RunInfo,
    classify,
    make_client,
    outage_cause,
    unanswered_reason,
)
from otel_forge.mlflow.delivery.retry import Outcome
from testkit.auth_server import ADMIN
from testkit.hermetic import hermetic_environ
from testkit.servers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_KEY = "system/node_0/cpu_utilization_percentage"
UNTRUSTED = (
    "certificate not trusted (unable to get local issuer certificate): set MLFLOW_TRACKING_SERVER_CERT_PATH to "
    "the CA bundle that signed the server's certificate"
)


def _as(monkeypatch: pytest.MonkeyPatch, user: str, password: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def _refusal(call) -> BaseException:  # type: ignore[no-untyped-def]
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException) as refused:
        call()
    return refused.value


def _metric(value: float, step: int) -> list:  # type: ignore[type-arg]
    from mlflow.entities import Metric

    return [Metric("loss", value, 1_700_000_000_000 + step, step)]


@pytest.fixture
def read_only(auth_server, monkeypatch):  # type: ignore[no-untyped-def]
    """An experiment and a run of the admin's, and a user who may only read them: (user, password,
    experiment name, experiment id, run id)."""
    name = f"read-only-{uuid.uuid4().hex[:8]}"
    experiment_id = auth_server.create_experiment(name)
    user = f"reader-{uuid.uuid4().hex[:8]}"
    password = auth_server.create_user(user)
    auth_server.grant(user, experiment_id, "READ")
    return user, password, name, experiment_id, auth_server.create_run(experiment_id)


def test_a_wrong_password_is_retried_and_named_with_its_fix(auth_server, monkeypatch) -> None:
    _as(monkeypatch, ADMIN, "not-the-password")
    error = _refusal(lambda: make_client(auth_server.uri).search_experiments(max_results=1))

    assert "401" in str(error)  # MLflow: "... failed with error code 401 != 200. Response body: ..."
    assert classify(error) is Outcome.RETRY
    assert outage_cause(error) == outage_cause(error, "any") == WRONG_CREDENTIALS
    assert WRONG_CREDENTIALS == (
        "wrong credentials (HTTP 401): check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, "
        "or MLFLOW_TRACKING_TOKEN"
    )
    assert unanswered_reason(error) == WRONG_CREDENTIALS


def test_a_user_who_may_only_read_is_refused_403_retried_and_told_the_experiment(
    auth_server, read_only, monkeypatch
) -> None:
    user, password, name, _, run_id = read_only
    _as(monkeypatch, user, password)
    client = make_client(auth_server.uri)
    assert client.get_run(run_id).info.run_id == run_id  # READ reads

    error = _refusal(lambda: client.log_batch(run_id, metrics=_metric(0.5, 0), synchronous=True))

    assert "403" in str(error)
    assert classify(error) is Outcome.RETRY
    assert outage_cause(error, name) == (
        f"no permission on experiment {name} (HTTP 403): ask its owner for EDIT, or use an experiment you can write"
    )
    assert outage_cause(error) == (
        "no permission on the run's experiment (HTTP 403): ask its owner for EDIT, or use an experiment you can write"
    )
    assert unanswered_reason(error) == outage_cause(error)
    assert password not in str(outage_cause(error, name))


def test_an_untrusted_certificate_is_retried_and_its_ca_bundle_fixes_it(tls_proxy, monkeypatch) -> None:
    error = _refusal(lambda: make_client(tls_proxy.uri).search_experiments(max_results=1))

    assert "CERTIFICATE_VERIFY_FAILED" in str(error)  # MLflow reports it as an INTERNAL_ERROR (HTTP 500)
    assert classify(error) is Outcome.RETRY
    assert outage_cause(error) == UNTRUSTED
    assert unanswered_reason(error) == UNTRUSTED  # not "HTTP 500"

    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", str(tls_proxy.ca_path))
    assert make_client(tls_proxy.uri).search_experiments(max_results=1)


def test_https_to_a_plain_http_server_is_a_tls_failure_not_http_500(mlflow_server) -> None:
    error = _refusal(lambda: make_client(mlflow_server.uri.replace("http:", "https:")).search_experiments())

    assert outage_cause(error) is None and classify(error) is Outcome.RETRY
    assert unanswered_reason(error) == "TLS failed (wrong version number)"


def test_other_errors_have_no_outage_cause(auth_server, read_only, mlflow_server, monkeypatch) -> None:
    from mlflow.entities import Metric

    run_id = read_only[-1]
    _as(monkeypatch, ADMIN, auth_server.admin_password)
    client = make_client(auth_server.uri)
    too_long = [Metric("x" * 1000, 1.0, 1_700_000_000_000, 0)]
    bad = _refusal(lambda: client.log_batch(run_id, metrics=too_long, synchronous=True))
    gone = _refusal(lambda: make_client(mlflow_server.uri).get_run("0" * 32))

    assert outage_cause(bad) is None and outage_cause(gone) is None
    assert classify(bad) is Outcome.DROP and classify(gone) is Outcome.STOP


# --- the system side: windows refused are kept, and replayed once fixed --------------------------


@pytest.mark.parametrize("refused", ["wrong password", "read only"])
def test_refused_windows_are_kept_in_the_spool_and_replay_delivers_them_once_fixed(
    auth_server, read_only, refused, tmp_path, monkeypatch, caplog
) -> None:
    from mlflow import MlflowClient

    user, password, name, experiment_id, run_id = read_only
    sent = password if refused == "read only" else "not-the-password"
    caplog.set_level(logging.WARNING, logger="otel_forge")
    _as(monkeypatch, user, sent)
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=auth_server.uri,
        node_id="node_0",
        samples_per_window=1,
        config=ForgeConfig.resolve(environ={}, drain_deadline_s=0.5, spool_dir=str(tmp_path / "spool")),
        known=RunInfo(experiment_id, "", name),
    )
    for value in (0.25, 0.5, 0.75):
        exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, value)])))
    wait_for(lambda: exporter.worker.stats.retried >= 1, 20, 0.05, "a refused call")
    exporter.shutdown()

    spool = exporter.spool.path
    kept = len(list(spool.glob("*.window.json")))
    stored = "\n".join(f.read_text() for f in spool.iterdir())
    assert exporter.delivery_counts()["dropped"] == 0 and kept >= 3, exporter.delivery_counts()
    cause = (
        f"no permission on experiment {name} (HTTP 403): ask its owner for EDIT, or use an experiment you can write"
        if refused == "read only"
        else WRONG_CREDENTIALS
    )
    warned = [r.getMessage() for r in caplog.records]
    assert any(f"retrying: {cause}" in line for line in warned), warned
    assert any(f"otel-forge replay {spool}" in line for line in warned), warned

    # Replayed with the same credentials: refused again, said in one line, and nothing leaves the spool.
    again = _replay(spool, {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": sent})
    assert again.returncode == 1 and len(list(spool.glob("*.window.json"))) == kept
    said = f"no permission on experiment {experiment_id} (HTTP 403)" if refused == "read only" else WRONG_CREDENTIALS
    assert f"replay stopped, the spool is kept: {said}" in again.stderr, again.stderr
    # Fixed: the admin's credentials.
    fixed = _replay(spool, {"MLFLOW_TRACKING_USERNAME": ADMIN, "MLFLOW_TRACKING_PASSWORD": auth_server.admin_password})
    assert fixed.returncode == 0, fixed.stderr
    assert f"delivered {kept} window(s) to run {run_id}" in fixed.stdout
    assert not spool.exists()

    _as(monkeypatch, ADMIN, auth_server.admin_password)
    points = MlflowClient(auth_server.uri).get_metric_history(run_id, CPU_KEY)
    assert sorted((m.step, m.value) for m in points)[:3] == [(0, 25.0), (1, 50.0), (2, 75.0)]

    everything = "\n".join([caplog.text, *warned, stored, again.stdout, again.stderr, fixed.stdout, fixed.stderr])
    assert password not in everything and auth_server.admin_password not in everything


def _replay(spool: Path, credentials: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "replay", str(spool)],
        capture_output=True,
        text=True,
        timeout=120,
        env=hermetic_environ(credentials, MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT="20"),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )


# --- MLFLOW_TRACKING_INSECURE_TLS: one line per process, not one per call --------------------------

_CALLS = """
import logging
from otel_forge.mlflow.client import make_client
logging.basicConfig(format="%(levelname)s %(name)s %(message)s")
for _ in range(3):
    make_client({uri!r}).search_experiments(max_results=1)
print("answered")
"""


def test_insecure_tls_is_said_once_per_process_not_once_per_call(tls_proxy) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CALLS.format(uri=tls_proxy.uri)],
        capture_output=True,
        text=True,
        timeout=120,
        env=hermetic_environ(MLFLOW_TRACKING_INSECURE_TLS="true", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0"),
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )

    assert done.returncode == 0 and "answered" in done.stdout, done.stderr
    assert done.stderr.count("MLFLOW_TRACKING_INSECURE_TLS is set") == 1, done.stderr
    assert "InsecureRequestWarning" not in done.stderr, done.stderr
