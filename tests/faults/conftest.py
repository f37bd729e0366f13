"""Fixtures of the fault-injection tests: a hermetic environment; real ``mlflow server`` processes
(one per module for the tests that kill and restart it, one shared by the tests that only pause and
resume it; each test logs into a run of its own); every ``export()`` call timed; a watch on the call
threads."""

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


def _own_server(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[MlflowServer]:
    mlflow_server = MlflowServer(tmp_path_factory.mktemp(name)).start()
    try:
        yield mlflow_server
    finally:
        mlflow_server.kill()  # SIGCONT + SIGKILL: fast, and safe whatever state the tests left it in


@pytest.fixture(scope="session")
def _killable_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    yield from _own_server(tmp_path_factory, "faults-server")


@pytest.fixture
def server(_killable_server: MlflowServer) -> Iterator[MlflowServer]:
    """A tracking server the test may kill and restart (same port, same database), shared by the tests
    that kill it, one after the other, each in a run of its own: a server start is 6-15 s on 2 cores.
    Whatever state a test leaves it in, the next one finds it up."""
    _killable_server.resume()
    if not _killable_server.healthy():
        _killable_server.kill()
        _killable_server.start()
    yield _killable_server


@pytest.fixture(scope="session")
def _shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    yield from _own_server(tmp_path_factory, "faults-shared-server")


@pytest.fixture
def pausable_server(_shared_server: MlflowServer) -> Iterator[MlflowServer]:
    """One server shared by the tests that only pause (SIGSTOP) and resume it, each in a run of its
    own: a server start is 6-15 s on 2 cores. Resumed after each test, whatever the test did."""
    assert _shared_server.healthy(), "the shared tracking server does not answer"
    try:
        yield _shared_server
    finally:
        _shared_server.resume()


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
