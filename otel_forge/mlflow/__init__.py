"""Everything that talks to MLflow; mlflow itself is imported lazily, in ``client`` only.

Two subsystems: ``system_metrics`` delivers the agent's readings into a run
(``MLflowMetricExporter``, ``monitor``); ``training`` is the training-run backend
(``TrainingRun``). ``client``, ``keys``, ``worker``, ``spool_files`` and ``replay`` are theirs in
common. Importing this package imports neither mlflow nor the OpenTelemetry SDK.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "MLflowMetricExporter": "otel_forge.mlflow.system_metrics.exporter",
    "SystemMetricsMonitor": "otel_forge.mlflow.system_metrics.monitor",
    "monitor": "otel_forge.mlflow.system_metrics.monitor",
    "TrainingRun": "otel_forge.mlflow.training.training_run",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MLflowMetricExporter", "SystemMetricsMonitor", "TrainingRun", "monitor"]
