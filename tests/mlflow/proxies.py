"""A counting, fault-injecting HTTP proxy in front of a real tracking server.

``CountingProxy(upstream_uri)`` listens on 127.0.0.1 (a free port) and forwards every request to
the real ``mlflow server``, counting requests by path. Its ``mode`` can be switched at any time:

- ``PASS``: forward (the default);
- ``ERROR_500`` / ``ERROR_429``: answer that status (MLflow's JSON error body), do not forward;
- ``DELAY``: sleep ``delay_s`` seconds, then forward (a slow server).

No part of MLflow is mocked: what is forwarded is answered by the real server.
"""

from __future__ import annotations

import collections
import enum
import http.client
import http.server
import json
import socket
import threading
import time
import urllib.parse

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
GET_RUN = "/api/2.0/mlflow/runs/get"

# Hop-by-hop headers are the proxy's own business, not forwarded.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


class Mode(enum.Enum):
    PASS = "pass"
    ERROR_500 = "500"
    ERROR_429 = "429"
    DELAY = "delay"


class CountingProxy:
    """A threaded HTTP proxy that counts requests by path; a context manager."""

    def __init__(self, upstream_uri: str, mode: Mode = Mode.PASS, delay_s: float = 0.0) -> None:
        upstream = urllib.parse.urlsplit(upstream_uri)
        self._upstream = (upstream.hostname, upstream.port)
        self.mode = mode
        self.delay_s = delay_s
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self._log: list[tuple[float, str, str, int]] = []  # (time, method, path, status answered)
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="test-counting-proxy", daemon=True)
        self._thread.start()

    @property
    def uri(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def set_mode(self, mode: Mode, delay_s: float | None = None) -> None:
        if delay_s is not None:
            self.delay_s = delay_s
        self.mode = mode

    def counts(self) -> dict[str, int]:
        """Requests received so far, by path (query string excluded)."""
        with self._lock:
            return dict(self._counts)

    def count(self, path: str) -> int:
        with self._lock:
            return self._counts[path]

    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())

    def log(self) -> list[tuple[float, str, str, int]]:
        with self._lock:
            return list(self._log)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._log.clear()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> CountingProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- the handler -----------------------------------------------------------------------

    def _record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self._counts[path] += 1
            self._log.append((time.time(), method, path, status))

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
                mode, delay_s = proxy.mode, proxy.delay_s
                if mode in (Mode.ERROR_500, Mode.ERROR_429):
                    status = 500 if mode is Mode.ERROR_500 else 429
                    code = "INTERNAL_ERROR" if status == 500 else "RESOURCE_EXHAUSTED"
                    proxy._record(self.command, path, status)
                    self._answer(status, {"Content-Type": "application/json"},
                                 json.dumps({"error_code": code, "message": f"proxy answers {status}"}).encode())
                    return
                if mode is Mode.DELAY:
                    time.sleep(delay_s)
                try:
                    status, headers, answer = self._forward(body)
                except OSError as error:
                    proxy._record(self.command, path, 502)
                    self._answer(502, {"Content-Type": "text/plain"}, f"proxy: upstream failed: {error}".encode())
                    return
                proxy._record(self.command, path, status)
                self._answer(status, headers, answer)

            def _forward(self, body: bytes) -> tuple[int, dict[str, str], bytes]:
                connection = http.client.HTTPConnection(*proxy._upstream, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    connection.request(self.command, self.path, body=body or None, headers=headers)
                    response = connection.getresponse()
                    answer = response.read()
                    kept = {k: v for k, v in response.getheaders()
                            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"}
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
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError, socket.timeout):
                    pass  # the client gave up (its own deadline): nothing to answer

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _handle

        return Handler
