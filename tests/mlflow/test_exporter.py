"""The MLflow export against a REAL ``mlflow server`` (the session fixture), read back with
``MlflowClient``: steps, window statistics, timestamps, the REST calls it costs, resume, a deleted
run, a failing and a slow server, the spool left at close and its replay, several nodes in one run,
and compatibility with MLflow's own ``SystemMetricsMonitor``.

GPUs are the fake NVML (tests/fakes/pynvml.py); requests are counted by a proxy in front of the
real server (testkit/proxy.py). Nothing of MLflow is mocked.
"""

from __future__ import annotations

import logging
import math
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from loopback import loopback_transfer
from opentelemetry.sdk.metrics.export import MetricExportResult
from otel_points import gauge, metrics_data
from run_reading import anchor_steps

import otel_forge
from otel_forge.config import ForgeConfig
from otel_forge.mlflow import MLflowMetricExporter
from otel_forge.mlflow.system_metrics.windows import delivery_phase_s
from testkit.gpu_fakes import fake_gpu_env, fake_nvml
from testkit.hermetic import hermetic_environ
from testkit.proxy import GET_HISTORY, GET_RUN, LOG_BATCH, MlflowProxy, Mode
from testkit.servers import free_port, wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]

# A known utilization sequence per GPU. The fake serves value n at the n-th read (cycling), and the
# collector's cache makes one read per sample, so the first window (the agent's baseline and first
# sample) is sequence[0:2] and window k >= 1 (5 samples) the 5 reads after the previous one's.
SEQUENCES = {
    "0": [10, 20, 90, 40, 15, 60, 70, 5, 30, 95],
    "1": [3, 99, 50, 50, 48, 0, 0, 100, 25, 25],
}
SAMPLES_PER_WINDOW = 5
FIRST_WINDOW_SAMPLES = 2  # the agent's baseline at its start and its first sample
INTERVAL_S = 0.2
# A delivery waits on the monotonic clock for a time computed on the wall clock: a few ms of leeway.
CLOCK_SLACK_MS = 5.0


def samples_before(window_index: int) -> int:
    """The samples (one NVML read each) of the windows before window ``window_index``."""
    return 0 if window_index == 0 else FIRST_WINDOW_SAMPLES + SAMPLES_PER_WINDOW * (window_index - 1)


def window_stats(gpu: str, window_index: int) -> dict[str, float]:
    sequence = SEQUENCES[gpu] * 2
    start = samples_before(window_index) % len(SEQUENCES[gpu])
    values = sequence[start : start + samples_before(window_index + 1) - samples_before(window_index)]
    return {"mean": statistics.fmean(values), "max": max(values), "min": min(values)}


def history(client, run_id: str, key: str) -> list[Any]:  # type: ignore[no-untyped-def]
    return sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))


def keys_of(client, run_id: str, prefix: str = "") -> set[str]:  # type: ignore[no-untyped-def]
    return {key for key in client.get_run(run_id).data.metrics if key.startswith(prefix)}


def steps_of(client, run_id: str, key: str) -> list[int]:  # type: ignore[no-untyped-def]
    return [m.step for m in history(client, run_id, key)]


def new_run(client, experiment_id: str, name: str = "run") -> str:  # type: ignore[no-untyped-def]
    return client.create_run(experiment_id, run_name=name).info.run_id


def system_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mlflow-system-metrics")]


# --- windows -> steps, through the counting proxy ------------------------------------------------


@dataclass
class MonitoredRun:
    run_id: str
    histories: dict[str, list[Any]]
    reads: dict[int, int]  # GPU index -> nvmlDeviceGetUtilizationRates calls
    counts: dict[str, int]  # proxy: requests by path
    log_batch_arrivals: list[float]  # proxy: when each log-batch arrived (s since the epoch)
    log_batches: list[Any]  # proxy: each log-batch's body, in the order sent
    stopped_at: float  # when the monitor was stopped (s since the epoch): later windows are hurried
    export_calls: list[tuple[float, float]]  # each export() call: when it began and returned (s since the epoch)
    warnings: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def monitored_run(mlflow_server, tmp_path_factory) -> MonitoredRun:
    """``otel_forge.monitor`` for ~3.6 s: 2 fake GPUs, 0.2 s samples, 5 per window, through the proxy."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    run_id = new_run(client, client.create_experiment(f"windows-{uuid.uuid4().hex[:8]}"))
    handler = _ListHandler()
    logging.getLogger("otel_forge").addHandler(handler)
    export_calls: list[tuple[float, float]] = []
    original_export = MLflowMetricExporter.export

    def recorded_export(self: MLflowMetricExporter, *args: Any, **kwargs: Any) -> MetricExportResult:
        began = time.time()
        try:
            return original_export(self, *args, **kwargs)
        finally:
            export_calls.append((began, time.time()))

    with pytest.MonkeyPatch.context() as patch, MlflowProxy(mlflow_server.uri) as proxy:
        patch.setattr(MLflowMetricExporter, "export", recorded_export)
        patch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        scenario = {"count": 2, "sequences": {gpu: {"utilization": seq} for gpu, seq in SEQUENCES.items()}}
        with fake_nvml(scenario) as nvml:
            monitor = otel_forge.monitor(
                in_process=True,
                run_id=run_id,
                tracking_uri=proxy.uri,
                sampling_interval=INTERVAL_S,
                samples_per_window=SAMPLES_PER_WINDOW,
                prometheus=False,
                node_id="node_0",
                stats=("mean", "max", "min"),
                collectors=("cpu", "nvidia"),
            )
            time.sleep(3.6)
            stopped_at = time.time()
            monitor.stop()
            reads = {i: nvml.calls("nvmlDeviceGetUtilizationRates", i) for i in (0, 1)}
        counts = proxy.counts()
        arrivals = [t for t, _, path, _ in proxy.log() if path == LOG_BATCH]
        batches = [body for _, _, body in proxy.requests(LOG_BATCH)]
    logging.getLogger("otel_forge").removeHandler(handler)
    keys = keys_of(client, run_id)
    return MonitoredRun(
        run_id,
        {key: history(client, run_id, key) for key in keys},
        reads,
        counts,
        arrivals,
        batches,
        stopped_at,
        export_calls,
        handler.messages,
    )


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


GPU_KEY = "system/node_0/gpu_{gpu}_utilization_percentage"


def test_steps_are_0_1_2_without_gaps_or_repeats(monitored_run: MonitoredRun) -> None:
    assert monitored_run.histories, "nothing was logged"
    steps = {key: [m.step for m in h] for key, h in monitored_run.histories.items()}
    expected = list(range(len(steps[GPU_KEY.format(gpu=0)])))
    assert len(expected) >= 3  # 3.6 s of 1 s windows, plus the partial one closed at stop
    for key in (GPU_KEY.format(gpu=0), GPU_KEY.format(gpu=1)):  # their sequences change every window
        assert steps[key] == expected, key
    # The CPU's reading is the machine's: on a saturated machine it repeats (100.0), and a repeated value
    # is left out of a window (ChangedValues); the windows it is in are in order, each once.
    cpu = steps["system/node_0/cpu_utilization_percentage"]
    assert cpu[0] == 0 and cpu == sorted(set(cpu)) and set(cpu) <= set(expected), cpu
    assert all(key.startswith("system/node_0/") for key in monitored_run.histories)
    assert not monitored_run.warnings, monitored_run.warnings


def test_gpu_window_mean_max_min_equal_the_known_sequence(monitored_run: MonitoredRun) -> None:
    windows = len(monitored_run.histories[GPU_KEY.format(gpu=0)])
    # One NVML read per sample (the cache), every full window 5 of them (the first 2); the last window
    # may be partial (closed at stop), its one sample served from the cache: 0 to 5 reads.
    for gpu in (0, 1):
        reads = monitored_run.reads[gpu]
        assert samples_before(windows - 1) <= reads <= samples_before(windows), monitored_run.reads
    for gpu in ("0", "1"):
        key = GPU_KEY.format(gpu=gpu)
        means, maxes, mins = (monitored_run.histories[key + suffix] for suffix in ("", "_max", "_min"))
        for k in range(windows - 1):  # every full window
            expected = window_stats(gpu, k)
            assert (means[k].step, maxes[k].step, mins[k].step) == (k, k, k)
            assert means[k].value == pytest.approx(expected["mean"]), (gpu, k)
            assert maxes[k].value == pytest.approx(expected["max"]), (gpu, k)
            assert mins[k].value == pytest.approx(expected["min"]), (gpu, k)
        last = means[-1].value
        assert min(SEQUENCES[gpu]) <= last <= max(SEQUENCES[gpu])


def test_timestamp_is_the_window_end(monitored_run: MonitoredRun) -> None:
    timestamps = [m.timestamp for m in monitored_run.histories[GPU_KEY.format(gpu=0)]]
    assert timestamps == sorted(set(timestamps))  # strictly increasing
    # The window's end: each full window's timestamp is the time of its last sample, i.e. it falls
    # within the export() call that closed the window, 5 calls (samples) after the previous window's
    # (its start would be within the first of its 5 calls).
    calls = monitored_run.export_calls
    closing = []
    for timestamp in timestamps[:-1]:  # the last window may be partial, closed at stop
        within = [i for i, (began, returned) in enumerate(calls) if int(began * 1000) <= timestamp <= returned * 1000]
        assert len(within) == 1, (timestamp, calls)
        closing.append(within[0])
    assert len(closing) >= 2, (timestamps, calls)
    assert closing[0] == FIRST_WINDOW_SAMPLES - 1  # the first window: the baseline and the first sample
    assert [b - a for a, b in zip(closing, closing[1:], strict=False)] == [SAMPLES_PER_WINDOW] * (len(closing) - 1)
    # Every key of a step carries the step's timestamp (a key is not in every step: unchanged
    # values wait; the GPU utilization changes every window here).
    at_step = {m.step: m.timestamp for m in monitored_run.histories[GPU_KEY.format(gpu=0)]}
    for key, points in monitored_run.histories.items():
        assert all(m.timestamp == at_step[m.step] for m in points), key
    # Each log_batch waits for the node's delivery phase after the timestamp it carries, never less
    # (how much later a loaded machine delivers is not asserted).
    phase_ms = delivery_phase_s("node_0", SAMPLES_PER_WINDOW * INTERVAL_S) * 1000
    arrivals_ms = [t * 1000 for t in monitored_run.log_batch_arrivals]
    due = [
        (timestamp, arrival)
        for timestamp, arrival in zip(timestamps, arrivals_ms, strict=False)
        if arrival < monitored_run.stopped_at * 1000
    ]  # the stop hurries the rest
    assert due
    for timestamp, arrival in due:
        assert arrival - timestamp >= phase_ms - CLOCK_SLACK_MS, (timestamp, arrival, phase_ms)


def windows_per_call(log_batches: list[Any], anchor: str) -> list[list[int]]:
    """Per log_batch call, the steps of the anchor key it carried (one per window: every window sends it)."""
    return [[int(m["step"]) for m in body["metrics"] if m["key"] == anchor] for body in log_batches]


def test_one_log_batch_per_window_and_one_key_history_in_all(monitored_run: MonitoredRun) -> None:
    windows = len(monitored_run.histories[GPU_KEY.format(gpu=0)])
    calls = windows_per_call(monitored_run.log_batches, min(monitored_run.histories))
    assert [step for call in calls for step in call] == list(range(windows))  # every window once, in order
    # One call per window while the agent runs; the window not yet due at the stop rides in the last one.
    assert [len(call) for call in calls[:-1]] == [1] * (len(calls) - 1) and len(calls[-1]) in (1, 2), calls
    assert monitored_run.counts.get(GET_HISTORY) == 1  # the resume point, read once at start
    assert sum(monitored_run.counts.values()) == len(calls) + 1, monitored_run.counts


def test_a_window_of_more_than_1000_metrics_takes_ceil_n_over_1000_log_batches(
    client, experiment_id, proxy, tmp_path
) -> None:
    run_id = new_run(client, experiment_id)
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=proxy.uri,
        node_id="node_0",
        config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path)),
    )
    n = 1200
    points = [({"hw.id": str(i), "hw.gpu.task": "general"}, (i % 100) / 100) for i in range(n)]
    data = metrics_data(gauge("hw.gpu.utilization", points))

    assert exporter.export(data) is MetricExportResult.SUCCESS
    exporter.shutdown()

    assert proxy.counts() == {GET_HISTORY: 1, LOG_BATCH: math.ceil(n / 1000)}
    metrics = client.get_run(run_id).data.metrics
    assert len(metrics) == n
    assert metrics["system/node_0/gpu_1199_utilization_percentage"] == pytest.approx(99.0)
    assert {m.step for m in client.get_metric_history(run_id, "system/node_0/gpu_0_utilization_percentage")} == {0}


# --- resume -------------------------------------------------------------------------------------


def _monitor_memory(run_id: str, tracking_uri: str, node_id: str | None, seconds: float = 0.75) -> None:
    monitor = otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        tracking_uri=tracking_uri,
        node_id=node_id,
        sampling_interval=0.2,
        samples_per_window=1,
        prometheus=False,
        collectors=("memory",),
    )
    time.sleep(seconds)
    monitor.stop()


def test_resume_continues_each_nodes_own_steps(client, experiment_id, mlflow_server) -> None:
    from mlflow.entities import Metric

    run_id = new_run(client, experiment_id)
    now = int(time.time() * 1000)
    memory_keys = ("swap_usage_megabytes", "swap_usage_percentage", "system_memory_usage_megabytes")
    # node_0 has steps 0..7 of the keys a memory agent logs (its last window, a close, sends them all).
    seeded = [Metric(f"system/node_0/{k}", 1.0, now + s, s) for s in range(8) for k in memory_keys]
    client.log_batch(run_id, metrics=seeded)
    key = "system_memory_usage_megabytes"

    _monitor_memory(run_id, mlflow_server.uri, "node_0")
    _monitor_memory(run_id, mlflow_server.uri, "node_1")
    _monitor_memory(run_id, mlflow_server.uri, None)

    node_0 = anchor_steps(client, run_id, "system/node_0/")[8:]
    assert len(node_0) >= 2 and node_0 == list(range(8, 8 + len(node_0)))  # starts at 8, no gap
    assert steps_of(client, run_id, f"system/node_0/{key}")[:9] == list(range(9))
    node_1 = anchor_steps(client, run_id, "system/node_1/")
    assert node_1 and node_1 == list(range(len(node_1)))  # its own steps, from 0
    # Without a node id the prefix is system/: system/node_0/... belongs to another node.
    plain = anchor_steps(client, run_id, "system/")
    assert plain and plain == list(range(len(plain)))
    # And node_0 again, after all that: after its own last step, not after anyone else's.
    last = node_0[-1]
    _monitor_memory(run_id, mlflow_server.uri, "node_0", seconds=0.5)
    again = anchor_steps(client, run_id, "system/node_0/")[8 + len(node_0) :]
    assert again and again == list(range(last + 1, last + 1 + len(again)))


def _export_memory(exporter: MLflowMetricExporter, windows: int) -> None:
    for value in range(windows):
        exporter.export(
            metrics_data(
                gauge("otel_forge.cpu.utilization", [({}, value / 100)]),  # the anchor: the smallest key
                gauge("system.memory.limit", [({}, 64 << 30)], unit="By"),
            )
        )
        time.sleep(0.002)  # distinct window timestamps (ms)
    exporter.shutdown()


def test_a_node_resumes_from_its_anchor_without_reading_the_run(client, experiment_id, proxy, tmp_path) -> None:
    from otel_forge.mlflow.client import RunInfo

    run_id = new_run(client, experiment_id)
    _export_memory(
        MLflowMetricExporter(
            run_id,
            tracking_uri=proxy.uri,
            node_id="node_0",
            config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path)),
        ),
        3,
    )
    exporter = MLflowMetricExporter(
        None, tracking_uri=proxy.uri, node_id="node_0", config=ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path))
    )
    exporter.attach(run_id, RunInfo(experiment_id, "run"))
    _export_memory(exporter, 3)

    assert proxy.count(GET_RUN) == 0  # one key's history, never the whole run
    assert exporter.window_logger.first_step == 3
    assert steps_of(client, run_id, "system/node_0/cpu_utilization_percentage") == list(range(6))
    # The constant total: sent at the start and the end of each life only (and every tenth window,
    # were there ten): a line, not a point.
    assert steps_of(client, run_id, "system/node_0/system_memory_total_megabytes") == [0, 2, 3, 5]


def test_another_sources_keys_share_the_nodes_windows_and_its_resumed_steps(
    mlflow_server, client, experiment_id, tmp_path
) -> None:
    """Received OTLP keys (``merged``) sort before the node's own: the resume still continues the
    node's steps, and each key is at the node's step with the node's timestamp."""
    from otel_forge.names import Fold

    run_id = new_run(client, experiment_id)
    config = ForgeConfig.resolve(environ={}, spool_dir=str(tmp_path))
    _export_memory(MLflowMetricExporter(run_id, tracking_uri=mlflow_server.uri, node_id="node_0", config=config), 3)
    depth = iter(range(100))
    merged = MLflowMetricExporter(
        run_id,
        tracking_uri=mlflow_server.uri,
        node_id="node_0",
        config=config,
        merged=lambda: {"otlp/queue.depth": (Fold.LAST, float(next(depth)))},
    )
    _export_memory(merged, 3)

    assert merged.window_logger.first_step == 3
    node = {m.step: m.timestamp for m in client.get_metric_history(run_id, "system/node_0/cpu_utilization_percentage")}
    received = client.get_metric_history(run_id, "otlp/queue.depth")
    assert sorted(m.step for m in received) == [3, 4, 5] == sorted(node)[3:]
    assert all(node[m.step] == m.timestamp for m in received)


# --- a run deleted while exporting --------------------------------------------------------------


def test_deleted_run_stops_delivery_with_one_warning(client, experiment_id, mlflow_server, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge")
    run_id = new_run(client, experiment_id)
    monitor = otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        tracking_uri=mlflow_server.uri,
        node_id="node_0",
        sampling_interval=0.1,
        samples_per_window=1,
        prometheus=False,
        collectors=("memory",),
    )
    try:
        key = "system/node_0/system_memory_usage_megabytes"
        wait_for(lambda: key in client.get_run(run_id).data.metrics, 10, 0.05)
        client.delete_run(run_id)
        exporter = monitor.exporter
        wait_for(lambda: exporter.worker.stopped, 10, 0.05, message="delivery to stop")
        time.sleep(0.5)  # more exports happen after the stop

        result = exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, 0.5)])))
        assert result is MetricExportResult.FAILURE
    finally:
        monitor.stop()

    stopped = [r.getMessage() for r in caplog.records if "delivery stopped" in r.getMessage()]
    assert len(stopped) == 1, stopped
    assert run_id in stopped[0] or "deleted" in stopped[0] or "active" in stopped[0], stopped[0]
    wait_for(lambda: not system_threads(), 5, 0.05, message=lambda: f"no system threads: {system_threads()}")


# --- a failing server: nothing lost ---------------------------------------------------------------


def test_windows_survive_a_failing_server_in_order(client, experiment_id, proxy, tmp_path) -> None:
    run_id = new_run(client, experiment_id)
    monitor = otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        tracking_uri=proxy.uri,
        node_id="node_0",
        sampling_interval=0.1,
        samples_per_window=1,
        prometheus=False,
        collectors=("memory",),
        spool_dir=str(tmp_path / "spool"),
        queue_size=3,
    )
    key = "system/node_0/system_memory_usage_megabytes"
    try:
        wait_for(lambda: key in client.get_run(run_id).data.metrics, 10, 0.05)
        proxy.set_mode(Mode.ERROR_500)
        time.sleep(0.8)  # ~8 windows: more than the queue holds, so some go to the spool
        proxy.set_mode(Mode.ERROR_429)
        time.sleep(0.4)
        proxy.set_mode(Mode.PASS)
        time.sleep(0.3)
    finally:
        monitor.stop()
    counts = monitor.exporter.delivery_counts()

    steps = anchor_steps(client, run_id, "system/node_0/")
    assert steps == list(range(len(steps))), steps
    assert len(steps) >= 12
    assert counts["retried"] >= 1 and counts["spooled"] >= 1 and counts["dropped"] == 0, counts
    # A delivery per step, and one more when the close sends what the last step held back.
    assert counts["pending"] == 0 and counts["delivered"] in (len(steps), len(steps) + 1), counts
    assert not (tmp_path / "spool").exists() or not any((tmp_path / "spool").iterdir())


# --- a slow server: export never waits ----------------------------------------------------------


def test_a_slow_server_never_blocks_export_and_no_window_is_sent_twice(
    client, experiment_id, proxy, tmp_path, caplog, socket_io
) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge")
    run_id = new_run(client, experiment_id)
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=proxy.uri,
        node_id="node_0",
        config=ForgeConfig.resolve(environ={}, call_deadline_s=0.4, spool_dir=str(tmp_path)),
    )
    key = "system/node_0/cpu_utilization_percentage"

    def export(value: float) -> None:
        with socket_io.watching():
            result = exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, value)])))
        assert result is MetricExportResult.SUCCESS
        time.sleep(0.002)  # distinct window timestamps (ms)

    export(0.0)
    wait_for(lambda: key in client.get_run(run_id).data.metrics, 10, 0.05)
    proxy.set_mode(Mode.DELAY, delay_s=1.2)  # every call answers after 1.2 s: past the 0.4 s deadline
    for i in range(1, 11):
        export(i / 100)
    time.sleep(1.0)
    proxy.set_mode(Mode.PASS)
    exporter.shutdown()

    assert (socket_io.watched_calls, socket_io.operations) == (11, 0)  # export() only queued
    assert exporter.worker.stats.hung_calls >= 1
    assert len([r for r in caplog.records if "exceeded its" in r.getMessage()]) == 1
    # A call past its deadline is awaited, never sent again while the server may still work on it:
    # each window in one log_batch, however slow the server; those that waited meanwhile go together.
    points = history(client, run_id, key)
    assert [m.step for m in points] == list(range(11))
    assert [m.value for m in points] == pytest.approx([i for i in range(11)])
    calls = windows_per_call([body for _, _, body in proxy.requests(LOG_BATCH)], key)
    assert sorted(step for call in calls for step in call) == list(range(11))
    assert len(calls) < 11, calls


# --- an outage at close: the spool, its replay, and no credential anywhere -------------------------


def _export_to_a_dead_server(
    run_id: str, tmp_path: Path, values: tuple[float, ...] = (0.25,)
) -> tuple[MLflowMetricExporter, str]:
    """One window per value, to a server that is not there, then the close: the windows stay spooled."""
    dead = f"http://alice:s3cret-token@127.0.0.1:{free_port()}"  # nothing listens there
    exporter = MLflowMetricExporter(
        run_id,
        tracking_uri=dead,
        node_id="node_0",
        config=ForgeConfig.resolve(environ={}, drain_deadline_s=0.5, spool_dir=str(tmp_path / "spool")),
    )
    for value in values:
        exporter.export(metrics_data(gauge("otel_forge.cpu.utilization", [({}, value)])))
        time.sleep(0.002)  # distinct window timestamps (ms)
    wait_for(lambda: exporter.worker.stats.retried >= 1, 10, 0.05)
    exporter.shutdown()
    return exporter, dead


def test_windows_left_at_close_are_spooled_without_credentials_and_replayed(
    client, experiment_id, mlflow_server, tmp_path, caplog
) -> None:
    from otel_forge.mlflow.replay import replay_spool

    caplog.set_level(logging.WARNING, logger="otel_forge")
    run_id = new_run(client, experiment_id)
    exporter, dead = _export_to_a_dead_server(run_id, tmp_path)

    spool_dir = exporter.spool.path
    assert spool_dir.is_dir()
    left = [r.getMessage() for r in caplog.records if "not delivered" in r.getMessage()]
    assert len(left) == 1 and f"otel-forge replay {spool_dir}" in left[0], left
    stored = "\n".join(f.read_text() for f in spool_dir.iterdir())
    assert "s3cret-token" not in stored and dead.replace("alice:s3cret-token@", "") in stored

    result = replay_spool(spool_dir, tracking_uri=mlflow_server.uri)

    assert (result.delivered, result.remaining) == (1, 0)
    assert not spool_dir.exists()
    points = history(client, run_id, "system/node_0/cpu_utilization_percentage")
    assert [(m.step, m.value) for m in points] == [(0, 25.0)]


def test_a_backlog_is_replayed_in_few_calls_each_window_at_its_step(
    client, experiment_id, mlflow_server, tmp_path
) -> None:
    from otel_forge.mlflow.replay import replay_spool

    run_id = new_run(client, experiment_id)
    # 12 windows of one changing value: an outage's backlog
    exporter, _ = _export_to_a_dead_server(run_id, tmp_path, tuple(i / 100 for i in range(12)))

    with MlflowProxy(mlflow_server.uri) as proxy:
        result = replay_spool(exporter.spool.path, tracking_uri=proxy.uri)
        key = "system/node_0/cpu_utilization_percentage"
        calls = windows_per_call([body for _, _, body in proxy.requests(LOG_BATCH)], key)

    assert (result.delivered, result.remaining) == (12, 0)
    assert calls == [list(range(12))]  # one call: 12 values fit in one log_batch
    points = history(client, run_id, key)
    assert [m.step for m in points] == list(range(12))
    assert [m.value for m in points] == pytest.approx([float(i) for i in range(12)])


def test_no_credential_reaches_a_warning(client, experiment_id, tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge")
    _export_to_a_dead_server(new_run(client, experiment_id), tmp_path)

    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "retrying" in text  # the outage is reported...
    assert "s3cret-token" not in text  # ...without the password


# --- several nodes in one run: otel-forge monitor processes ------------------------------------


def _monitor_process(run_id: str, uri: str, node_id: str, duration_s: float, cache: Path) -> subprocess.Popen:
    env = fake_gpu_env({"count": 2, "amd": False}, base=hermetic_environ({"XDG_CACHE_HOME": str(cache)}))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "otel_forge.cli",
            "monitor",
            "--run-id",
            run_id,
            "--tracking-uri",
            uri,
            "--node-id",
            node_id,
            "--interval",
            "0.2",
            "--no-prometheus",
            "--duration",
            str(duration_s),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _finish(process: subprocess.Popen, timeout_s: float = 60) -> tuple[str, str]:
    try:
        out, err = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        raise AssertionError(f"otel-forge monitor did not end: {err[-2000:]}") from None
    assert process.returncode == 0, err[-2000:]
    return out, err


def test_two_node_processes_share_a_run_and_a_node_resumes(client, experiment_id, mlflow_server, tmp_path) -> None:
    run_id = new_run(client, experiment_id)
    first = [_monitor_process(run_id, mlflow_server.uri, node, 3, tmp_path / node) for node in ("node_0", "node_1")]
    for process in first:
        _finish(process)

    keys = keys_of(client, run_id)
    node_0 = {k.removeprefix("system/node_0/") for k in keys if k.startswith("system/node_0/")}
    node_1 = {k.removeprefix("system/node_1/") for k in keys if k.startswith("system/node_1/")}
    assert keys == {f"system/node_0/{k}" for k in node_0} | {f"system/node_1/{k}" for k in node_1}  # nothing else
    for expected in (
        "cpu_utilization_percentage",
        "system_memory_usage_megabytes",
        "disk_usage_percentage",
        "gpu_0_utilization_percentage",
        "gpu_1_power_usage_watts",
    ):
        assert expected in node_0 and expected in node_1, expected
    steps_0 = anchor_steps(client, run_id, "system/node_0/")
    steps_1 = anchor_steps(client, run_id, "system/node_1/")
    assert steps_0 == list(range(len(steps_0))) and len(steps_0) >= 5
    assert steps_1 == list(range(len(steps_1))) and len(steps_1) >= 5

    _finish(_monitor_process(run_id, mlflow_server.uri, "node_0", 1.5, tmp_path / "again"))

    resumed = anchor_steps(client, run_id, "system/node_0/")
    assert resumed[: len(steps_0)] == steps_0
    assert len(resumed) > len(steps_0) and resumed == list(range(len(resumed)))  # continues at last + 1
    assert anchor_steps(client, run_id, "system/node_1/") == steps_1  # the other node untouched


# --- compatibility with MLflow's own monitor -----------------------------------------------------

# MLflow's key (without "system/") -> (kind, tolerance), comparing the mean over each run's steps,
# except for the since-start network counters, compared at the last step.
TOLERANCES: dict[str, tuple[str, float]] = {
    # Both are the busy share of all CPUs, but measured over different intervals: MLflow's
    # psutil.cpu_percent() covers the time since its previous call (0.5 s), ours the time since our
    # previous read (0.2 s); on 2 busy cores (an mlflow server, two monitors, the tests) the load
    # moves by tens of points from one half second to the next.
    "cpu_utilization_percentage": ("points", 35.0),
    # psutil's `used` in both, read at different moments of a machine whose memory changes
    # (the test process, the server): a few percent.
    "system_memory_usage_megabytes": ("relative", 0.05),
    "system_memory_usage_percentage": ("relative", 0.05),
    # The same statvfs of "/" in both; only other writers move it within seconds.
    "disk_usage_percentage": ("relative", 0.01),
    "disk_usage_megabytes": ("relative", 0.01),
    "disk_available_megabytes": ("relative", 0.01),
}
# Since-start totals over every interface, loopback included, in both: compared at each run's last
# step. Both monitors run across a loopback transfer of LOOPBACK_BYTES, so both must hold at least
# that; beyond it they differ by the traffic in the moments only one of them counted (their starts
# and last windows differ by up to a second; this machine's background loopback traffic, the HTTP
# calls of both monitors included, is well under 1 MB/s).
SINCE_START = ("network_receive_megabytes", "network_transmit_megabytes")
LOOPBACK_BYTES = 64 << 20
SINCE_START_TOLERANCE = ("absolute", 3.0)  # MB
# GPU keys: the fake returns constant values, so both must agree up to MLflow's rounding of each
# window mean to one decimal (0.05) (and float noise).
GPU_TOLERANCE = ("absolute", 0.05 + 1e-9)

COMPAT_SCENARIO = {
    "count": 2,
    "amd": False,  # the fake amdsmi is on sys.path too: no AMD GPUs beside the NVIDIA ones
    "sequences": {
        "0": {
            "utilization": [37],
            "memory_used": [12_345_678_912],
            "memory_total": [85_899_345_920],
            "power": [312],
            "power_limit": [700],
        },
        "1": {
            "utilization": [81],
            "memory_used": [40_000_000_000],
            "memory_total": [85_899_345_920],
            "power": [455],
            "power_limit": [700],
        },
    },
}


def _tolerance(key: str) -> tuple[str, float]:
    return GPU_TOLERANCE if key.startswith("gpu_") else TOLERANCES[key]


def _agrees(kind: str, tolerance: float, theirs: float, ours: float) -> bool:
    if kind == "relative":
        return abs(theirs - ours) <= tolerance * max(abs(theirs), abs(ours), 1e-9)
    return abs(theirs - ours) <= tolerance


def _as_charted(points: list[Any]) -> list[float]:
    """A value per step, as a chart's line shows it: a step without a point holds the last value (ours
    sends a value again only when it changed, or every tenth window)."""
    by_step = {m.step: m.value for m in points}
    values, value = [], None
    for step in range(min(by_step), max(by_step) + 1):
        value = by_step.get(step, value)
        values.append(value)
    return values


def test_every_key_mlflows_monitor_logs_is_in_ours_with_agreeing_values(
    client, experiment_id, mlflow_server, monkeypatch
) -> None:
    run_a = new_run(client, experiment_id, "mlflow-own-monitor")
    run_b = new_run(client, experiment_id, "otel-forge")
    with fake_nvml(COMPAT_SCENARIO) as nvml:
        fresh = "mlflow.system_metrics.metrics.gpu_monitor" not in sys.modules
        import mlflow.system_metrics.metrics.gpu_monitor as gpu_monitor
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor as MlflowMonitor

        if fresh:  # MLflow's own `import pynvml` found the fake on sys.path
            assert gpu_monitor.pynvml is nvml
        else:
            # gpu_monitor binds `pynvml` when it is first imported, and something imported it
            # before the fake was on sys.path: bind it to what `import pynvml` gives now.
            monkeypatch.setattr(gpu_monitor, "pynvml", nvml)
        theirs = MlflowMonitor(run_a, sampling_interval=0.5, samples_before_logging=2, tracking_uri=mlflow_server.uri)
        assert any(isinstance(m, gpu_monitor.GPUMonitor) for m in theirs.monitors), (
            "MLflow's monitor did not pick up the fake NVML"
        )
        ours = otel_forge.monitor(
            in_process=True,
            run_id=run_b,
            tracking_uri=mlflow_server.uri,
            sampling_interval=0.2,
            samples_per_window=5,
            prometheus=False,
        )
        theirs.start()
        time.sleep(1.2)
        assert loopback_transfer(LOOPBACK_BYTES) == LOOPBACK_BYTES
        time.sleep(3.0)
        theirs.finish()
        ours.stop()
        assert nvml.calls("nvmlDeviceGetUtilizationRates", 0) > 0

    their_keys = keys_of(client, run_a)
    our_keys = keys_of(client, run_b)
    assert len(their_keys) == 8 + 5 * 2, sorted(their_keys)  # 8 host keys, 5 per GPU
    assert their_keys <= our_keys, sorted(their_keys - our_keys)

    disagreements = {}
    comparisons = []
    for key in sorted(their_keys):
        name = key.removeprefix("system/")
        their_history, our_history = history(client, run_a, key), history(client, run_b, key)
        if name in SINCE_START:
            theirs_last = max(their_history, key=lambda m: m.step).value
            ours_last = max(our_history, key=lambda m: m.step).value
            comparisons.append((name, theirs_last, ours_last))
            floor = LOOPBACK_BYTES / 1e6
            if min(theirs_last, ours_last) < floor or not _agrees(*SINCE_START_TOLERANCE, theirs_last, ours_last):
                disagreements[name] = (theirs_last, ours_last, *SINCE_START_TOLERANCE, floor)
            continue
        kind, tolerance = _tolerance(name)
        theirs_value = statistics.fmean(m.value for m in their_history)
        ours_value = statistics.fmean(_as_charted(our_history))
        comparisons.append((name, theirs_value, ours_value))
        if not _agrees(kind, tolerance, theirs_value, ours_value):
            disagreements[name] = (theirs_value, ours_value, kind, tolerance)
    assert not disagreements, (disagreements, comparisons)
