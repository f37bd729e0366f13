"""The close's deadline: by the job's size, within the scheduler's grace where it is known (SLURM's
``KillWait`` from ``scontrol show config``, the pod's ``terminationGracePeriodSeconds`` from the API
server), the ``drain_deadline_s`` setting over both.

SLURM and Kubernetes are not on this machine: ``scontrol`` is a script printing what SLURM 23's
prints, and the API server an HTTPS server answering the pod as the real one does (``GET
/api/v1/namespaces/<ns>/pods/<name>`` with the service account's bearer token)."""

from __future__ import annotations

import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from otel_forge.config import ForgeConfig
from otel_forge.kubernetes import KubernetesIdentity
from otel_forge.scheduler_grace import close_deadline, pod_termination_grace, scheduler_grace

SCONTROL_SHOW_CONFIG = """Configuration data as of 2026-12-04T10:00:00
AccountingStorageBackupHost = (null)
InactiveLimit           = 0 sec
KeepAliveTime           = SYSTEM_DEFAULT
KillOnBadExit           = 0
KillWait                = {seconds} sec
LaunchParameters        = (null)
"""


@pytest.mark.parametrize(
    ("nodes", "grace_s", "deadline_s"),
    [
        (1, None, 10.0),  # one node: the old default
        (333, None, 10.0),
        (1024, None, pytest.approx(30.72)),  # 0.03 s a node
        (2048, None, 60.0),  # at most a minute
        (2048, 30.0, 25.0),  # SLURM's default KillWait, less the margin
        (8, 90.0, 10.0),  # a long grace does not lengthen a small job's close
        (2048, 6.0, 3.0),  # a grace shorter than the margin: half of it
    ],
)
def test_the_deadline_follows_the_job_size_within_the_grace(nodes, grace_s, deadline_s) -> None:
    assert ForgeConfig.defaults().close_deadline_s(nodes, grace_s) == deadline_s


def test_the_setting_overrides_size_and_grace(monkeypatch, tmp_path) -> None:
    _scontrol(monkeypatch, tmp_path, kill_wait=30)
    config = ForgeConfig.resolve(environ={"OTEL_FORGE_DRAIN_DEADLINE": "120"})
    monkeypatch.setenv("SLURM_JOB_ID", "7")

    assert close_deadline(config, 2048, None) == (120.0, "drain_deadline_s from env OTEL_FORGE_DRAIN_DEADLINE")


def test_slurms_kill_wait_bounds_a_large_jobs_close(monkeypatch, tmp_path) -> None:
    _scontrol(monkeypatch, tmp_path, kill_wait=45)
    monkeypatch.setenv("SLURM_JOB_ID", "7")

    seconds, why = close_deadline(ForgeConfig.defaults(), 2048, None)

    assert seconds == 40.0 and why == "a job of 2048 node(s), within SLURM KillWait (45 s)"


def test_no_scontrol_or_no_slurm_job_means_no_grace(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol
    assert scheduler_grace({"SLURM_JOB_ID": "7"}) is None
    _scontrol(monkeypatch, tmp_path, kill_wait=45)
    assert scheduler_grace({}) is None  # outside a SLURM job, its configuration is not this job's


def _scontrol(monkeypatch: pytest.MonkeyPatch, directory: Path, kill_wait: int) -> None:
    script = directory / "scontrol"
    script.write_text(f"#!/bin/sh\n/bin/cat <<'EOF'\n{SCONTROL_SHOW_CONFIG.format(seconds=kill_wait)}EOF\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", str(directory))


# --- Kubernetes ---------------------------------------------------------------------------------------

POD = KubernetesIdentity(pod_name="train-worker-3", namespace="ml", node_name="gpu-17")


class _ApiServer:
    """HTTPS on 127.0.0.1, its certificate signed by a CA of the test's (the service account's
    ca.crt); answers the pod to the right bearer token, 403 to any other (no RBAC to read pods)."""

    def __init__(self, directory: Path, grace_s: int) -> None:
        from testkit.tls_proxy import write_certificates

        self.ca, cert, key = write_certificates(directory)
        self.paths: list[str] = []
        pod = {"kind": "Pod", "metadata": {"name": POD.pod_name}, "spec": {"terminationGracePeriodSeconds": grace_s}}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                server.paths.append(self.path)
                allowed = self.headers.get("Authorization") == "Bearer sa-token"
                body = json.dumps(pod if allowed else {"kind": "Status", "code": 403}).encode()
                self.send_response(200 if allowed else 403)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self._http.socket = context.wrap_socket(self._http.socket, server_side=True)
        threading.Thread(target=self._http.serve_forever, daemon=True).start()
        self.environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(self._http.server_port)}

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()


@pytest.fixture
def api_server(tmp_path):
    server = _ApiServer(tmp_path / "tls", grace_s=90)
    yield server
    server.close()


def _account(directory: Path, ca: Path, token: str) -> Path:
    directory.mkdir()
    (directory / "token").write_text(token + "\n")
    (directory / "ca.crt").write_bytes(ca.read_bytes())
    return directory


def test_the_pods_termination_grace_is_read_from_the_api_server(api_server, tmp_path) -> None:
    account = _account(tmp_path / "sa", api_server.ca, "sa-token")

    grace = scheduler_grace(api_server.environ, POD, account)

    assert grace is not None and (grace.seconds, grace.source) == (90.0, "the pod's terminationGracePeriodSeconds")
    assert api_server.paths == ["/api/v1/namespaces/ml/pods/train-worker-3"]


def test_a_pod_that_may_not_read_itself_has_no_known_grace(api_server, tmp_path) -> None:
    refused = _account(tmp_path / "sa", api_server.ca, "another-token")
    assert pod_termination_grace(POD, api_server.environ, refused) is None
    assert pod_termination_grace(POD, api_server.environ, tmp_path / "no-account") is None
    assert pod_termination_grace(KubernetesIdentity(), api_server.environ, refused) is None  # no pod name
