"""The Prometheus ``/metrics`` endpoint: an HTTP server answering every scrape from a
``PrometheusRendering`` (the last collect's bodies), over kept-alive connections as Prometheus scrapes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otel_forge.pipeline.prometheus_rendering import PrometheusRendering

# An idle kept-alive connection is closed after this (Go's HTTP client, Prometheus's, idles 90 s).
_IDLE_TIMEOUT_S = 120.0


class _MetricsHandler(BaseHTTPRequestHandler):
    """Answers GET (any path, as prometheus_client's handler does) from the server's rendering."""

    server: _MetricsServer
    # Keep-alive, as Prometheus scrapes: one connection and one handler thread per scraper, not per scrape.
    protocol_version = "HTTP/1.1"
    timeout = _IDLE_TIMEOUT_S

    def do_GET(self) -> None:
        body, headers = self.server.rendering.body(self.headers.get("Accept"), self.headers.get("Accept-Encoding"))
        head = [
            f"{self.protocol_version} 200 OK",
            f"Date: {self.date_time_string()}",
            *(f"{name}: {value}" for name, value in headers),
            f"Content-Length: {len(body)}",
        ]
        # Status, headers and body in one write: one send a scrape (http.server's send_header and
        # end_headers make two, and format a log line we drop).
        self.wfile.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        pass


class _MetricsServer(ThreadingHTTPServer):
    """Tracks its open connections: a kept-alive one would hold its handler thread past ``close``."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], rendering: PrometheusRendering, family: int) -> None:
        self.address_family = family
        self.rendering = rendering
        self._connections: set[socket.socket] = set()
        self._closed = threading.Condition()
        super().__init__(address, _MetricsHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._closed:
            self._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:  # at the end of the connection's handler thread
        super().shutdown_request(request)
        with self._closed:
            self._connections.discard(request)
            self._closed.notify_all()

    def close_connections(self, timeout_s: float) -> None:
        """End every open connection and wait (at most ``timeout_s``) for their handler threads."""
        with self._closed:
            for connection in self._connections:
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
            self._closed.wait_for(lambda: not self._connections, timeout_s)


@dataclass
class PrometheusEndpoint:
    """The HTTP server of ``/metrics``, on a thread of its own."""

    server: _MetricsServer
    thread: threading.Thread
    url: str

    @classmethod
    def serve(cls, rendering: PrometheusRendering, host: str, port: int) -> PrometheusEndpoint:
        """Bind ``host:port`` (0: a free port) and serve; raises OSError when it cannot bind."""
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        server = _MetricsServer((host, port), rendering, family)
        thread = threading.Thread(target=server.serve_forever, name="otel-forge-prometheus", daemon=True)
        thread.start()
        bound_host, bound_port = str(server.server_address[0]), server.server_address[1]
        url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}/metrics"
        return cls(server, thread, url)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.server.close_connections(timeout_s=5)
        self.thread.join(timeout=5)
