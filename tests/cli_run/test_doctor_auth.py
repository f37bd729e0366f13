"""``otel-forge doctor`` asks the tracking server as MLflow's client would (its credentials, its CA
and insecure-TLS settings), against a real basic-auth ``mlflow server`` and a real TLS proxy: a
wrong password, a user without permission, a user who may only read, a certificate not trusted,
and each fixed. The command runs as users run it (a subprocess); no password in any output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from testkit.auth_server import ADMIN
from testkit.hermetic import hermetic_environ

REPO_ROOT = Path(__file__).resolve().parents[2]
FIX_PERMISSION = "ask its owner for EDIT, or use an experiment you can write"


def _doctor(uri: str, *options: str, **environ: str) -> subprocess.CompletedProcess[str]:
    # The TLS settings of the developer's shell would steer MLflow's client behind the test's back.
    base = {k: v for k, v in hermetic_environ().items() if not k.startswith(("MLFLOW_TRACKING_", "MLFLOW_EXPERIMENT_"))}
    return subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "doctor", "--collectors", "cpu", "--no-prometheus", *options],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "MLFLOW_TRACKING_URI": uri, **environ},
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def _mlflow_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    lines = [line.strip() for line in done.stdout.splitlines() if line.startswith("  mlflow ")]
    assert len(lines) == 1, done.stdout
    return lines[0].removeprefix("mlflow").strip()


@pytest.fixture
def experiment(auth_server):  # type: ignore[no-untyped-def]
    """An experiment of the admin's and a user made for the test: (name, id, user, password)."""
    name = f"doctor-{uuid.uuid4().hex[:8]}"
    user = f"user-{uuid.uuid4().hex[:8]}"
    return name, auth_server.create_experiment(name), user, auth_server.create_user(user)


def test_a_wrong_password_is_the_401_line_with_its_fix(auth_server) -> None:
    done = _doctor(auth_server.uri, MLFLOW_TRACKING_USERNAME=ADMIN, MLFLOW_TRACKING_PASSWORD="not-the-password")

    assert _mlflow_line(done) == (
        f"{auth_server.uri}: wrong credentials (HTTP 401): check MLFLOW_TRACKING_USERNAME and "
        "MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN"
    )
    assert "not-the-password" not in done.stdout + done.stderr


def test_a_user_without_permission_is_the_403_line_naming_the_experiment(auth_server, experiment) -> None:
    name, experiment_id, user, password = experiment
    auth_server.grant(user, experiment_id, "DENY")
    credentials = {"MLFLOW_TRACKING_USERNAME": user, "MLFLOW_TRACKING_PASSWORD": password}

    text = _doctor(auth_server.uri, MLFLOW_EXPERIMENT_NAME=name, **credentials)
    as_json = _doctor(auth_server.uri, "--json", MLFLOW_EXPERIMENT_NAME=name, **credentials)

    assert _mlflow_line(text) == f"{auth_server.uri}: no permission on experiment {name} (HTTP 403): {FIX_PERMISSION}"
    tracking = json.loads(as_json.stdout)["tracking"]
    assert (tracking["verdict"], tracking["user"], tracking["experiment"]) == ("no_permission", user, name)
    assert password not in text.stdout + text.stderr + as_json.stdout + as_json.stderr


def test_a_user_who_may_only_read_is_told_no_run_can_be_logged_there(auth_server, experiment) -> None:
    name, experiment_id, user, password = experiment
    auth_server.grant(user, experiment_id, "READ")

    done = _doctor(
        auth_server.uri, MLFLOW_EXPERIMENT_NAME=name, MLFLOW_TRACKING_USERNAME=user, MLFLOW_TRACKING_PASSWORD=password
    )

    assert _mlflow_line(done) == (
        f"{auth_server.uri}: answers, authenticated as {user}; permission on experiment {name}: READ, "
        f"so no run can be logged there: {FIX_PERMISSION}"
    )
    assert password not in done.stdout + done.stderr


def test_a_user_who_may_write_answers_with_the_permission(auth_server, experiment) -> None:
    name, experiment_id, user, password = experiment
    auth_server.grant(user, experiment_id, "EDIT")

    done = _doctor(
        auth_server.uri,
        "--json",
        MLFLOW_EXPERIMENT_ID=experiment_id,
        MLFLOW_TRACKING_USERNAME=user,
        MLFLOW_TRACKING_PASSWORD=password,
    )

    report = json.loads(done.stdout)
    assert report["endpoints"]["mlflow"] == (
        f"{auth_server.uri}: answers, authenticated as {user}; permission on experiment {experiment_id}: EDIT"
    )
    assert report["tracking"]["permission"] == "EDIT"
    assert password not in done.stdout + done.stderr


def test_an_untrusted_certificate_is_the_certificate_line_and_the_ca_bundle_fixes_it(tls_proxy) -> None:
    untrusted = _doctor(tls_proxy.uri)
    trusted = _doctor(tls_proxy.uri, MLFLOW_TRACKING_SERVER_CERT_PATH=str(tls_proxy.ca_path))

    assert _mlflow_line(untrusted) == (
        f"{tls_proxy.uri}: certificate not trusted (unable to get local issuer certificate): set "
        "MLFLOW_TRACKING_SERVER_CERT_PATH to the CA bundle that signed the server's certificate"
    )
    assert _mlflow_line(trusted) == (
        f"{tls_proxy.uri}: answers; experiment otel-forge does not exist yet (the first run makes it)"
    )


def test_insecure_tls_answers_and_says_the_certificate_is_not_checked(tls_proxy) -> None:
    done = _doctor(tls_proxy.uri, MLFLOW_TRACKING_INSECURE_TLS="true", MLFLOW_EXPERIMENT_NAME="Default")

    assert _mlflow_line(done) == (
        f"{tls_proxy.uri}: answers; experiment Default can be read; the server's certificate is not checked "
        "(MLFLOW_TRACKING_INSECURE_TLS)"
    )
    assert "InsecureRequestWarning" not in done.stderr, done.stderr


def test_the_check_is_quick_when_the_server_answers_and_bounded_when_it_hangs(mlflow_server) -> None:
    from otel_forge.mlflow.client import import_mlflow
    from otel_forge.mlflow.server_check import Verdict, check_server
    from testkit.proxy import MlflowProxy

    import_mlflow()  # doctor pays the import once, before the check
    started = time.monotonic()
    answered = check_server(mlflow_server.uri, "Default")
    answered_s = time.monotonic() - started
    with MlflowProxy(mlflow_server.uri, mode="delay", delay_s=10) as hung:
        started = time.monotonic()
        unanswered = check_server(hung.uri, "Default", timeout_s=2.0)
        unanswered_s = time.monotonic() - started

    assert answered.verdict is Verdict.ANSWERS and answered_s < 1.0, answered_s
    assert (unanswered.verdict, unanswered.summary) == (Verdict.UNREACHABLE, "does not answer (no answer in time)")
    assert 2.0 <= unanswered_s < 4.0, unanswered_s  # one try, its timeout: no retry


def test_a_local_store_is_not_asked_and_mlflow_not_imported(tmp_path) -> None:
    code = (
        "import sys; from otel_forge.cli import main; "
        "main(['doctor', '--collectors', 'cpu', '--no-prometheus']); print('mlflow' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**hermetic_environ(), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"},
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        check=False,
    )

    assert done.returncode == 0, done.stderr
    assert f"mlflow     sqlite:///{tmp_path / 'mlflow.db'}: local store" in done.stdout
    assert done.stdout.splitlines()[-1] == "False"


def test_settings_mlflow_refuses_are_said_and_nothing_is_asked(monkeypatch) -> None:
    from otel_forge.mlflow.server_check import Verdict, check_server

    monkeypatch.setenv("MLFLOW_TRACKING_INSECURE_TLS", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_SERVER_CERT_PATH", "/nowhere/ca.pem")
    check = check_server("https://127.0.0.1:9", "Default")

    assert check.verdict is Verdict.NOT_ASKED
    assert check.summary.startswith("not asked: When 'ignore_tls_verification' is true then 'server_cert_path'")
