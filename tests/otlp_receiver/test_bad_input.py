"""What the OTLP receiver answers to what is not a good request, and that it costs nothing else: garbage
bytes, a request over the size limit, a wrong content type, 100,000 distinct series, a flood. Each
answer is the OTLP specification's (a ``google.rpc.Status``, a partial success, a retryable 503 or
RESOURCE_EXHAUSTED), memory and threads stay bounded, and a good request after it lands in the run."""

from __future__ import annotations

import contextlib
import gzip
import socket
import threading
import time
import tracemalloc

import grpc
import pytest
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from otlp_requests import gauges, post

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.received_runs import ReceivedRuns
from otel_forge.pipeline.otlp_receiver import WORKERS, OtlpReceiver, Received
from testkit.servers import free_port, wait_for

EXPORT = "/opentelemetry.proto.collector.metrics.v1.MetricsService/Export"
MAX_BYTES = 1 << 20
MAX_SERIES = 300
# Headers whose body never comes: the connection holds a worker until the receiver's idle timeout.
HELD_REQUEST = b"POST /v1/metrics HTTP/1.1\r\nContent-Type: application/x-protobuf\r\nContent-Length: 10\r\n\r\n"


def _config(tmp_path, **more) -> ForgeConfig:
    return ForgeConfig.resolve(
        environ={}, otlp_receiver=True, otlp_receiver_grpc_port=free_port(), otlp_receiver_http_port=free_port(),
        otlp_receiver_max_request_bytes=MAX_BYTES, otlp_receiver_max_series=MAX_SERIES, sampling_interval_s=0.2,
        spool_dir=str(tmp_path / "spool"), prometheus=False, **more,
    )  # fmt: skip


def _status(body: bytes) -> status_pb2.Status:
    status = status_pb2.Status()
    status.ParseFromString(body)
    return status


def _grpc_export(port: int, body: bytes, timeout_s: float = 30) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return channel.unary_unary(EXPORT)(body, timeout=timeout_s)


@pytest.fixture
def received(mlflow_server, client, tmp_path):
    """A receiver serving a fresh run of the session's server; the run's id, and a reader of its keys."""
    run_id = client.create_run(client.create_experiment(f"otlp-bad-{tmp_path.name}")).info.run_id
    runs = ReceivedRuns(_config(tmp_path), mlflow_server.uri).start()
    runs.serve(run_id)
    yield runs, run_id
    runs.stop(10.0)


def _lands(client, runs: ReceivedRuns, run_id: str) -> None:
    """A good request after the bad ones: taken whole, and in the run within a few windows."""
    status, _, body, _ = post(runs.receiver.http_port, gauges(1, "after").SerializeToString())
    assert status == 200 and ExportMetricsServiceResponse.FromString(body).partial_success.rejected_data_points == 0
    wait_for(lambda: "otlp/after/i_0" in client.get_run(run_id).data.metrics, 30, message="the good request's key")


def test_garbage_bytes_are_a_400_with_a_status_and_invalid_argument_and_cost_nothing_else(received, client):
    runs, run_id = received
    garbage = bytes(range(256)) * 8
    status, content_type, body, _ = post(runs.receiver.http_port, garbage)
    assert (status, content_type) == (400, "application/x-protobuf")
    assert _status(body).code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "not an OTLP metrics request" in _status(body).message
    status, content_type, body, _ = post(runs.receiver.http_port, b"{not json", "application/json")
    assert (status, content_type) == (400, "application/json") and b"not an OTLP metrics request" in body
    with pytest.raises(grpc.RpcError) as raised:
        _grpc_export(runs.receiver.grpc_port, garbage)
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    _lands(client, runs, run_id)


def test_a_request_over_the_limit_is_refused_unread_413_and_resource_exhausted(received, client):
    runs, run_id = received
    big = gauges(1, "x" * 200).SerializeToString() * (MAX_BYTES // 200)  # a valid protobuf, over the limit
    assert len(big) > MAX_BYTES
    status, _, body, _ = post(runs.receiver.http_port, big)
    assert status == 413 and _status(body).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    # Far more than the sockets' buffers hold: the client is still sending as the answer comes, and
    # reads it once sent (the body is drained, not left to reset the connection: a broken pipe before).
    status, _, body, _ = post(runs.receiver.http_port, big * 16)
    assert status == 413 and _status(body).code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    # Small on the wire, over the limit once unzipped: refused as it is unzipped, not after.
    status, _, body, _ = post(runs.receiver.http_port, gzip.compress(big), **{"Content-Encoding": "gzip"})
    assert status == 413 and b"unzipped" in body
    with pytest.raises(grpc.RpcError) as raised:
        _grpc_export(runs.receiver.grpc_port, big)
    assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    _lands(client, runs, run_id)


@pytest.mark.parametrize("content_type", ["text/plain", "application/xml", ""])
def test_a_wrong_content_type_is_a_415(received, client, content_type):
    runs, run_id = received
    status, _, body, _ = post(runs.receiver.http_port, gauges(1).SerializeToString(), content_type)
    assert status == 415 and b"Content-Type must be application/x-protobuf or application/json" in body
    _lands(client, runs, run_id)


def test_a_hundred_thousand_series_are_a_partial_success_and_the_run_keeps_its_cap(received, client):
    runs, run_id = received
    requests = [gauges(10_000, "exploding", first=i * 10_000).SerializeToString() for i in range(10)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        replies = [post(runs.receiver.http_port, request) for request in requests]
        kept = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert {status for status, _, _, _ in replies} == {200}
    partials = [ExportMetricsServiceResponse.FromString(body).partial_success for _, _, body, _ in replies]
    assert sum(partial.rejected_data_points for partial in partials) == 100_000 - MAX_SERIES
    assert all(f"has the most series it takes ({MAX_SERIES})" in partial.error_message for partial in partials)
    # What stays once the requests are answered: the run's 300 series, not the 100,000 (~10 MB parsed).
    assert kept < 2 << 20, kept
    again = gauges(1, "exploding", 2.0)  # a series it holds already: still taken, and delivered
    status, _, body, _ = post(runs.receiver.http_port, again.SerializeToString())
    assert status == 200 and not ExportMetricsServiceResponse.FromString(body).HasField("partial_success")
    metrics = lambda: client.get_run(run_id).data.metrics  # noqa: E731
    wait_for(lambda: metrics().get("otlp/exploding/i_0") == 2.0, 30, message="the held series' new value")
    assert len([key for key in metrics() if key.startswith("otlp/exploding/")]) == MAX_SERIES


def test_a_flood_gets_503s_with_retry_after_and_bounded_threads_never_a_queue(tmp_path):
    """Every worker held (a request whose body never comes; gRPC calls held in their delivery): the
    next request is answered at once, 503 and Retry-After / RESOURCE_EXHAUSTED, and no thread is added."""
    release = threading.Event()

    def slow(request: ExportMetricsServiceRequest, run_id: str | None) -> Received:
        release.wait(30)
        return Received()

    receiver = OtlpReceiver(_config(tmp_path), slow).start()
    held: list[socket.socket] = []
    try:
        threads_before = threading.active_count()
        for _ in range(WORKERS):
            sock = socket.create_connection(("127.0.0.1", receiver.http_port))
            sock.sendall(
                b"POST /v1/metrics HTTP/1.1\r\nContent-Type: application/x-protobuf\r\nContent-Length: 10\r\n\r\n"
            )
            held.append(sock)
        wait_for(lambda: threading.active_count() == threads_before + WORKERS, 10, message="every worker busy")
        began = time.monotonic()
        replies = [post(receiver.http_port, gauges(1).SerializeToString()) for _ in range(50)]
        assert {(status, retry) for status, _, _, retry in replies} == {(503, "1")}
        assert time.monotonic() - began < 10  # answered at once: nothing waited in a queue
        assert threading.active_count() == threads_before + WORKERS

        calls = [threading.Thread(target=_grpc_quietly, args=(receiver.grpc_port,)) for _ in range(WORKERS)]
        for call in calls:
            call.start()
        time.sleep(1.0)
        with pytest.raises(grpc.RpcError) as raised:
            _grpc_export(receiver.grpc_port, gauges(1).SerializeToString(), timeout_s=10)
        assert raised.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        release.set()
        for sock in held:
            sock.close()
        receiver.stop()


def _grpc_quietly(port: int) -> None:
    with contextlib.suppress(grpc.RpcError):
        _grpc_export(port, gauges(1).SerializeToString())


def test_a_port_in_use_costs_that_transport_only_said_in_one_line(tmp_path, caplog):
    """A Collector (or another agent) on the HTTP port: gRPC is received, HTTP is not, and one line says
    which port, why, and the setting that moves it."""
    config = _config(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", config.otlp_receiver_http_port))
        taken.listen()
        receiver = OtlpReceiver(config, lambda request, run_id: Received()).start()
        try:
            assert receiver.http_port is None and receiver.grpc_port == config.otlp_receiver_grpc_port
            assert [e.split("://")[0] for e in receiver.endpoints] == ["otlp grpc"]
            response = ExportMetricsServiceResponse.FromString(
                _grpc_export(receiver.grpc_port, gauges(1).SerializeToString())
            )
            assert not response.HasField("partial_success")
        finally:
            receiver.stop()
    [line] = [r.getMessage() for r in caplog.records if r.name == "otel_forge.pipeline.otlp_receiver"]
    assert f"port {config.otlp_receiver_http_port} could not be bound" in line
    assert "OTLP/HTTP is not received" in line and "OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT" in line
