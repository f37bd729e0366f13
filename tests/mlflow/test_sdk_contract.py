"""``MLflowMetricExporter`` keeps the OpenTelemetry SDK's exporter contract: ``force_flush`` delivers
the open window within its timeout, and the provider's shutdown budget reaches the drain."""

from __future__ import annotations

import time

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from otel_points import gauge, metrics_data

from otel_forge.config import ForgeConfig
from otel_forge.mlflow import MLflowMetricExporter
from testkit.proxy import LOG_BATCH, Mode

KEY = "system/node_0/cpu_utilization_percentage"


def _export(exporter: MLflowMetricExporter, values: list[float]) -> None:
    for value in values:
        exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, value)])))
        time.sleep(0.002)  # distinct window timestamps (ms)


def test_force_flush_closes_the_open_window_and_returns_once_it_is_delivered(client, experiment_id, tmp_path):
    run_id = client.create_run(experiment_id).info.run_id
    # A window of 5 samples, delivered 60 s into the next window: only a flush sends it now.
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=client.tracking_uri,
        node_id="node_0",
        samples_per_window=5,
        delivery_phase_s=60,
        config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path)),
    )
    try:
        _export(exporter, [0.2, 0.4])
        assert KEY not in client.get_run(run_id).data.metrics
        assert exporter.force_flush(timeout_millis=20_000) is True
        (point,) = client.get_metric_history(run_id, KEY)
        assert (point.step, point.value) == (0, 30.0)  # the mean of the two samples, as a percentage
        _export(exporter, [0.6])
        assert exporter.force_flush(timeout_millis=20_000) is True
        assert [m.step for m in client.get_metric_history(run_id, KEY)] == [0, 1]
    finally:
        exporter.shutdown()


def test_force_flush_says_false_when_delivery_outlasts_its_timeout(client, experiment_id, proxy, tmp_path):
    run_id = client.create_run(experiment_id).info.run_id
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=proxy.uri,
        node_id="node_0",
        samples_per_window=1,
        config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path)),
    )
    proxy.set_mode(Mode.DELAY, delay_s=2.0)
    _export(exporter, [0.1])
    assert exporter.force_flush(timeout_millis=100) is False
    proxy.set_mode(Mode.PASS)
    assert exporter.force_flush(timeout_millis=20_000) is True  # the window was not lost, only late
    exporter.shutdown()
    assert [m.step for m in client.get_metric_history(run_id, KEY)] == [0]


def test_the_providers_shutdown_budget_reaches_the_drain(client, experiment_id, proxy, tmp_path):
    """The SDK's reader calls ``exporter.shutdown(timeout=<ms left>)``: a 60 s drain deadline does not
    hold a provider shut down with 300 ms; what is not delivered by then stays in the spool."""
    run_id = client.create_run(experiment_id).info.run_id
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=proxy.uri,
        node_id="node_0",
        samples_per_window=1,
        config=ForgeConfig.resolve(environ={}, drain_deadline_s=60, spool_dir=str(tmp_path)),
    )
    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(exporter, export_interval_millis=3_600_000)])
    proxy.set_mode(Mode.DELAY, delay_s=1.0)  # each log_batch takes 1 s: 5 windows need 5 s
    _export(exporter, [0.1, 0.2, 0.3, 0.4, 0.5])
    provider.shutdown(timeout_millis=300)
    undelivered = exporter.delivery_counts()["pending"]
    proxy.set_mode(Mode.PASS)
    assert undelivered >= 4  # at most the call in flight got through
    assert proxy.count(LOG_BATCH) <= 2
    assert any(exporter.spool.path.iterdir())  # kept for `otel-forge replay`
