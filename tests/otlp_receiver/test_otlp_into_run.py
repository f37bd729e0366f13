"""OTLP metrics into the job's run: a program with the OpenTelemetry SDK exports to ``otel-forge run
--otlp-receiver`` over gRPC and over HTTP, and the job's run holds the keys, one step per window, with
the values it sent; a request naming a run (``x-mlflow-run-id``) lands in that run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from testkit.hermetic import hermetic_environ
from testkit.servers import free_port

SENDER = Path(__file__).resolve().parent / "sender.py"
REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_LINE = re.compile(r"^otel-forge: run ([0-9a-f]{32}) in experiment", re.MULTILINE)


def _forge_run(uri: str, experiment: str, tmp_path: Path, *command: str) -> tuple[subprocess.CompletedProcess, str]:
    env = hermetic_environ(
        MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME=experiment, PYTHONPATH=str(REPO_ROOT),
        OTEL_FORGE_OTLP_RECEIVER_GRPC_PORT=str(free_port()), OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT=str(free_port()),
        OTEL_FORGE_SPOOL_DIR=str(tmp_path / "spool"),
    )  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "otel_forge.cli", "run", "--otlp-receiver", "--no-prometheus", "--interval", "0.3",
         "--", *command],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    match = RUN_LINE.search(done.stderr)
    assert match, done.stderr
    return done, match.group(1)


def _latest(client, run_id: str) -> dict[str, float]:
    return {key: value for key, value in client.get_run(run_id).data.metrics.items() if key.startswith("otlp/")}


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_sdks_exporters_send_into_the_jobs_run(mlflow_server, client, tmp_path, protocol):
    experiment = f"otlp-in-{protocol}-{tmp_path.name}"
    done, run_id = _forge_run(mlflow_server.uri, experiment, tmp_path, sys.executable, str(SENDER), protocol)
    assert "sent" in done.stdout
    assert f"otel-forge: serving otlp {protocol}://" in done.stderr
    latest = _latest(client, run_id)
    assert latest == {
        "otlp/samples/split_train": 150.0,  # the counter's total
        "otlp/samples/split_train/rate": pytest.approx(latest["otlp/samples/split_train/rate"]),
        "otlp/queue.depth": 3.0,  # the up-down counter
        "otlp/loader.temperature/loader_a": 63.5,  # the gauge, at its last window
        "otlp/step.latency/count": 4.0,
        "otlp/step.latency/mean": 3.0,
        "otlp/step.latency/p50": pytest.approx(latest["otlp/step.latency/p50"]),
        "otlp/step.latency/p90": pytest.approx(latest["otlp/step.latency/p90"]),
        "otlp/step.latency/p99": pytest.approx(latest["otlp/step.latency/p99"]),
    }, latest
    # The SDK's default buckets (0, 5, 10, ...): 1, 2, 3 and 6 are 3 in (0, 5] and 1 in (5, 10].
    assert 0 < latest["otlp/step.latency/p50"] <= 5 < latest["otlp/step.latency/p99"] <= 10
    history = sorted(client.get_metric_history(run_id, "otlp/samples/split_train"), key=lambda m: m.step)
    assert history[-1].value == 150.0 and {m.value for m in history} <= {100.0, 150.0}, history
    # In the node's own windows: each value at one of the node's steps, with that window's timestamp.
    node = {m.step: m.timestamp for m in client.get_metric_history(run_id, "system/cpu_utilization_percentage")}
    assert {(m.step, m.timestamp) for m in history} <= set(node.items()), (history, node)


def test_a_request_naming_a_run_lands_in_that_run(mlflow_server, client, tmp_path):
    experiment = f"otlp-named-{tmp_path.name}"
    other = client.create_run(client.create_experiment(experiment + "-other")).info.run_id
    _, run_id = _forge_run(mlflow_server.uri, experiment, tmp_path, sys.executable, str(SENDER), "http", other)
    assert _latest(client, other)["otlp/samples/split_train"] == 150.0
    assert _latest(client, run_id) == {}  # the job's run got none of it
