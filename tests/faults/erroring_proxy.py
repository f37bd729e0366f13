"""An HTTP proxy in front of a real tracking server that can be told, at runtime, to fail.

``ErroringProxy(upstream_uri)`` listens on 127.0.0.1 (a free port; ``.uri``) on its own threads and
forwards every request to ``upstream_uri`` unchanged, or answers it itself, by ``mode``:

- ``"pass"``: forward to the upstream, relay its answer;
- ``"500"``: answer 500 with MLflow's JSON error body (``INTERNAL_ERROR``), as a broken server does;
- ``"429"``: answer 429 with a ``Retry-After`` header and a plain-text body, as a rate-limiting
  gateway does.

``answered`` counts the requests per mode, so a test can tell that each mode was actually hit.
"""

from __future__ import annotations

import collections
import http.client
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODES = ("pass", "500", "429")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
               "transfer-encoding", "upgrade", "content-length", "host"}


class ErroringProxy:
    def __init__(self, upstream_uri: str, retry_after_s: int = 1, upstream_timeout_s: float = 30.0) -> None:
        upstream = urllib.parse.urlsplit(upstream_uri)
        self.upstream_host = upstream.hostname or "127.0.0.1"
        self.upstream_port = upstream.port or 80
        self.retry_after_s = retry_after_s
        self.upstream_timeout_s = upstream_timeout_s
        self.answered: collections.Counter[str] = collections.Counter()
        self._mode = "pass"
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="erroring-proxy", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        with self._lock:
            return self._mode

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        with self._lock:
            self._mode = mode

    def start(self) -> ErroringProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> ErroringProxy:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _count(self, mode: str) -> None:
        with self._lock:
            self.answered[mode] += 1

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                mode = proxy.mode
                proxy._count(mode)
                if mode == "500":
                    payload = json.dumps({"error_code": "INTERNAL_ERROR", "message": "injected by ErroringProxy"})
                    self._answer(500, payload.encode(), {"Content-Type": "application/json"})
                elif mode == "429":
                    self._answer(429, b"Too Many Requests (injected by ErroringProxy)",
                                 {"Content-Type": "text/plain", "Retry-After": str(proxy.retry_after_s)})
                else:
                    self._forward(body)

            def _forward(self, body: bytes) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                connection = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port,
                                                        timeout=proxy.upstream_timeout_s)
                try:
                    connection.request(self.command, self.path, body=body or None, headers=headers)
                    response = connection.getresponse()
                    data = response.read()
                    relay = {k: v for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP}
                    self._answer(response.status, data, relay)
                except OSError as error:
                    self._answer(502, f"upstream unreachable: {error}".encode(), {"Content-Type": "text/plain"})
                finally:
                    connection.close()

            def _answer(self, status: int, data: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

        return Handler
