"""OTLP from a real Collector into a run, through the node agent (``otel-forge monitor --run-id
--otlp-receiver``): rotel, an OpenTelemetry Collector in Rust shipped as a wheel, receives the SDK's
export and forwards it to the agent. And a tracking server that dies while OTLP flows: what was
received meanwhile waits in the spool and reaches the run once the server is back."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from otlp_requests import gauges, post

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.received_runs import ReceivedRuns
from testkit.hermetic import hermetic_environ
from testkit.servers import free_port, listening, wait_for

SENDER = Path(__file__).resolve().parent / "sender.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
rotel = pytest.importorskip("rotel")
ROTEL_AGENT = Path(rotel.__file__).parent / "rotel-agent"


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_a_collector_forwards_to_the_node_agent_and_its_metrics_land_in_the_run(mlflow_server, client, tmp_path):
    run_id = client.create_run(client.create_experiment(f"otlp-collector-{tmp_path.name}")).info.run_id
    agent_grpc, agent_http, rotel_grpc, rotel_http = (free_port() for _ in range(4))
    env = hermetic_environ(
        PYTHONPATH=str(REPO_ROOT), OTEL_FORGE_SPOOL_DIR=str(tmp_path / "spool"),
        OTEL_FORGE_OTLP_RECEIVER_GRPC_PORT=str(agent_grpc), OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT=str(agent_http),
    )  # fmt: skip
    agent = subprocess.Popen(
        [sys.executable, "-m", "otel_forge.cli", "monitor", "--run-id", run_id, "--tracking-uri", mlflow_server.uri,
         "--otlp-receiver", "--no-prometheus", "--interval", "0.3"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    collector = subprocess.Popen(
        [str(ROTEL_AGENT), "start", "--otlp-grpc-endpoint", f"127.0.0.1:{rotel_grpc}", "--otlp-http-endpoint",
         f"127.0.0.1:{rotel_http}", "--exporter", "otlp", "--otlp-exporter-endpoint", f"http://127.0.0.1:{agent_grpc}",
         "--pid-file", str(tmp_path / "rotel.pid"), "--log-file", str(tmp_path / "rotel.log")],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=hermetic_environ(),
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: listening(agent_grpc) and listening(rotel_http), 30, message="the agent and rotel")
        sent = subprocess.run(
            [sys.executable, str(SENDER), "http"], env={**env, "OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT": str(rotel_http)},
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr
        metrics = lambda: client.get_run(run_id).data.metrics  # noqa: E731
        wait_for(lambda: metrics().get("otlp/samples/split_train") == 150.0, 60, message="the forwarded counter")
        wait_for(lambda: metrics().get("otlp/step.latency/count") == 4.0, 60, message="the forwarded histogram")
        assert metrics()["otlp/queue.depth"] == 3.0
        assert "system/cpu_utilization_percentage" in metrics()  # the node's own, beside it
    finally:
        _stop(collector)
        _stop(agent)
    out, err = agent.communicate()
    assert agent.returncode == 0, err
    assert f"otel-forge: serving otlp grpc://localhost:{agent_grpc}" in out, out


def test_a_server_outage_while_otlp_flows_loses_nothing(killable_server, tmp_path):
    from mlflow import MlflowClient

    server = killable_server
    client = MlflowClient(server.uri)
    run_id = client.create_run(client.create_experiment(f"otlp-outage-{tmp_path.name}")).info.run_id
    config = ForgeConfig.resolve(
        environ={}, otlp_receiver=True, otlp_receiver_grpc_port=free_port(), otlp_receiver_http_port=free_port(),
        sampling_interval_s=0.2, spool_dir=str(tmp_path / "spool"), prometheus=False,
    )  # fmt: skip
    runs = ReceivedRuns(config, server.uri).start()
    runs.serve(run_id)
    sent = []
    try:
        for value in range(1, 31):  # 6 s of a gauge that rises: up, down for 3 s, up again
            if value == 6:
                server.kill()
            if value == 21:
                server.start()
            assert post(runs.receiver.http_port, gauges(1, "rising", float(value)).SerializeToString())[0] == 200
            sent.append(float(value))
            time.sleep(0.2)
    finally:
        runs.stop(30.0)
    history = sorted(client.get_metric_history(run_id, "otlp/rising/i_0"), key=lambda m: m.step)
    values = [m.value for m in history]
    assert values == sorted(values) and values[-1] == 30.0, values  # in order, to the last
    during = [m for m in history if 6 <= m.value <= 20]
    assert during, "the windows received while the server was down reached the run"
    assert not [path for path in (tmp_path / "spool").rglob("*.window.json")], "nothing left in the spool"
