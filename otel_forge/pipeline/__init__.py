"""The OpenTelemetry layer: the collectors' readings as observable instruments (``instruments``,
read through ``sampling``'s snapshot cache), on the agent's own MeterProvider (``Agent``: one
periodic reader, ``fanout`` to every sink: ``prometheus_rendering`` served by ``prometheus_endpoint``,
``otlp``) or on the application's (``instrument``)."""

from otel_forge.pipeline.agent import Agent, EndpointError, ExporterFactory
from otel_forge.pipeline.instrument import Instrumentation, instrument
from otel_forge.pipeline.provider import build_meter_provider

__all__ = ["Agent", "EndpointError", "ExporterFactory", "Instrumentation", "build_meter_provider", "instrument"]
