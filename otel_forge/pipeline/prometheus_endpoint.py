"""The Prometheus ``/metrics`` endpoint, served from the last collect.

``PrometheusRendering`` is a sink of the agent's one collect: it keeps the latest ``MetricsData``. The
first scrape after a collect translates it to Prometheus families with opentelemetry-exporter-
prometheus's own translation and encodes it with prometheus_client (text or OpenMetrics, as the
scraper's ``Accept`` negotiates; gzip when accepted); later scrapes of that collect get the same
bytes. Any number of scrapers cost at most one translation and one encoding per format per
interval, no SDK collect (none at all when nobody scrapes). A scrape before the first collect
triggers that collect, once.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import opentelemetry.exporter.prometheus as otel_prometheus
from opentelemetry.exporter.prometheus import _CustomCollector
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics

from otel_forge.pipeline.fanout import NonBlockingExporter


@dataclass
class _Rendered:
    """One collect: its data, translated to Prometheus families at the first scrape that needs them,
    and the bodies encoded from them so far, by (content type, gzip)."""

    data: MetricsData | None
    families: list[Any] | None = None
    bodies: dict[tuple[str, bool], bytes] = field(default_factory=dict)

    def collect(self) -> Iterable[Any]:  # what prometheus_client's encoders read
        return self.families or []


# An idle kept-alive connection is closed after this (Go's HTTP client, Prometheus's, idles 90 s).
_IDLE_TIMEOUT_S = 120.0

# Level 1: a tenth of the default level's CPU for a metrics page, most of its compression.
_GZIP_LEVEL = 1


# The translation's name mappings: pure functions (a string in, its Prometheus form out) that run
# regexes over every label key of every data point, and every metric name and unit, each collect.
_NAME_MAPPINGS = ("sanitize_attribute", "sanitize_full_name", "map_unit")


def _memoize_name_mapping() -> None:
    """Memoize the translation's name mappings, once per process: the same few dozen names come
    every collect, and re-mapping them was half the translation's CPU. Same function, same output."""
    for name in _NAME_MAPPINGS:
        mapping = getattr(otel_prometheus, name)
        if not hasattr(mapping, "cache_info"):
            setattr(otel_prometheus, name, functools.lru_cache(maxsize=4096)(mapping))


def _cheapest(encoder: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """``encoder`` (prometheus_client's, as negotiated), or one giving the same bytes for less CPU.

    OpenMetrics asked for without an ``escaping`` (Prometheus 2's ``Accept``) means "underscores",
    which prometheus_client applies to every sample name a character at a time (a third of the
    encoding's CPU). The OTel translation already gives legacy names (runs of other characters made
    one ``_``: no ``:``, no leading ``__``), which that escaping leaves as they are, and so does
    allow-utf-8's plain pass over them: the same bytes, cheaper.
    """
    if isinstance(encoder, partial) and encoder.keywords.get("escaping") == openmetrics.UNDERSCORES:
        return partial(encoder, escaping=openmetrics.ALLOWUTF8)
    return encoder


class PrometheusRendering(NonBlockingExporter):
    """The latest collect, and the bodies a scrape is answered with, made once per collect."""

    def __init__(self) -> None:
        super().__init__()
        # The OTel -> Prometheus translation of opentelemetry-exporter-prometheus (names, units,
        # target_info, otel_scope_* labels), fed one collect at a time.
        _memoize_name_mapping()
        self._translation = _CustomCollector()
        self._latest: _Rendered | None = None
        self._lock = threading.Lock()
        self._first_collect = threading.Lock()  # two scrapes before any collect trigger one
        self.collect_now: Callable[[], None] | None = None  # the agent's reader: a scrape before any collect
        self.renderings = 0  # collects translated (at most one per collect; none when nobody scrapes)
        self.encodings = 0  # bodies encoded (once per collect, format and compression asked for)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        with self._lock:
            self._latest = _Rendered(metrics_data)
        return MetricExportResult.SUCCESS

    def body(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, list[tuple[str, str]]]:
        """The body and headers answering a scrape with these ``Accept`` headers."""
        rendered = self._latest or self._first()
        encoder, content_type = choose_encoder(accept or "")
        compressed = gzip_accepted(accept_encoding or "")
        key = (content_type, compressed)
        with self._lock:  # scrapes at once: one renders, the others wait for its bytes
            body = rendered.bodies.get(key)
            if body is None:
                self._translate(rendered)
                body = _cheapest(encoder)(rendered)
                rendered.bodies[key] = body = gzip.compress(body, _GZIP_LEVEL) if compressed else body
                self.encodings += 1
        headers = [("Content-Type", content_type)] + ([("Content-Encoding", "gzip")] if compressed else [])
        return body, headers

    def _translate(self, rendered: _Rendered) -> None:
        if rendered.families is None and rendered.data is not None:
            self._translation.add_metrics_data(rendered.data)
            rendered.families, rendered.data = list(self._translation.collect()), None
            self.renderings += 1

    def _first(self) -> _Rendered:
        with self._first_collect:
            if self._latest is None and self.collect_now is not None:
                self.collect_now()  # exports inline, to us: sets _latest
            return self._latest or _Rendered(None)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        pass


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
