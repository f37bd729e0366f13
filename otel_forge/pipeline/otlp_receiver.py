"""``OtlpReceiver``: OTLP metrics received, over gRPC (grpcio's server) and HTTP (``/v1/metrics``,
protobuf or JSON), each request handed to ``deliver`` as an ``ExportMetricsServiceRequest``.

Off by default (``otlp_receiver``); bound to localhost unless told otherwise, on ports of its own
(4327 and 4328: the Collector's 4317 and 4318 are often taken by a Collector beside us). A port in
use costs that transport only, said in one line. What it answers, as the OTLP specification says:

- a request taken: 200 / OK, with ``partial_success`` counting the points refused (a run's series
  past its cap) and why;
- bytes that are no request: HTTP 400 / ``INVALID_ARGUMENT``, with a ``google.rpc.Status``;
- a request over ``otlp_receiver_max_request_bytes`` (after gzip): HTTP 413 / ``RESOURCE_EXHAUSTED``,
  read no further;
- a content type other than protobuf or JSON: HTTP 415; a path other than ``/v1/metrics``: 404;
- more requests at once than its workers: HTTP 503 with ``Retry-After`` / ``RESOURCE_EXHAUSTED``
  (both retryable for an OTLP exporter): threads and memory stay bounded, nothing queues.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import logging
import socket
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from google.rpc import status_pb2
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from otel_forge.config import ForgeConfig

_logger = logging.getLogger(__name__)

RUN_HEADER = "x-mlflow-run-id"
WORKERS = 4  # requests handled at once, per transport
IDLE_S = 5.0  # a kept-alive HTTP connection idle this long is closed: it holds a worker
PATH = "/v1/metrics"
_DRAIN_S, _DRAIN_BYTES = 0.2, 1 << 20  # what a connection refused busy may still send, read and dropped
# A request refused for its size, unread: its body is drained on its own thread, up to this much.
_UNREAD_DRAIN_S, _UNREAD_DRAIN_BYTES = 2.0, 64 << 20
_GRPC_SERVICE = "opentelemetry.proto.collector.metrics.v1.MetricsService"
_PROTOBUF, _JSON = "application/x-protobuf", "application/json"
_INVALID_ARGUMENT, _RESOURCE_EXHAUSTED = 3, 8  # google.rpc.Code


@dataclass(frozen=True)
class Received:
    """What became of a request: the points refused (0: all taken), and why."""

    refused: int = 0
    message: str = ""

    def response(self) -> ExportMetricsServiceResponse:
        if not self.refused:
            return ExportMetricsServiceResponse()
        partial = ExportMetricsPartialSuccess(rejected_data_points=self.refused, error_message=self.message)
        return ExportMetricsServiceResponse(partial_success=partial)


Deliver = Callable[[ExportMetricsServiceRequest, "str | None"], Received]


class RequestRefused(Exception):
    """A request answered with an error: its HTTP status, its gRPC code, and why."""

    def __init__(self, status: int, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def parse_request(body: bytes, content_type: str) -> ExportMetricsServiceRequest:
    """The request in ``body`` (protobuf, or OTLP's JSON), or ``RequestRefused``."""
    request = ExportMetricsServiceRequest()
    try:
        if content_type == _JSON:
            json_format.Parse(body, request, ignore_unknown_fields=True, max_recursion_depth=64)
        else:
            request.ParseFromString(body)
    except (DecodeError, json_format.ParseError, UnicodeDecodeError, RecursionError) as error:
        raise RequestRefused(400, grpc.StatusCode.INVALID_ARGUMENT, f"not an OTLP metrics request: {error}") from None
    return request


class OtlpReceiver:
    """The gRPC and HTTP receivers; ``start``, ``endpoints``, ``stop``."""

    def __init__(self, config: ForgeConfig, deliver: Deliver) -> None:
        self._config = config
        self._deliver = deliver
        self._grpc: grpc.Server | None = None
        self._http: _HttpServer | None = None
        self._grpc_port = 0
        self.endpoints: list[str] = []

    def start(self) -> OtlpReceiver:
        host = self._config.otlp_receiver_host
        try:
            self._grpc, port = self._start_grpc(host, self._config.otlp_receiver_grpc_port)
            self.endpoints.append(f"otlp grpc://{_address(host, port)}")
        except (RuntimeError, OSError) as error:
            _say_taken("gRPC", self._config.otlp_receiver_grpc_port, "GRPC", error)
        try:
            self._http = _HttpServer((host, self._config.otlp_receiver_http_port), self)
            threading.Thread(target=self._http.serve_forever, name="otel-forge-otlp-http", daemon=True).start()
            self.endpoints.append(f"otlp http://{_address(host, self._http.server_address[1])}{PATH}")
        except OSError as error:
            _say_taken("HTTP", self._config.otlp_receiver_http_port, "HTTP", error)
        return self

    @property
    def grpc_port(self) -> int | None:
        return self._grpc_port if self._grpc is not None else None

    @property
    def http_port(self) -> int | None:
        return self._http.server_address[1] if self._http is not None else None

    def _start_grpc(self, host: str, port: int) -> tuple[grpc.Server, int]:
        server = grpc.server(
            ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="otel-forge-otlp-grpc"),
            maximum_concurrent_rpcs=WORKERS,
            options=[("grpc.max_receive_message_length", self._config.otlp_receiver_max_request_bytes)],
        )
        handler = grpc.unary_unary_rpc_method_handler(
            self._export_grpc,
            request_deserializer=None,
            response_serializer=ExportMetricsServiceResponse.SerializeToString,
        )
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(_GRPC_SERVICE, {"Export": handler}),))
        bound = server.add_insecure_port(_address(host, port))
        if not bound:
            raise RuntimeError(f"could not bind {_address(host, port)}")
        server.start()
        self._grpc_port = bound
        return server, bound

    def _export_grpc(self, body: bytes, context: grpc.ServicerContext) -> ExportMetricsServiceResponse:
        run_id = dict(context.invocation_metadata()).get(RUN_HEADER)
        try:
            return self.handle(body, _PROTOBUF, run_id if isinstance(run_id, str) else None).response()
        except RequestRefused as refused:
            context.abort(refused.code, str(refused))
            raise  # abort raises; this line is for the type checker

    def handle(self, body: bytes, content_type: str, run_id: str | None) -> Received:
        """One request's body, parsed and delivered."""
        request = parse_request(body, content_type)
        return self._deliver(request, run_id or None)

    @property
    def max_bytes(self) -> int:
        return self._config.otlp_receiver_max_request_bytes

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait()
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _say_taken(transport: str, port: int, variable: str, error: BaseException) -> None:
    _logger.warning(
        "OTLP receiver: port %d could not be bound (%s: is a Collector there?); OTLP/%s is not received. "
        "Choose another with OTEL_FORGE_OTLP_RECEIVER_%s_PORT (--otlp-receiver-%s-port)",
        port, error, transport, variable, variable.lower(),
    )  # fmt: skip


class _HttpServer(http.server.HTTPServer):
    """At most ``WORKERS`` requests at once, each on a thread; past that, 503 at once."""

    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, address: tuple[str, int], receiver: OtlpReceiver) -> None:
        self.receiver = receiver
        self._slots = threading.BoundedSemaphore(WORKERS)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            _refuse_busy(request)
            self.shutdown_request(request)
            return
        threading.Thread(
            target=self._work, args=(request, client_address), name="otel-forge-otlp-http-request", daemon=True
        ).start()

    def _work(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            _logger.debug("OTLP/HTTP: a connection failed", exc_info=True)
        finally:
            self.shutdown_request(request)
            self._slots.release()


def _refuse_busy(sock: socket.socket) -> None:
    """503 at once, on the accepting thread: what the client still sends is drained only briefly."""
    with contextlib.suppress(OSError):
        sock.settimeout(_DRAIN_S)
        sock.sendall(_busy())
        _drain(sock, _DRAIN_BYTES, _DRAIN_S)


def _drain(sock: socket.socket, limit: int, timeout_s: float) -> None:
    """Ends the answer, then reads and drops what the client still sends (``limit`` bytes at most, each
    read within ``timeout_s``): closing with its bytes unread would reset the connection, and a client
    still sending would see a broken pipe instead of the answer."""
    with contextlib.suppress(OSError):
        sock.settimeout(timeout_s)
        sock.shutdown(socket.SHUT_WR)
        drained = 0
        while drained < limit and (chunk := sock.recv(65536)):
            drained += len(chunk)


def _busy() -> bytes:
    body = json.dumps({"code": _RESOURCE_EXHAUSTED, "message": "busy: retry later"}).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _HttpServer
    timeout = IDLE_S
    unread_bytes = 0  # a body refused unread (413): drained once the answer is sent

    def finish(self) -> None:
        super().finish()
        if self.unread_bytes:
            _drain(self.request, min(self.unread_bytes, _UNREAD_DRAIN_BYTES), _UNREAD_DRAIN_S)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        _logger.debug("OTLP/HTTP: " + format, *args)

    def do_POST(self) -> None:
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        try:
            if self.path.split("?")[0] != PATH:
                raise RequestRefused(404, grpc.StatusCode.NOT_FOUND, f"OTLP metrics are received at {PATH}")
            if content_type not in (_PROTOBUF, _JSON):
                raise RequestRefused(
                    415,
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"Content-Type must be {_PROTOBUF} or {_JSON}, not {content_type!r}",
                )
            body = self._body()
            received = self.server.receiver.handle(body, content_type, self.headers.get(RUN_HEADER))
        except RequestRefused as refused:
            self._status(refused.status, content_type, str(refused))
            return
        self._reply(200, content_type, received.response())

    def do_GET(self) -> None:
        self._status(405, _JSON, "OTLP metrics are POSTed")

    def _body(self) -> bytes:
        max_bytes = self.server.receiver.max_bytes
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise RequestRefused(411, grpc.StatusCode.INVALID_ARGUMENT, "a Content-Length is needed")
        if int(length) > max_bytes:
            self.close_connection = True  # its body is not read
            self.unread_bytes = int(length)
            raise RequestRefused(413, grpc.StatusCode.RESOURCE_EXHAUSTED, f"the request is over {max_bytes} bytes")
        body = self.rfile.read(int(length))
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        if encoding == "gzip":
            return _gunzip(body, max_bytes)
        if encoding != "identity":
            raise RequestRefused(415, grpc.StatusCode.INVALID_ARGUMENT, f"Content-Encoding {encoding!r}: gzip or none")
        return body

    def _status(self, status: int, content_type: str, message: str) -> None:
        code = _RESOURCE_EXHAUSTED if status in (413, 503) else _INVALID_ARGUMENT
        self._reply(status, content_type, status_pb2.Status(code=code, message=message))

    def _reply(self, status: int, content_type: str, message: Any) -> None:
        if content_type == _JSON or content_type not in (_PROTOBUF, _JSON):
            body, content_type = json_format.MessageToJson(message, indent=None).encode(), _JSON
        else:
            body = message.SerializeToString()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


def _gunzip(body: bytes, max_bytes: int) -> bytes:
    decompressor = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        data = decompressor.decompress(body, max_bytes + 1)
    except zlib.error as error:
        raise RequestRefused(400, grpc.StatusCode.INVALID_ARGUMENT, f"not gzip: {error}") from None
    if len(data) > max_bytes:
        raise RequestRefused(413, grpc.StatusCode.RESOURCE_EXHAUSTED, f"the request is over {max_bytes} bytes unzipped")
    return data
