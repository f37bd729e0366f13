"""otel_forge: one sampling of a training machine's hardware, served to MLflow, Prometheus and OTLP.

``import otel_forge`` is cheap: no mlflow, no exporters, no NVML until they are used.
"""

import importlib

# Every name is imported when first used: a process ``otel-forge run`` starts imports this package
# for its progress hook alone, and must not pay for the pipeline or the MLflow side (PEP 562).
_FROM = {
    "SETTINGS": "otel_forge.config",
    "ConfigError": "otel_forge.config",
    "ForgeConfig": "otel_forge.config",
    "job_run_id": "otel_forge.mlflow.training.script_run",
    "METRICS": "otel_forge.names",
    "MetricSpec": "otel_forge.names",
    "NodeIdentity": "otel_forge.node",
    "Agent": "otel_forge.pipeline",
    "EndpointError": "otel_forge.pipeline",
    "Instrumentation": "otel_forge.pipeline",
    "instrument": "otel_forge.pipeline",
    # The MLflow side loads the OTel SDK's exporter machinery.
    "MLflowMetricExporter": "otel_forge.mlflow",
    "SystemMetricsMonitor": "otel_forge.mlflow",
    "TrainingRun": "otel_forge.mlflow",
    "monitor": "otel_forge.mlflow",
}


def __getattr__(name: str) -> object:
    if name in _FROM:
        value = getattr(importlib.import_module(_FROM[name]), name)
        globals()[name] = value
        return value
    if name == "__version__":
        from importlib.metadata import version

        return version("otel-forge")
    raise AttributeError(f"module 'otel_forge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


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
