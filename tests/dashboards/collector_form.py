"""The agents' readings as an OpenTelemetry Collector's Prometheus exporter would expose them.

No Collector can be installed here, so this small HTTP server stands in for one that receives the
agents' OTLP and serves it on its own ``/metrics`` (``prometheusexporter`` with
``resource_to_telemetry_conversion: enabled`` and its default metric suffixes). On each GET it
scrapes the real agents and rewrites what the Collector writes differently:

- unit-1 gauges end in ``_ratio`` (``hw_gpu_utilization`` -> ``hw_gpu_utilization_ratio``);
  unit-1 up-down counters (``hw_status``) do not: the Collector adds ``_ratio`` to gauges only;
- ``job`` is ``service.name`` and ``instance`` is ``service.instance.id``;
- every resource attribute is also a label on every series (``host_name``, ``service_name``,
  ``otel_forge_node_id``, ...), and ``target_info`` carries them beside job and instance.

Prometheus must scrape it with ``honor_labels: true`` (as it must scrape a real Collector), or
job and instance become ``exported_job`` / ``exported_instance``.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.parser import text_string_to_metric_families


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in sorted(labels.items())) + "}"


class CollectorForm:
    """Rewrites agents' expositions into the Collector's naming; ``serve()`` starts the HTTP server."""

    def __init__(self, agent_urls: Sequence[str], ratio_gauges: set[str]) -> None:
        self.agent_urls = list(agent_urls)
        self.ratio_gauges = ratio_gauges  # Prometheus names of unit-1 gauges
        self._server: ThreadingHTTPServer | None = None

    def exposition(self) -> str:
        families: dict[str, tuple[str, str, list[str]]] = {}  # name -> (type, help, sample lines)
        for url in self.agent_urls:
            with urllib.request.urlopen(url, timeout=5) as response:
                self._translate(response.read().decode(), families)
        lines = []
        for name, (kind, help_text, samples) in families.items():
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]
        return "\n".join(lines) + "\n"

    def _translate(self, text: str, families: dict[str, tuple[str, str, list[str]]]) -> None:
        parsed = list(text_string_to_metric_families(text))
        resource = next(family.samples[0].labels for family in parsed if family.name == "target_info")
        job, instance = resource["service_name"], resource["service_instance_id"]
        for family in parsed:
            for sample in family.samples:
                if family.name == "target_info":
                    name = "target_info"
                    labels = {
                        k: v for k, v in sample.labels.items() if k not in ("service_name", "service_instance_id")
                    }
                else:
                    name = sample.name
                    if family.type == "gauge" and name in self.ratio_gauges:
                        name += "_ratio"
                    labels = {**resource, **sample.labels}
                labels.update(job=job, instance=instance)
                kind = family.type if family.type in ("counter", "gauge") else "untyped"
                entry = families.setdefault(name, (kind, family.documentation or name, []))
                entry[2].append(f"{name}{_labels(labels)} {sample.value!r}")

    def serve(self) -> str:
        """Serve on 127.0.0.1:<free port>; return ``host:port``."""
        render: Callable[[], str] = self.exposition

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    body, status = render().encode(), 200
                except Exception as error:  # noqa: BLE001 - shown to Prometheus as a failed scrape
                    body, status = repr(error).encode(), 500
                self.send_response(status)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="collector-form", daemon=True).start()
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
