"""The MLflow side of otel_forge: system metrics into a run (``MLflowMetricExporter``,
``monitor``) and the replay of a spool. Importing this package does not import mlflow."""

from otel_forge.mlflow.exporter import MLflowMetricExporter
from otel_forge.mlflow.monitor import SystemMetricsMonitor, monitor
from otel_forge.mlflow.training_run import TrainingRun

__all__ = ["MLflowMetricExporter", "SystemMetricsMonitor", "TrainingRun", "monitor"]
