"""An HTTP proxy in front of a real tracking server that forwards, counts, records, and fails on demand.

``MlflowProxy(upstream_uri)`` listens on 127.0.0.1 (a free port; ``.uri``) on its own threads from
the moment it is built, and forwards every request to ``upstream_uri`` (the real ``mlflow server``),
or answers it itself, by its ``mode`` (switch it at any time with ``set_mode``, a ``Mode`` or its
value):

- ``Mode.PASS`` / ``"pass"``: forward, relay the answer (the default);
- ``Mode.ERROR_500`` / ``"500"``: answer 500 with MLflow's JSON error body (``INTERNAL_ERROR``);
- ``Mode.ERROR_429`` / ``"429"``: answer 429 with a ``Retry-After`` header and MLflow's JSON error
  body (``RESOURCE_EXHAUSTED``), or, built with ``plain_429=True``, a plain-text body, as a
  rate-limiting gateway does;
- ``Mode.ERROR_503`` / ``"503"``: answer 503 with a ``Retry-After`` header and a plain-text body, as a
  server in maintenance or a load balancer with no backend does;
- ``Mode.DELAY`` / ``"delay"``: sleep ``delay_s`` seconds, then forward (a slow server);
- ``Mode.OVERLOAD_400`` / ``"overload"``: answer 400 with the body an overloaded ``mlflow server``
  gives when its store's connection pool is exhausted (SQLAlchemy's ``QueuePool limit ... reached``).

Built with ``ssl_context`` (a server-side ``ssl.SSLContext``), it answers HTTPS (``.uri`` is
``https://``) and forwards plain HTTP: a TLS-terminating proxy (``testkit/tls_proxy.py``).

Whatever the mode, a request whose path is in ``fail_paths`` is answered 500 and not forwarded, and
a ``log_batch`` holding a metric key in ``refuse_metric_keys`` is answered 400
``INVALID_PARAMETER_VALUE``, as MLflow refuses a batch with one value it will not store.

What it saw: ``requests(path)`` (method, path, JSON body) of every request as it arrived, ``arrivals(path)``
(arrival time, JSON body), ``total()``
of them; ``counts()`` / ``count(path)`` of the answered ones by path, ``log()`` (time answered,
method, path, status); ``answered``: requests by how they were answered (``"pass"``, ``"500"``,
``"429"``, ``"delay"``). No part of MLflow is mocked: what is forwarded is answered by the real server.
"""

from __future__ import annotations

import collections
import enum
import http.client
import http.server
import json
import ssl
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
GET_RUN = "/api/2.0/mlflow/runs/get"
GET_HISTORY = "/api/2.0/mlflow/metrics/get-history"

# Hop-by-hop headers are the proxy's own business, not forwarded; nor are the length and host of the
# client's request (http.client sets those of the upstream request).
_HOP_BY_HOP = {
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "trailers",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "host",
}


class Mode(enum.Enum):
    PASS = "pass"
    ERROR_500 = "500"
    ERROR_429 = "429"
    ERROR_503 = "503"
    DELAY = "delay"
    OVERLOAD_400 = "overload"


# What `mlflow server` answers when its SQLAlchemy pool has no free connection within its timeout.
QUEUE_POOL_BODY = {
    "error_code": "BAD_REQUEST",
    "message": "(sqlalchemy.exc.TimeoutError) QueuePool limit of size 5 overflow 10 reached, "
    "connection timed out, timeout 30.00 (Background on this error at: "
    "https://sqlalche.me/e/20/3o7r)",
}


@dataclass
class _Request:
    method: str
    path: str
    body: Any  # the parsed JSON body, or None
    how: str | None = None  # the mode it was answered by, once decided
    status: int | None = None  # once answered
    answered_at: float | None = None  # time.time() when answered
    arrived_at: float = field(default_factory=time.time)


class _Server(http.server.ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that refused our certificate or hung up is expected here, not an error."""
        if isinstance(sys.exc_info()[1], (ssl.SSLError, ConnectionError)):
            return
        super().handle_error(request, client_address)


class MlflowProxy:
    """A threaded HTTP proxy that counts and records requests and fails on demand; a context manager."""

    def __init__(
        self,
        upstream_uri: str,
        mode: Mode | str = Mode.PASS,
        delay_s: float = 0.0,
        retry_after_s: int = 1,
        plain_429: bool = False,
        upstream_timeout_s: float = 120.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        upstream = urllib.parse.urlsplit(upstream_uri)
        self._upstream = (upstream.hostname or "127.0.0.1", upstream.port or 80)
        self.mode = Mode(mode)
        self.delay_s = delay_s
        self.retry_after_s = retry_after_s
        self.plain_429 = plain_429
        self.upstream_timeout_s = upstream_timeout_s
        self.fail_paths: set[str] = set()
        self.refuse_metric_keys: set[str] = set()
        self._lock = threading.Lock()
        self._requests: list[_Request] = []
        self._server = _Server(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self.scheme = "http"
        if ssl_context is not None:
            # The handshake happens on the request's own thread, at its first read: a client that
            # refuses the certificate (or never speaks) holds no one else's connection.
            self._server.socket = ssl_context.wrap_socket(
                self._server.socket, server_side=True, do_handshake_on_connect=False
            )
            self.scheme = "https"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, name="test-mlflow-proxy", daemon=True
        )
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def uri(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def set_mode(self, mode: Mode | str, delay_s: float | None = None) -> None:
        if delay_s is not None:
            self.delay_s = delay_s
        self.mode = Mode(mode)

    # --- what it saw -----------------------------------------------------------------------

    def requests(self, path: str | None = None) -> list[tuple[str, str, Any]]:
        """(method, path, parsed JSON body or None) of every request received, on ``path`` if given."""
        with self._lock:
            return [(r.method, r.path, r.body) for r in self._requests if path is None or r.path == path]

    def accepted(self, path: str) -> list[Any]:
        """The parsed JSON bodies of the requests on ``path`` the server answered 2xx, as answered."""
        with self._lock:
            done = [r for r in self._requests if r.path == path and r.status is not None and 200 <= r.status < 300]
        return [r.body for r in sorted(done, key=lambda r: r.answered_at or 0.0)]

    def arrivals(self, path: str) -> list[tuple[float, Any]]:
        """(time.time() at arrival, parsed JSON body) of every request on ``path``, as they arrived."""
        with self._lock:
            return [(r.arrived_at, r.body) for r in self._requests if r.path == path]

    def total(self) -> int:
        """Requests received so far (answered or not)."""
        with self._lock:
            return len(self._requests)

    def counts(self) -> dict[str, int]:
        """Requests answered so far, by path (query string excluded)."""
        with self._lock:
            return dict(collections.Counter(r.path for r in self._requests if r.status is not None))

    def count(self, path: str) -> int:
        return self.counts().get(path, 0)

    def log(self) -> list[tuple[float, str, str, int]]:
        """(time answered, method, path, status) of every answered request, in the order answered."""
        with self._lock:
            answered = [r for r in self._requests if r.status is not None]
        answered.sort(key=lambda r: r.answered_at)
        return [(r.answered_at, r.method, r.path, r.status) for r in answered]

    @property
    def answered(self) -> collections.Counter[str]:
        """Requests by the mode they met: ``"pass"``, ``"500"``, ``"429"``, ``"delay"``."""
        with self._lock:
            return collections.Counter(r.how for r in self._requests if r.how is not None)

    def reset(self) -> None:
        with self._lock:
            self._requests.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MlflowProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the handler -----------------------------------------------------------------------

    def _arrived(self, method: str, path: str, body: bytes) -> _Request:
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        request = _Request(method, path, parsed)
        with self._lock:
            self._requests.append(request)
        return request

    def _refused(self, path: str, body: Any) -> bool:
        if path != LOG_BATCH or not self.refuse_metric_keys or not isinstance(body, dict):
            return False
        return any(metric.get("key") in self.refuse_metric_keys for metric in body.get("metrics", ()))

    def _decided(self, request: _Request, how: str) -> None:
        with self._lock:
            request.how = how

    def _answered(self, request: _Request, status: int) -> None:
        with self._lock:
            request.status, request.answered_at = status, time.time()

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as MLflow's requests session expects

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = urllib.parse.urlsplit(self.path).path
                request = proxy._arrived(self.command, path, body)
                mode, delay_s = proxy.mode, proxy.delay_s
                if proxy._refused(path, request.body):
                    proxy._decided(request, "400")
                    status, headers, answer = (
                        400,
                        {"Content-Type": "application/json"},
                        json.dumps(
                            {"error_code": "INVALID_PARAMETER_VALUE", "message": "proxy refuses the batch"}
                        ).encode(),
                    )
                elif mode is Mode.ERROR_500 or path in proxy.fail_paths:
                    proxy._decided(request, Mode.ERROR_500.value)
                    status, headers, answer = (
                        500,
                        {"Content-Type": "application/json"},
                        json.dumps({"error_code": "INTERNAL_ERROR", "message": "proxy answers 500"}).encode(),
                    )
                elif mode is Mode.OVERLOAD_400:
                    proxy._decided(request, mode.value)
                    status, headers = 400, {"Content-Type": "application/json"}
                    answer = json.dumps(QUEUE_POOL_BODY).encode()
                elif mode is Mode.ERROR_429:
                    proxy._decided(request, mode.value)
                    status, headers = 429, {"Retry-After": str(proxy.retry_after_s)}
                    if proxy.plain_429:
                        headers["Content-Type"], answer = "text/plain", b"Too Many Requests (proxy answers 429)"
                    else:
                        headers["Content-Type"] = "application/json"
                        answer = json.dumps(
                            {"error_code": "RESOURCE_EXHAUSTED", "message": "proxy answers 429"}
                        ).encode()
                elif mode is Mode.ERROR_503:
                    proxy._decided(request, mode.value)
                    status, answer = 503, b"Service Unavailable (proxy answers 503)"
                    headers = {"Retry-After": str(proxy.retry_after_s), "Content-Type": "text/plain"}
                else:
                    proxy._decided(request, mode.value)
                    if mode is Mode.DELAY:
                        time.sleep(delay_s)
                    try:
                        status, headers, answer = self._forward(body)
                    except OSError as error:
                        status, headers = 502, {"Content-Type": "text/plain"}
                        answer = f"proxy: upstream failed: {error}".encode()
                proxy._answered(request, status)
                self._answer(status, headers, answer)

            def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
                connection = http.client.HTTPConnection(*proxy._upstream, timeout=proxy.upstream_timeout_s)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    connection.request(self.command, self.path, body=body or None, headers=headers)
                    response = connection.getresponse()
                    answer = response.read()
                    kept = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
                    return response.status, kept, answer
                finally:
                    connection.close()

            def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                try:
                    self.send_response(status)
                    for key, value in headers.items():
                        self.send_header(key, value)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(body)
                except (TimeoutError, BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (its own deadline): nothing to answer

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

        return Handler
