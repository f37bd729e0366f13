"""A refused credential (401), a refused permission (403) or an untrusted certificate is an outage for
the training side too, against MLflow's real basic-auth app and a TLS proxy with a CA made here: every
value is kept in the run's journal, one line names the cause and its fix, and once it is fixed one
``otel-forge replay`` delivers everything into one run. No password in any file or line of ours."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest
from run_reading import anchor_steps

from testkit.auth_server import ADMIN
from testkit.hermetic import hermetic_environ
from testkit.servers import REPO_ROOT

STEPS = 30
TRAIN = """
import sys, time
from otel_forge import ForgeConfig, TrainingRun
config = ForgeConfig.resolve(flush_interval_s=0.2, start_wait_s=3, drain_deadline_s=2, sampling_interval_s=0.2,
                             prometheus=False, collectors=["cpu"])
with TrainingRun(config={{"lr": 0.1}}, tracking_uri={uri!r}, experiment={experiment!r}, system_metrics={sampled},
                 forge_config=config) as run:
    for step in range({steps}):
        run.log({{"loss": float(step)}}, step=step)
        if step == {pause_at} and run.run_id:  # the run is open (its companion opens it meanwhile)
            print("paused", flush=True)
            sys.stdin.readline()  # the test changes the user's permission meanwhile
        time.sleep(0.05)
"""


def _environ(spool: Path, user: str, password: str) -> dict[str, str]:
    return hermetic_environ(
        {"OTEL_FORGE_SPOOL_DIR": str(spool), "PYTHONPATH": str(REPO_ROOT)},
        prefixes=("OTEL_", "MLFLOW_"),
        MLFLOW_TRACKING_USERNAME=user,
        MLFLOW_TRACKING_PASSWORD=password,
    )


def _train(auth_server, experiment: str, env: dict[str, str], pause_at: int = -1, between=None, sampled=False) -> str:  # type: ignore[no-untyped-def]
    code = TRAIN.format(uri=auth_server.uri, experiment=experiment, steps=STEPS, pause_at=pause_at, sampled=sampled)
    code = textwrap.dedent(code)
    process = subprocess.Popen(
        [sys.executable, "-u", "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    if between is not None:
        assert process.stdout.readline().strip() == "paused"
        between()
        time.sleep(1.0)  # a flush or two meet the refusal
        process.stdin.write("\n")
        process.stdin.flush()
    _, stderr = process.communicate(timeout=180)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    return stderr


def _replay(spool: Path, env: dict[str, str], journal: bool = True) -> subprocess.CompletedProcess[str]:
    [kept] = [path for path in spool.iterdir() if path.is_dir() and path.name.startswith("journal-") == journal]
    return subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "replay", str(kept)],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _the_run(auth_server, experiment_id: str):  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    client = MlflowClient(auth_server.uri)
    runs = client.search_runs([experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


def _assert_no_password(password: str, spool: Path, *texts: str) -> None:
    assert all(password not in text for text in texts)
    assert all(password not in path.read_text(errors="replace") for path in spool.rglob("*") if path.is_file())


@pytest.fixture
def admin_env(auth_server, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", auth_server.admin_password)
    return _environ(tmp_path / "spool", ADMIN, auth_server.admin_password)


@pytest.mark.parametrize("refusal", ["read-only user", "wrong password"])
def test_a_refused_job_keeps_everything_and_one_replay_delivers_it_once_fixed(
    refusal, auth_server, tmp_path, admin_env
):
    experiment = f"refused-{uuid.uuid4().hex[:8]}"
    experiment_id = auth_server.create_experiment(experiment)
    user = f"u{uuid.uuid4().hex[:8]}"
    password = auth_server.create_user(user)  # READ on every experiment: the default
    if refusal == "wrong password":
        auth_server.grant(user, experiment_id, "EDIT")  # a writer, who mistyped the password
    spool = tmp_path / "spool"
    tried = password if refusal == "read-only user" else f"not-{password}"
    sampled = refusal == "read-only user"  # the node's windows wait for the run too
    stderr = _train(auth_server, experiment, _environ(spool, user, tried), sampled=sampled)

    cause = f"no permission on experiment {experiment} (HTTP 403)" if refusal == "read-only user" else (
        "wrong credentials (HTTP 401): check MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD"
    )  # fmt: skip
    assert cause in stderr, stderr
    assert f"{STEPS} metric value(s)" in stderr and "otel-forge replay" in stderr, stderr
    _assert_no_password(tried, spool, stderr)

    if refusal == "read-only user":
        auth_server.grant(user, experiment_id, "EDIT")  # the fix: the user may write there now
        fixed = _environ(spool, user, password)
    else:
        fixed = _environ(spool, user, password)  # the fix: the right password
    replayed = _replay(spool, fixed)
    assert replayed.returncode == 0, replayed.stderr
    client, run = _the_run(auth_server, experiment_id)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(STEPS))
    assert run.data.params == {"lr": "0.1"} and run.info.status == "FINISHED"
    _assert_no_password(password, spool, replayed.stdout, replayed.stderr)
    if sampled:  # then the windows, into the same run (found by its job key)
        windows = _replay(spool, fixed, journal=False)
        assert windows.returncode == 0, windows.stderr
        steps = anchor_steps(client, run.info.run_id)
        assert len(steps) >= 2 and steps == list(range(len(steps))), steps


def test_edit_taken_away_mid_run_keeps_the_rest_for_the_replay(auth_server, tmp_path, admin_env):
    experiment = f"revoked-{uuid.uuid4().hex[:8]}"
    experiment_id = auth_server.create_experiment(experiment)
    user = f"u{uuid.uuid4().hex[:8]}"
    password = auth_server.create_user(user)
    auth_server.grant(user, experiment_id, "EDIT")
    spool = tmp_path / "spool"
    env = _environ(spool, user, password)

    stderr = _train(auth_server, experiment, env, pause_at=10, between=lambda: auth_server.revoke(user, experiment_id))
    assert f"no permission on experiment {experiment} (HTTP 403)" in stderr, stderr
    assert "bad step, key or value" not in stderr, stderr  # the values are not blamed
    client, run = _the_run(auth_server, experiment_id)
    delivered = sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
    assert delivered == list(range(len(delivered))) and len(delivered) < STEPS  # the rest waits

    auth_server.grant(user, experiment_id, "EDIT")
    replayed = _replay(spool, env)
    assert replayed.returncode == 0, replayed.stderr
    client, run = _the_run(auth_server, experiment_id)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(STEPS))
    assert run.info.status == "FINISHED"
    _assert_no_password(password, spool, stderr, replayed.stdout, replayed.stderr)


def test_an_untrusted_certificate_keeps_everything_and_a_replay_with_its_ca_delivers(tls_proxy, client, tmp_path):
    experiment = f"untrusted-{uuid.uuid4().hex[:8]}"
    spool = tmp_path / "spool"
    env = hermetic_environ(
        {"OTEL_FORGE_SPOOL_DIR": str(spool), "PYTHONPATH": str(REPO_ROOT)}, prefixes=("OTEL_", "MLFLOW_")
    )
    code = textwrap.dedent(
        TRAIN.format(uri=tls_proxy.uri, experiment=experiment, steps=STEPS, pause_at=-1, sampled=False)
    )
    job = subprocess.run(
        [sys.executable, "-u", "-c", code], env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert job.returncode == 0 and "Traceback" not in job.stderr, job.stderr
    assert "certificate not trusted" in job.stderr and "MLFLOW_TRACKING_SERVER_CERT_PATH" in job.stderr, job.stderr
    assert f"{STEPS} metric value(s)" in job.stderr, job.stderr

    replayed = _replay(spool, {**env, "MLFLOW_TRACKING_SERVER_CERT_PATH": str(tls_proxy.ca_path)})
    assert replayed.returncode == 0, replayed.stderr
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(STEPS))
    assert run.info.status == "FINISHED"
