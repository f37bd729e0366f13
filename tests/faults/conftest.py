"""Fixtures of the fault-injection tests: a hermetic environment; ``server``, the session's tracking
server that a test may kill and restart (``killable_server``, tests/conftest.py; each test logs into a
run of its own); every ``export()`` call timed; a watch on the call threads."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from faultkit import HTTP_TIMEOUT_S, ExportRecorder, ThreadWatch
from socket_io import SocketIO

from testkit.hermetic import apply_hermetic
from testkit.mlflow_server import MlflowServer


@pytest.fixture(autouse=True)
def hermetic_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No OTel/launcher/tracking settings from outside; MLflow's client makes one attempt per request
    with a short timeout, so a dead or hung server fails fast and our worker does the retrying."""
    apply_hermetic(monkeypatch, http_timeout_s=HTTP_TIMEOUT_S)


@pytest.fixture
def server(killable_server: MlflowServer) -> MlflowServer:
    """The session's tracking server that a test may kill and restart (tests/conftest.py)."""
    return killable_server


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch, socket_io: SocketIO) -> ExportRecorder:
    """Wrap ``MLflowMetricExporter.export`` on the class, before any exporter exists: no call is missed,
    and each is watched for socket I/O on the thread that calls it (the reader's)."""
    from opentelemetry.sdk.metrics.export import MetricExportResult

    from otel_forge.mlflow.system_metrics.exporter import MLflowMetricExporter

    recorder = ExportRecorder()
    original = socket_io.watched(MLflowMetricExporter.export)

    def recorded_export(self: MLflowMetricExporter, *args: Any, **kwargs: Any) -> MetricExportResult:
        result = original(self, *args, **kwargs)
        recorder.record(result is MetricExportResult.SUCCESS)
        return result

    monkeypatch.setattr(MLflowMetricExporter, "export", recorded_export)
    return recorder


@pytest.fixture
def call_threads() -> Iterator[ThreadWatch]:
    """The most ``mlflow-system-metrics-call`` threads alive at once during the test."""
    watch = ThreadWatch().start()
    yield watch
    watch.stop()
