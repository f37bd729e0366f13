"""otel_forge: one sampling of a training machine's hardware, served to MLflow, Prometheus and OTLP.

``import otel_forge`` is cheap: no mlflow, no exporters, no NVML until they are used.
"""

from otel_forge.config import SETTINGS, ConfigError, ForgeConfig
from otel_forge.names import METRICS, MetricSpec
from otel_forge.node import NodeIdentity
from otel_forge.pipeline import Agent, EndpointError, Instrumentation, instrument

__all__ = [
    "METRICS",
    "SETTINGS",
    "Agent",
    "ConfigError",
    "EndpointError",
    "ForgeConfig",
    "Instrumentation",
    "MetricSpec",
    "NodeIdentity",
    "instrument",
]
