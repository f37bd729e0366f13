"""The real OTLP exporters (HTTP and gRPC) deliver the agent's metrics to a receiver the test runs:
names, units, kinds and attributes as in ``otel_forge.names.METRICS``, and the agent's resource."""

from __future__ import annotations

import datetime
import gzip
import http.server
import ipaddress
import logging
import socket
import threading
import zlib
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.metrics.v1 import metrics_pb2
from opentelemetry.sdk.version import __version__ as sdk_version

from otel_forge import METRICS, Agent, ForgeConfig
from otel_forge.names import Kind
from otel_forge.node import NODE_ID_ATTRIBUTE
from testkit.hermetic import apply_hermetic
from testkit.servers import AgentProcess, spawn_agent, wait_for

COLLECTORS = ("cpu", "memory", "disk", "network", "process")
# Rows of the table that a machine may legitimately not report: per-CPU utilization is off by
# default; a machine without swap has no paging utilization (a fraction of nothing).
CONDITIONAL = {"system.paging.utilization"}
DELIVERY_TIMEOUT_S = 10.0
RECEIVER_THREAD = "otlp-receiver"

ExportRequest = metrics_service_pb2.ExportMetricsServiceRequest


# --- receivers ----------------------------------------------------------------------------------


@dataclass
class Received:
    """What a receiver got: the decoded requests and the HTTP paths they were posted to."""

    requests: list[ExportRequest] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: ExportRequest, path: str = "") -> None:
        with self.lock:
            self.requests.append(request)
            self.paths.append(path)

    def snapshot(self) -> list[ExportRequest]:
        with self.lock:
            return list(self.requests)


class _OtlpHttpHandler(http.server.BaseHTTPRequestHandler):
    received: Received  # set on the per-server subclass

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        encoding = self.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        if self.path != "/v1/metrics" or self.headers.get("Content-Type") != "application/x-protobuf":
            self.send_error(404 if self.path != "/v1/metrics" else 415)
            self.received.paths.append(self.path)
            return
        request = ExportRequest()
        request.ParseFromString(body)
        self.received.add(request, self.path)
        reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet
        pass


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received

    def Export(self, request: ExportRequest, context: grpc.ServicerContext) -> Any:
        self.received.add(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


@dataclass
class Receiver:
    protocol: str
    endpoint: str  # what the agent is configured with
    received: Received

    @property
    def host_port(self) -> str:
        return self.endpoint.split("://", 1)[1]


@dataclass(frozen=True)
class ServerCert:
    """A key and a certificate for 127.0.0.1 that signs itself, so a client trusts it as its CA."""

    key_pem: bytes
    cert_pem: bytes

    @classmethod
    def create(cls) -> ServerCert:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False
            )
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cls(key_pem, cert.public_bytes(serialization.Encoding.PEM))


@pytest.fixture
def start_receiver(request: pytest.FixtureRequest) -> Callable[..., Receiver]:
    """Start an OTLP receiver for ``protocol`` on 127.0.0.1:<free port>; it stops after the test.
    With ``tls`` (gRPC only) it serves TLS with that certificate."""

    def start(protocol: str, tls: ServerCert | None = None) -> Receiver:
        received = Received()
        if protocol == "grpc":
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix=RECEIVER_THREAD))
            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(received), server)
            if tls is None:
                port = server.add_insecure_port("127.0.0.1:0")
            else:
                credentials = grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)])
                port = server.add_secure_port("127.0.0.1:0", credentials)
            server.start()
            request.addfinalizer(lambda: server.stop(grace=None).wait(5))
        else:
            handler = type("Handler", (_OtlpHttpHandler,), {"received": received})
            http_server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
            http_server.daemon_threads = True
            port = http_server.server_address[1]
            thread = threading.Thread(
                target=http_server.serve_forever, kwargs={"poll_interval": 0.05}, name=RECEIVER_THREAD, daemon=True
            )
            thread.start()

            def stop() -> None:
                http_server.shutdown()
                http_server.server_close()
                thread.join(5)

            request.addfinalizer(stop)
        return Receiver(protocol, f"{'https' if tls else 'http'}://127.0.0.1:{port}", received)

    return start


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OTel/otel_forge/launcher setting of the outer environment leaks into the agent."""
    apply_hermetic(monkeypatch)
    return monkeypatch


# --- helpers ------------------------------------------------------------------------------------


def _value(any_value: AnyValue) -> Any:
    return getattr(any_value, any_value.WhichOneof("value"))


def _attributes(key_values: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in key_values}


def _points(metric: metrics_pb2.Metric) -> Any:
    return getattr(metric, metric.WhichOneof("data")).data_points


def _metrics(requests: list[ExportRequest]) -> dict[str, list[metrics_pb2.Metric]]:
    """Every metric of scope ``otel_forge`` in ``requests``, by name (one entry per export)."""
    found: dict[str, list[metrics_pb2.Metric]] = {}
    for request in requests:
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                if scope_metrics.scope.name != "otel_forge":
                    continue
                for metric in scope_metrics.metrics:
                    found.setdefault(metric.name, []).append(metric)
    return found


def _expected_names(collectors: tuple[str, ...]) -> set[str]:
    return {spec.name for spec in METRICS if spec.source in collectors} - CONDITIONAL


def _wait_for_all(receiver: Receiver, names: set[str]) -> dict[str, list[metrics_pb2.Metric]]:
    def complete() -> dict[str, list[metrics_pb2.Metric]] | None:
        metrics = _metrics(receiver.received.snapshot())
        return metrics if names <= set(metrics) else None

    return wait_for(
        complete,
        DELIVERY_TIMEOUT_S,
        0.05,
        message=lambda: (
            f"{sorted(names - set(_metrics(receiver.received.snapshot())))} over OTLP {receiver.protocol} "
            f"({len(receiver.received.requests)} requests, paths {set(receiver.received.paths)})"
        ),
    )


def _run_agent(config: ForgeConfig, request: pytest.FixtureRequest) -> Agent:
    agent = Agent(config)
    request.addfinalizer(agent.shutdown)
    return agent.start()


def _agent_threads() -> set[threading.Thread]:
    """Live threads, less the receiver's own (its server loop, gRPC workers, HTTP request threads)."""
    return {
        t
        for t in threading.enumerate()
        if t.is_alive() and not t.name.startswith(RECEIVER_THREAD) and "process_request_thread" not in t.name
    }


# --- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_otlp_delivers_the_metric_table(
    protocol: str,
    start_receiver: Callable[[str], Receiver],
    clean_env: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    receiver = start_receiver(protocol)
    threads_before = _agent_threads()
    config = ForgeConfig.resolve(
        prometheus=False,
        otlp_endpoint=receiver.endpoint,
        otlp_protocol=protocol,
        sampling_interval_s=0.5,
        collectors=",".join(COLLECTORS),
    )
    agent = _run_agent(config, request)
    assert agent.endpoints == [f"otlp {protocol} {config.otlp_metrics_url}"]

    metrics = _wait_for_all(receiver, _expected_names(COLLECTORS))
    started = _agent_threads() - threads_before
    assert any(t.name == "OtelPeriodicExportingMetricReader" for t in started), started
    agent.shutdown()

    # Every metric we send is a row of the table, with its unit and kind.
    specs = {spec.name: spec for spec in METRICS if spec.source in COLLECTORS + ("self",)}
    assert set(metrics) <= set(specs), sorted(set(metrics) - set(specs))
    for name, exports in metrics.items():
        spec = specs[name]
        for metric in exports:
            assert metric.unit == spec.unit, (name, metric.unit, spec.unit)
            assert metric.description == spec.description, name
            kind = metric.WhichOneof("data")
            if spec.kind is Kind.GAUGE:
                assert kind == "gauge", (name, kind)
            else:
                assert kind == "sum", (name, kind)
                assert metric.sum.is_monotonic is (spec.kind is Kind.COUNTER), name
                assert (
                    metric.sum.aggregation_temporality
                    == metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE
                ), name
            for point in _points(metric):
                # Only the table's attributes, never an undeclared one.
                assert set(_attributes(point.attributes)) <= set(spec.attributes), (name, point.attributes)

    # The examples the issue names, spelled out.
    assert metrics["system.cpu.utilization"][0].unit == "1"
    assert metrics["system.network.io"][0].unit == "By"
    assert metrics["system.network.io"][0].sum.is_monotonic
    assert not metrics["system.memory.usage"][0].sum.is_monotonic

    def attribute_values(name: str, key: str) -> set[Any]:
        return {_attributes(p.attributes).get(key) for m in metrics[name] for p in _points(m)}

    assert {"user", "system", "idle"} <= attribute_values("system.cpu.utilization", "cpu.mode")
    assert {"used", "free"} <= attribute_values("system.memory.usage", "system.memory.state")
    assert attribute_values("system.network.io", "network.io.direction") == {"receive", "transmit"}
    cpu_values = [p.as_double for m in metrics["system.cpu.utilization"] for p in _points(m)]
    assert cpu_values and all(0.0 <= v <= 1.0 for v in cpu_values)
    used = [
        p.as_int or p.as_double
        for m in metrics["system.memory.usage"]
        for p in _points(m)
        if _attributes(p.attributes)["system.memory.state"] == "used"
    ]
    assert used and all(v > 0 for v in used)

    # The resource: who sent it.
    resource = _attributes(receiver.received.snapshot()[0].resource_metrics[0].resource.attributes)
    assert resource["service.name"] == "otel-forge"
    assert resource["host.name"] == socket.gethostname()
    machine_id = Path("/etc/machine-id")
    if machine_id.exists() and machine_id.read_text().strip():
        assert resource["host.id"] == machine_id.read_text().strip()
    assert resource["telemetry.sdk.language"] == "python"
    assert resource["telemetry.sdk.name"] == "opentelemetry"
    assert resource["telemetry.sdk.version"] == sdk_version
    assert NODE_ID_ATTRIBUTE not in resource

    # Shut down: no exporter thread (or any other the agent started) is left behind.
    wait_for(
        lambda: not (_agent_threads() - threads_before),
        5.0,
        0.05,
        message=lambda: f"agent threads to end: {_agent_threads() - threads_before}",
    )
    assert not agent.running


def test_otlp_endpoint_from_env_gets_v1_metrics(
    start_receiver: Callable[[str], Receiver], clean_env: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """``OTEL_EXPORTER_OTLP_ENDPOINT`` is a base URL: the HTTP exporter posts to ``<it>/v1/metrics``."""
    receiver = start_receiver("http/protobuf")
    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint + "/")
    config = ForgeConfig.resolve(prometheus=False, sampling_interval_s=0.5, collectors="cpu")
    assert config.otlp_metrics_url == receiver.endpoint + "/v1/metrics"
    _run_agent(config, request)

    _wait_for_all(receiver, {"system.cpu.utilization"})
    assert set(receiver.received.paths) == {"/v1/metrics"}


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_otlp_resource_from_env(
    protocol: str,
    start_receiver: Callable[[str], Receiver],
    clean_env: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    receiver = start_receiver(protocol)
    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    clean_env.setenv("OTEL_FORGE_NODE_ID", "node_3")
    config = ForgeConfig.resolve(
        prometheus=False,
        otlp_endpoint=receiver.endpoint,
        otlp_protocol=protocol,
        sampling_interval_s=0.5,
        collectors="memory",
    )
    _run_agent(config, request)

    _wait_for_all(receiver, {"system.memory.usage"})
    resource = _attributes(receiver.received.snapshot()[0].resource_metrics[0].resource.attributes)
    assert resource["deployment.environment"] == "test"
    assert resource[NODE_ID_ATTRIBUTE] == "node_3"
    assert resource["service.name"] == "otel-forge"
    assert resource["host.name"] == socket.gethostname()


# --- endpoint forms -------------------------------------------------------------------------------

# How a user names the HTTP endpoint: (monitor flags, variables), ``{base}`` being the receiver's
# http://127.0.0.1:<port>. Each must post to <base>/v1/metrics (the receiver answers 404 elsewhere).
HTTP_ENDPOINT_FORMS = {
    "flag-full-url": (["--otlp-endpoint", "{base}/v1/metrics"], {}),  # as users paste it
    "flag-base-url": (["--otlp-endpoint", "{base}/"], {}),
    "metrics-variable": ([], {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "{base}/v1/metrics"}),
    "generic-variable": ([], {"OTEL_EXPORTER_OTLP_ENDPOINT": "{base}"}),
}


def _spawn_monitor(args: list[str], env: dict[str, str], request: pytest.FixtureRequest) -> AgentProcess:
    """``otel-forge monitor`` (CLI, own process) sampling the CPU every 0.2 s, OTLP only."""
    agent = spawn_agent(["--no-prometheus", "--collectors", "cpu", "--interval", "0.2", *args], env)
    request.addfinalizer(agent.kill)
    return agent


def _wait_serving_otlp(agent: AgentProcess, line: str) -> None:
    wait_for(
        lambda: line in agent.stdout.splitlines(),
        DELIVERY_TIMEOUT_S,
        0.05,
        message=lambda: f"{line!r} from {agent.describe()}",
    )


@pytest.mark.parametrize("form", HTTP_ENDPOINT_FORMS)
def test_each_http_endpoint_form_posts_to_v1_metrics(
    form: str, start_receiver: Callable[..., Receiver], request: pytest.FixtureRequest
) -> None:
    receiver = start_receiver("http/protobuf")
    args, env = HTTP_ENDPOINT_FORMS[form]
    agent = _spawn_monitor(
        [arg.format(base=receiver.endpoint) for arg in args],
        {name: value.format(base=receiver.endpoint) for name, value in env.items()},
        request,
    )

    _wait_serving_otlp(agent, f"otel-forge: serving otlp http/protobuf {receiver.endpoint}/v1/metrics")
    _wait_for_all(receiver, {"system.cpu.utilization"})
    assert agent.stop() == 0, agent.describe()
    assert set(receiver.received.paths) == {"/v1/metrics"}  # never a 404 (a doubled /v1/metrics)
    assert "Traceback" not in agent.stderr


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_INSECURE", "OTEL_EXPORTER_OTLP_METRICS_INSECURE"])
def test_a_scheme_less_grpc_endpoint_delivers_in_plaintext_when_insecure_is_set(
    variable: str, start_receiver: Callable[..., Receiver], request: pytest.FixtureRequest
) -> None:
    """``host:port`` is the OTel gRPC exporter's form; plaintext is asked for as the exporter reads it."""
    receiver = start_receiver("grpc")
    agent = _spawn_monitor(
        ["--otlp-protocol", "grpc", "--otlp-endpoint", receiver.host_port], {variable: "true"}, request
    )

    _wait_serving_otlp(agent, f"otel-forge: serving otlp grpc {receiver.host_port}")
    _wait_for_all(receiver, {"system.cpu.utilization"})
    assert agent.stop() == 0, agent.describe()
    assert "Traceback" not in agent.stderr


def test_a_scheme_less_grpc_endpoint_uses_tls_by_default(
    start_receiver: Callable[..., Receiver],
    clean_env: pytest.MonkeyPatch,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """Without a scheme nor an INSECURE variable the OTel exporter speaks TLS: only a TLS receiver
    (trusted through ``OTEL_EXPORTER_OTLP_CERTIFICATE``) can get the metrics."""
    cert = ServerCert.create()
    receiver = start_receiver("grpc", tls=cert)
    (tmp_path / "ca.pem").write_bytes(cert.cert_pem)
    clean_env.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(tmp_path / "ca.pem"))
    config = ForgeConfig.resolve(
        prometheus=False,
        otlp_endpoint=receiver.host_port,
        otlp_protocol="grpc",
        sampling_interval_s=0.2,
        collectors="cpu",
    )
    agent = _run_agent(config, request)

    assert agent.endpoints == [f"otlp grpc {receiver.host_port}"]
    _wait_for_all(receiver, {"system.cpu.utilization"})


def test_a_path_on_a_grpc_endpoint_is_dropped_with_a_warning(
    start_receiver: Callable[..., Receiver],
    clean_env: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    receiver = start_receiver("grpc")
    config = ForgeConfig.resolve(
        prometheus=False,
        otlp_endpoint=receiver.endpoint + "/v1/metrics",
        otlp_protocol="grpc",
        sampling_interval_s=0.2,
        collectors="cpu",
    )
    with caplog.at_level(logging.WARNING, logger="otel_forge.pipeline"):
        agent = _run_agent(config, request)

    assert agent.endpoints == [f"otlp grpc {receiver.endpoint}"]
    warning = (
        f"otlp_endpoint '{receiver.endpoint}/v1/metrics' (from argument): a gRPC endpoint has no path; "
        f"dialing {receiver.endpoint}"
    )
    assert [record.getMessage() for record in caplog.records if record.name == "otel_forge.pipeline.otlp"] == [warning]
    _wait_for_all(receiver, {"system.cpu.utilization"})
