"""The OTLP metric exporter the agent pushes to: gRPC or http/protobuf, as the settings say."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from otel_forge.config import OTLP_TIMEOUT_VARS, ForgeConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics.export import MetricExporter

_logger = logging.getLogger(__name__)


def _otlp_timeout_s(config: ForgeConfig) -> float | None:
    """The exporter retries within its timeout (10 s by default): an export that outlasts the
    interval only delays the next one and keeps shutdown waiting, and none may outlast the reader's
    export timeout. ``OTEL_EXPORTER_OTLP_*TIMEOUT`` still wins (None lets the exporter read it)."""
    if any(os.environ.get(name) for name in OTLP_TIMEOUT_VARS):
        return None
    return min(10.0, config.sampling_interval_s, config.export_timeout_s)


def otlp_exporter(config: ForgeConfig) -> MetricExporter:
    url = config.otlp_metrics_url or ""  # set: the caller checked otlp_endpoint
    timeout_s = _otlp_timeout_s(config)
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as GrpcExporter

        endpoint = config.otlp_endpoint or ""
        if endpoint.rstrip("/").lower() != url.lower():
            _logger.warning(
                "otlp_endpoint %r (from %s): a gRPC endpoint has no path; dialing %s",
                endpoint,
                config.source("otlp_endpoint"),
                url,
            )
        # A scheme decides TLS; without one (host:port) None lets the exporter read
        # OTEL_EXPORTER_OTLP_[METRICS_]INSECURE as the OTel spec says (unset: TLS).
        insecure = True if url.startswith("http://") else False if url.startswith("https://") else None
        return GrpcExporter(endpoint=url, insecure=insecure, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

    return HttpExporter(endpoint=url, timeout=timeout_s)
