"""What lets one tracking server carry a fleet, against the REAL ``mlflow server`` behind the counting
proxy: an overloaded server (400 ``QueuePool limit``) loses nothing, nodes started together deliver
spread over the window, and a value that does not change is not sent every window (yet every chart
still spans the run)."""

from __future__ import annotations

import logging
import time
from typing import Any

from otel_points import gauge, metrics_data

import otel_forge
from otel_forge.config import ForgeConfig
from otel_forge.mlflow import MLflowMetricExporter
from otel_forge.mlflow.delivery.retry import Backoff
from otel_forge.mlflow.system_metrics.windows import delivery_phase_s
from testkit.proxy import GET_RUN, LOG_BATCH, Mode
from testkit.servers import wait_for

# A delivery waits on the monotonic clock for a time computed on the wall clock: a few ms of leeway.
CLOCK_SLACK_S = 0.005


def _steps(client, run_id: str, key: str) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_an_overloaded_server_answering_400_queue_pool_loses_no_window(client, experiment_id, proxy, tmp_path):
    run_id = client.create_run(experiment_id).info.run_id
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=proxy.uri,
        node_id="node_0",
        config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path)),
    )
    exporter.worker._delivery._backoff = Backoff(0.05, 0.2)  # the overload's retries within the test's seconds
    proxy.set_mode(Mode.OVERLOAD_400)
    for value in range(20):
        exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, value / 100)])))
        time.sleep(0.01)
    wait_for(lambda: exporter.worker.stats.retried >= 3, 10, 0.02, message="retries of the overloaded batch")
    proxy.set_mode(Mode.PASS)
    exporter.shutdown()

    assert _steps(client, run_id, "system/node_0/cpu_utilization_percentage") == list(range(20))
    counts = exporter.delivery_counts()
    assert counts["dropped"] == 0 and counts["pending"] == 0, counts
    assert proxy.answered["overload"] >= 3


def test_nodes_started_together_deliver_spread_over_the_window(client, experiment_id, proxy, tmp_path):
    nodes, interval_s, samples = 16, 0.25, 4
    window_s = interval_s * samples
    run_id = client.create_run(experiment_id).info.run_id
    monitors = [
        otel_forge.monitor(
            in_process=True,
            run_id=run_id,
            tracking_uri=proxy.uri,
            node_id=f"node_{i}",
            sampling_interval=interval_s,
            samples_per_window=samples,
            prometheus=False,
            collectors=("memory",),
            spool_dir=str(tmp_path / f"spool{i}"),
        )
        for i in range(nodes)
    ]

    def node_of(body: dict[str, Any]) -> str:
        return body["metrics"][0]["key"].split("/")[1]

    try:
        wait_for(
            lambda: len({node_of(body) for _, body in proxy.arrivals(LOG_BATCH)}) == nodes,
            60,
            0.1,
            message="a window of every node",
        )
    finally:
        stopped_at = time.time()  # the stop hurries what waits for its phase: only earlier arrivals count
        for monitor in monitors:
            monitor.stop()

    # A hash of the node id places each node's calls in the window: spread, not at its end.
    phases = {f"node_{i}": delivery_phase_s(f"node_{i}", window_s) for i in range(nodes)}
    quarters = [sum(1 for p in phases.values() if q * window_s / 4 <= p < (q + 1) * window_s / 4) for q in range(4)]
    assert min(quarters) >= 1 and max(quarters) <= nodes / 2, quarters
    # Each node's log_batch waits for its phase after the window's end (its timestamp), never less:
    # the calls of nodes that sample together reach the server spread over the window. (How much later
    # a loaded machine delivers is not asserted.)
    delays: dict[str, list[float]] = {}
    for arrived_at, body in proxy.arrivals(LOG_BATCH):
        if arrived_at < stopped_at:
            delays.setdefault(node_of(body), []).append(arrived_at - body["metrics"][0]["timestamp"] / 1000)
    assert len(delays) == nodes
    for node, seen in delays.items():
        assert min(seen) >= phases[node] - CLOCK_SLACK_S, (node, seen, phases[node])


def test_an_unchanged_value_is_sent_every_tenth_window(client, experiment_id, tmp_path):
    run_id = client.create_run(experiment_id).info.run_id
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=client.tracking_uri,
        node_id="node_0",
        config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path)),
    )
    for window in range(25):
        exporter.export(
            metrics_data(
                gauge("otel_forge.cpu.utilization", [({}, window / 100)]),  # changes every window
                gauge("system.memory.limit", [({}, 64 << 30)], unit="By"),  # never changes
                gauge("system.memory.utilization", [({"system.memory.state": "used"}, 0.5 if window < 12 else 0.7)]),
            )
        )
        time.sleep(0.002)
    exporter.shutdown()

    assert _steps(client, run_id, "system/node_0/cpu_utilization_percentage") == list(range(25))
    # ... and at the last window (24), whole: every line runs to the run's last step.
    assert _steps(client, run_id, "system/node_0/system_memory_total_megabytes") == [0, 10, 20, 24]
    # Sent when it changed (12) and at the step before (11, where it still held 50: MLflow draws a step,
    # not a slope from 10), then refreshed 10 windows after: a chart's line goes on.
    history = sorted(
        client.get_metric_history(run_id, "system/node_0/system_memory_usage_percentage"), key=lambda m: m.step
    )
    assert [(m.step, m.value) for m in history] == [
        (0, 50.0),
        (10, 50.0),
        (11, 50.0),
        (12, 70.0),
        (22, 70.0),
        (24, 70.0),
    ]
    # The point at step 11 carries window 11's time, not window 12's.
    assert history[2].timestamp < history[3].timestamp


def test_an_agent_told_the_experiment_never_reads_the_run(client, experiment_id, proxy, tmp_path):
    run_id = client.create_run(experiment_id).info.run_id
    monitor = otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        experiment_id=experiment_id,
        tracking_uri=proxy.uri,
        node_id="node_9",
        sampling_interval=0.1,
        prometheus=False,
        collectors=("memory",),
        spool_dir=str(tmp_path),
    )
    wait_for(lambda: proxy.count(LOG_BATCH) >= 3, 10, 0.05, message="three windows")
    monitor.stop()
    assert proxy.count(GET_RUN) == 0  # a node of a large run starts without reading it
    assert monitor.exporter.window_logger.first_step == 0


def test_windows_honour_retry_after_as_the_journal_does_and_name_the_status(
    client, experiment_id, proxy, tmp_path, caplog
):
    """The windows go through the same delivery engine as a run's journal: a gateway answering 429 with
    ``Retry-After: 3`` for 7 s gets one call per pause at most, the line names the status and the
    pause (no urllib3 text), and every window arrives once it lets them through."""
    caplog.set_level(logging.WARNING, logger="otel_forge")
    proxy.retry_after_s = 3
    run_id = client.create_run(experiment_id).info.run_id
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=proxy.uri,
        node_id="node_0",
        config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path)),
    )
    exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, 0.0)])))
    assert exporter.force_flush(10_000)
    began = time.time()
    proxy.set_mode(Mode.ERROR_429)
    for value in range(1, 15):
        exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, value / 100)])))
        exporter.force_flush(0)  # each window due at once: only the server's pause holds them back
        time.sleep(0.5)
    proxy.set_mode(Mode.PASS)
    ended = time.time()
    exporter.shutdown()

    refused = [at for at, _ in proxy.arrivals(LOG_BATCH) if began <= at < ended]
    assert 1 <= len(refused) <= 3, f"{len(refused)} log-batch calls in 7 s while the server asked for 3 s"
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "HTTP 429, Retry-After 3 s" in said and "urllib3" not in said, said
    assert _steps(client, run_id, "system/node_0/cpu_utilization_percentage") == list(range(15))
