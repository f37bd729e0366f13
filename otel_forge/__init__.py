"""otel_forge: one sampling of a training machine's hardware, served to MLflow, Prometheus and OTLP.

``import otel_forge`` is cheap: no mlflow, no exporters, no NVML until they are used.
"""

from otel_forge.config import SETTINGS, ConfigError, ForgeConfig
from otel_forge.mlflow.training.script_run import job_run_id
from otel_forge.names import METRICS, MetricSpec
from otel_forge.node import NodeIdentity
from otel_forge.pipeline import Agent, EndpointError, Instrumentation, instrument

_LAZY = {"MLflowMetricExporter", "SystemMetricsMonitor", "TrainingRun", "monitor"}


def __getattr__(name: str) -> object:
    # The MLflow side loads the OTel SDK's exporter machinery: only when asked for.
    if name in _LAZY:
        import otel_forge.mlflow

        return getattr(otel_forge.mlflow, name)
    if name == "__version__":
        from importlib.metadata import version

        return version("otel-forge")
    raise AttributeError(f"module 'otel_forge' has no attribute {name!r}")


__all__ = [
    "__version__",
    "MLflowMetricExporter",
    "SystemMetricsMonitor",
    "TrainingRun",
    "monitor",
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
    "job_run_id",
]
