"""Helpers for the TrainingRun tests against a real ``mlflow server``.

``RecordingProxy`` forwards every request to the real server and records (path, JSON body);
``fail_paths`` makes it answer 500 for those paths instead (MLflow's JSON error body). Nothing of
MLflow is mocked: whatever is forwarded is answered by the real server.
"""

from __future__ import annotations

import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te", "trailer"}


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def wait_for(predicate: Callable[[], Any], timeout_s: float = 30.0, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(interval_s)


def run_script(code: str, env: dict[str, str] | None = None, timeout_s: float = 60.0,
               cwd: Path | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=timeout_s,
                          env=environment, cwd=cwd or REPO_ROOT)


def popen_script(code: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.Popen:
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), environment.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=environment, cwd=cwd or REPO_ROOT)


class RecordingProxy:
    """A threaded pass-through HTTP proxy that records every request; a context manager."""

    def __init__(self, upstream_uri: str) -> None:
        upstream = urllib.parse.urlsplit(upstream_uri)
        self._upstream = (upstream.hostname, upstream.port)
        self.fail_paths: set[str] = set()
        self._lock = threading.Lock()
        self._requests: list[tuple[str, str, Any]] = []  # (method, path, parsed JSON body or None)
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="test-recording-proxy", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, path: str | None = None) -> list[tuple[str, str, Any]]:
        with self._lock:
            return [r for r in self._requests if path is None or r[1] == path]

    def total(self) -> int:
        with self._lock:
            return len(self._requests)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> RecordingProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _handler_class(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = urllib.parse.urlsplit(self.path).path
                try:
                    parsed = json.loads(body) if body else None
                except ValueError:
                    parsed = None
                with proxy._lock:
                    proxy._requests.append((self.command, path, parsed))
                if path in proxy.fail_paths:
                    self._answer(500, {"Content-Type": "application/json"},
                                 json.dumps({"error_code": "INTERNAL_ERROR", "message": "proxy answers 500"}).encode())
                    return
                connection = http.client.HTTPConnection(*proxy._upstream, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                    connection.request(self.command, self.path, body=body or None, headers=headers)
                    response = connection.getresponse()
                    answer = response.read()
                    kept = {k: v for k, v in response.getheaders()
                            if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"}
                    status = response.status
                except OSError as error:
                    status, kept, answer = 502, {"Content-Type": "text/plain"}, f"proxy: {error}".encode()
                finally:
                    connection.close()
                self._answer(status, kept, answer)

            def _answer(self, status: int, headers: dict[str, str], body: bytes) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PATCH = do_DELETE = do_PUT = _handle

        return Handler
