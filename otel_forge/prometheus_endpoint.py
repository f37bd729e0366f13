"""The Prometheus ``/metrics`` endpoint, served from the last collect.

``PrometheusRendering`` is a sink of the agent's one collect: it translates each ``MetricsData`` to
Prometheus families with opentelemetry-exporter-prometheus's own translation, once. A scrape is
answered with bytes encoded by prometheus_client (text or OpenMetrics, as the scraper's ``Accept``
negotiates; gzip when accepted), made once per collect and format and then served as they are: any
number of scrapers cost one encoding per interval, no SDK collect. A scrape before the first collect
triggers that collect, once.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import make_server

from opentelemetry.exporter.prometheus import _CustomCollector
from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler, choose_encoder, gzip_accepted

from otel_forge.fanout import NonBlockingExporter


@dataclass
class _Rendered:
    """One collect's families and the bodies encoded from them so far, by (content type, gzip)."""

    families: list[Any]
    bodies: dict[tuple[str, bool], bytes] = field(default_factory=dict)

    def collect(self) -> Iterable[Any]:  # what prometheus_client's encoders read
        return self.families


class PrometheusRendering(NonBlockingExporter):
    """The latest collect, as Prometheus families, and the bodies a scrape is answered with."""

    def __init__(self) -> None:
        super().__init__()
        # The OTel -> Prometheus translation of opentelemetry-exporter-prometheus (names, units,
        # target_info, otel_scope_* labels), fed one collect at a time.
        self._translation = _CustomCollector()
        self._latest: _Rendered | None = None
        self._lock = threading.Lock()
        self._first_collect = threading.Lock()  # two scrapes before any collect trigger one
        self.collect_now: Callable[[], None] | None = None  # the agent's reader: a scrape before any collect
        self.renderings = 0  # collects translated
        self.encodings = 0  # bodies encoded (once per collect, format and compression asked for)

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        self._translation.add_metrics_data(metrics_data)
        rendered = _Rendered(list(self._translation.collect()))
        with self._lock:
            self._latest = rendered
            self.renderings += 1
        return MetricExportResult.SUCCESS

    def body(self, accept: str | None, accept_encoding: str | None) -> tuple[bytes, list[tuple[str, str]]]:
        """The body and headers answering a scrape with these ``Accept`` headers."""
        rendered = self._latest or self._first()
        encoder, content_type = choose_encoder(accept or "")
        compressed = gzip_accepted(accept_encoding or "")
        key = (content_type, compressed)
        with self._lock:  # scrapes at once: one encodes, the others wait for its bytes
            body = rendered.bodies.get(key)
            if body is None:
                body = encoder(rendered)  # type: ignore[arg-type]
                rendered.bodies[key] = body = gzip.compress(body) if compressed else body
                self.encodings += 1
        headers = [("Content-Type", content_type)] + ([("Content-Encoding", "gzip")] if compressed else [])
        return body, headers

    def _first(self) -> _Rendered:
        with self._first_collect:
            if self._latest is None and self.collect_now is not None:
                self.collect_now()  # exports inline, to us: sets _latest
            return self._latest or _Rendered([])

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        pass


def _metrics_app(rendering: PrometheusRendering) -> Callable[..., list[bytes]]:
    """A WSGI app answering GET (any path, as prometheus_client's does) from ``rendering``."""

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b""]
        body, headers = rendering.body(environ.get("HTTP_ACCEPT"), environ.get("HTTP_ACCEPT_ENCODING"))
        start_response("200 OK", [*headers, ("Content-Length", str(len(body)))])
        return [body]

    return app


@dataclass
class PrometheusEndpoint:
    """The HTTP server of ``/metrics``, on a thread of its own."""

    server: Any
    thread: threading.Thread
    url: str

    @classmethod
    def serve(cls, rendering: PrometheusRendering, host: str, port: int) -> PrometheusEndpoint:
        """Bind ``host:port`` (0: a free port) and serve; raises OSError when it cannot bind."""
        import socket

        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

        class Server(ThreadingWSGIServer):
            address_family = family

        server = make_server(host, port, _metrics_app(rendering), Server, handler_class=_SilentHandler)
        thread = threading.Thread(target=server.serve_forever, name="otel-forge-prometheus", daemon=True)
        thread.start()
        bound_host, bound_port = str(server.server_address[0]), server.server_address[1]
        url = f"http://{'[' + bound_host + ']' if ':' in bound_host else bound_host}:{bound_port}/metrics"
        return cls(server, thread, url)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
