"""Unit tests, no server: OTel points -> MLflow keys (``KeyMapper``), samples -> windows
(``WindowFolder``), the on-disk ``WindowSpool`` and the ``DeliveryWorker`` with a plain Python
``deliver`` function.

What a user sees in MLflow is decided here: the key names (MLflow's own where MLflow has the
metric), the values (x100 for percentages, bytes -> MB, sums over interfaces), which points are
left out (where-filters, NaN/inf), and in which order and how completely windows are delivered.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from pathlib import Path

import pytest
from otel_points import as_named_points, counter, gauge, metrics_data

import otel_forge.mlflow.delivery.retry as retry_module
from otel_forge.mlflow.delivery.engine import Delivery, DeliveryStats, Ended, Policy
from otel_forge.mlflow.delivery.outbox import Outbox
from otel_forge.mlflow.delivery.retry import Backoff
from otel_forge.mlflow.delivery.worker import DeliveryWorker, Outcome
from otel_forge.mlflow.keys import KeyMapper, key_segment, sanitize_key, system_prefix
from otel_forge.mlflow.spool_files import HEADER
from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
from otel_forge.mlflow.system_metrics.windows import ChangedValues, Window, WindowFolder, delivery_phase_s
from otel_forge.names import Fold
from testkit.servers import wait_for

PREFIX = "system/node_0/"
GPU = {"hw.name": "NVIDIA H100 80GB HBM3", "hw.vendor": "NVIDIA", "hw.type": "gpu"}


def sample_of(*metrics, prefix: str = PREFIX) -> dict[str, tuple[Fold, float]]:
    return KeyMapper(prefix).sample(as_named_points(metrics_data(*metrics)))


def values_of(*metrics, prefix: str = PREFIX) -> dict[str, float]:
    return {key: value for key, (_, value) in sample_of(*metrics, prefix=prefix).items()}


# --- KeyMapper: MLflow's exact keys -----------------------------------------------------------


def test_cpu_utilization_is_mlflows_key_in_percent() -> None:
    values = values_of(
        gauge("otel_forge.cpu.utilization", [({}, 0.4237)]),
        gauge("system.cpu.utilization", [({"cpu.mode": "user"}, 0.25), ({"cpu.mode": "idle"}, 0.5)]),
    )

    assert values["system/node_0/cpu_utilization_percentage"] == pytest.approx(42.37)
    assert values["system/node_0/cpu_user_percentage"] == pytest.approx(25.0)
    assert values["system/node_0/cpu_idle_percentage"] == pytest.approx(50.0)


def test_memory_used_in_megabytes_and_states_filtered() -> None:
    usage = [
        ({"system.memory.state": "used"}, 3_500_000_000),
        ({"system.memory.state": "free"}, 1_000_000_000),
        ({"system.memory.state": "cached"}, 2_000_000_000),
        ({"system.memory.state": "inactive"}, 7),
    ]
    values = values_of(
        counter("system.memory.usage", usage),
        gauge(
            "system.memory.utilization",
            [({"system.memory.state": "used"}, 0.35), ({"system.memory.state": "free"}, 0.10)],
        ),
    )

    assert values["system/node_0/system_memory_usage_megabytes"] == pytest.approx(3500.0)
    assert values["system/node_0/system_memory_usage_percentage"] == pytest.approx(35.0)  # used only
    assert values["system/node_0/system_memory_free_megabytes"] == pytest.approx(1000.0)
    assert values["system/node_0/system_memory_cached_megabytes"] == pytest.approx(2000.0)
    assert not any("inactive" in key for key in values)  # not in the key's where-filter


def test_disk_usage_percentage_is_the_root_filesystem_and_mounts_get_their_own_keys() -> None:
    fs = {"system.device": "/dev/vda", "system.filesystem.type": "ext4"}
    root, data = {**fs, "system.filesystem.mountpoint": "/"}, {**fs, "system.filesystem.mountpoint": "/mnt/data"}
    values = values_of(
        gauge("system.filesystem.utilization", [(root, 0.4), (data, 0.9)]),
        counter(
            "system.filesystem.usage",
            [
                ({**root, "system.filesystem.state": "used"}, 40e9),
                ({**root, "system.filesystem.state": "free"}, 60e9),
                ({**data, "system.filesystem.state": "used"}, 9e9),
                ({**data, "system.filesystem.state": "free"}, 1e9),
            ],
        ),
    )

    assert values["system/node_0/disk_usage_percentage"] == pytest.approx(40.0)  # "/" only, not summed
    assert values["system/node_0/disk_usage_megabytes"] == pytest.approx(40_000.0)
    assert values["system/node_0/disk_available_megabytes"] == pytest.approx(60_000.0)
    assert values["system/node_0/disk_root_usage_percentage"] == pytest.approx(40.0)
    assert values["system/node_0/disk_mnt_data_usage_percentage"] == pytest.approx(90.0)
    assert values["system/node_0/disk_mnt_data_usage_megabytes"] == pytest.approx(9_000.0)


def _network(eth0_rx: float, eth1_rx: float, eth0_tx: float = 0.0, lo_rx: float = 0.0) -> list[object]:
    """What the network collector reports: physical interfaces one by one, and every interface summed."""
    return [
        counter(
            "system.network.io",
            [
                ({"network.interface.name": "eth0", "network.io.direction": "receive"}, eth0_rx),
                ({"network.interface.name": "eth1", "network.io.direction": "receive"}, eth1_rx),
                ({"network.interface.name": "eth0", "network.io.direction": "transmit"}, eth0_tx),
            ],
        ),
        counter(
            "otel_forge.network.io.all_interfaces",
            [
                ({"network.io.direction": "receive"}, eth0_rx + eth1_rx + lo_rx),
                ({"network.io.direction": "transmit"}, eth0_tx + lo_rx),
            ],
        ),
    ]


def test_network_megabytes_are_every_interface_since_start_as_mlflow_counts() -> None:
    mapper = KeyMapper(PREFIX)
    folder = WindowFolder(samples_per_window=2)
    samples = [
        (_network(1e6, 3e6, lo_rx=10e6), 100.0),
        (_network(2.5e6, 3.5e6, lo_rx=10e6), 101.0),  # window 0: +2 MB
        (_network(3e6, 4e6, lo_rx=12e6), 102.0),
        (_network(5e6, 6e6, lo_rx=14e6), 103.0),
    ]  # window 1: +7 MB since start over eth0 and eth1, +4 MB over lo
    windows = [folder.add(mapper.sample(as_named_points(metrics_data(*m))), t) for m, t in samples]

    first, second = dict(windows[1].values), dict(windows[3].values)
    assert windows[0] is None and windows[2] is None
    key = "system/node_0/network_receive_megabytes"
    fold, value = mapper.sample(as_named_points(metrics_data(*_network(1e6, 3e6, lo_rx=10e6))))[key]
    assert fold is Fold.SINCE_START and value == pytest.approx(14.0)  # eth0 + eth1 + lo, in MB
    assert first[key] == pytest.approx(2.0)
    assert second[key] == pytest.approx(11.0)  # lo's traffic counted, as psutil.net_io_counters() counts it
    # Our own rates keep to the physical interfaces: eth0 + eth1 grew 2 MB in 1 s, then 5 MB over the next 2 s.
    assert first["system/node_0/network_receive_megabytes_per_second"] == pytest.approx(2.0)
    assert second["system/node_0/network_receive_megabytes_per_second"] == pytest.approx(2.5)
    # A per-interface rate: eth0 grew 1.5 MB in 1 s, then 2.5 MB over the next 2 s.
    assert first["system/node_0/network_eth0_receive_megabytes_per_second"] == pytest.approx(1.5)
    assert second["system/node_0/network_eth0_receive_megabytes_per_second"] == pytest.approx(1.25)
    assert not any("_lo_" in k for k in second)


def test_gpu_keys_carry_the_gpu_index() -> None:
    gpu0, gpu1 = {**GPU, "hw.id": "0"}, {**GPU, "hw.id": "1"}
    values = values_of(
        gauge(
            "hw.gpu.utilization",
            [({**gpu0, "hw.gpu.task": "general"}, 0.5), ({**gpu1, "hw.gpu.task": "general"}, 0.07)],
        ),
        counter("hw.gpu.memory.usage", [(gpu0, 12_345_000_000), (gpu1, 0)]),
        gauge("hw.gpu.memory.utilization", [(gpu0, 0.15)]),
        gauge("hw.power", [(gpu0, 312.5)], unit="W"),
        gauge("otel_forge.gpu.power.utilization", [(gpu0, 0.446)]),
        gauge("otel_forge.gpu.clock.frequency", [({**gpu0, "otel_forge.gpu.clock": "sm"}, 1_980_000_000)], unit="Hz"),
        counter(
            "hw.status",
            [
                ({**gpu0, "hw.state": "ok"}, 1),
                ({**gpu0, "hw.state": "failed"}, 0),
                ({**gpu1, "hw.state": "ok"}, 0),
                ({**gpu1, "hw.state": "failed"}, 1),
            ],
            unit="1",
        ),
    )

    assert values["system/node_0/gpu_0_utilization_percentage"] == pytest.approx(50.0)
    assert values["system/node_0/gpu_1_utilization_percentage"] == pytest.approx(7.0)
    assert values["system/node_0/gpu_0_memory_usage_megabytes"] == pytest.approx(12_345.0)
    assert values["system/node_0/gpu_1_memory_usage_megabytes"] == 0.0
    assert values["system/node_0/gpu_0_memory_usage_percentage"] == pytest.approx(15.0)
    assert values["system/node_0/gpu_0_power_usage_watts"] == pytest.approx(312.5)
    assert values["system/node_0/gpu_0_power_usage_percentage"] == pytest.approx(44.6)
    assert values["system/node_0/gpu_0_sm_clock_mhz"] == pytest.approx(1980.0)
    # hw.status: only the "ok" point maps (where-filter); the "failed" one is not summed in.
    assert values["system/node_0/gpu_0_status_ok"] == 1.0
    assert values["system/node_0/gpu_1_status_ok"] == 0.0


def test_a_gpu_temperature_key_is_one_sensor_never_a_sum_of_sensors() -> None:
    gpu0 = {**GPU, "hw.id": "0", "hw.vendor": "AMD"}
    values = values_of(
        gauge(
            "hw.temperature",
            [({**gpu0, "hw.sensor_location": "edge"}, 45.0), ({**gpu0, "hw.sensor_location": "hotspot"}, 60.0)],
            unit="Cel",
        )
    )

    temperatures = {key: value for key, value in values.items() if "temperature" in key}
    assert temperatures and set(temperatures.values()) <= {45.0, 60.0}, temperatures


def test_gpu_depth_keys_memory_temperature_links_and_row_remapping() -> None:
    gpu0 = {**GPU, "hw.id": "0"}
    mig = {**GPU, "hw.id": "0_mig1", "hw.parent": "0", "otel_forge.gpu.mig.instance": "1"}
    values = values_of(
        gauge(
            "hw.temperature",
            [({**gpu0, "hw.sensor_location": "gpu"}, 61.0), ({**gpu0, "hw.sensor_location": "memory"}, 71.0)],
            unit="Cel",
        ),
        gauge(
            "hw.gpu.utilization",
            [({**gpu0, "hw.gpu.task": "general"}, 0.5), ({**gpu0, "hw.gpu.task": "decoder"}, 0.25)],
        ),
        counter("hw.gpu.memory.usage", [(mig, 2_000_000_000)]),
        gauge("otel_forge.gpu.memory.remap.failed", [(gpu0, 1)]),
        gauge("otel_forge.gpu.memory.remap.pending", [(gpu0, 0)]),
    )
    assert values["system/node_0/gpu_0_temperature_celsius"] == 61.0
    assert values["system/node_0/gpu_0_memory_temperature_celsius"] == 71.0
    assert values["system/node_0/gpu_0_utilization_percentage"] == pytest.approx(50.0)  # the decoder is not added
    assert values["system/node_0/gpu_0_mig1_memory_usage_megabytes"] == pytest.approx(2000.0)
    assert values["system/node_0/gpu_0_row_remap_failure"] == 1.0
    assert values["system/node_0/gpu_0_row_remap_pending"] == 0.0


def test_link_traffic_keys_are_rates_per_link_and_direction() -> None:
    gpu0 = {**GPU, "hw.id": "0"}
    keys = sample_of(
        counter(
            "hw.gpu.io",
            [
                ({**gpu0, "otel_forge.gpu.link": link, "network.io.direction": direction}, 1e9)
                for link in ("pcie", "nvlink")
                for direction in ("transmit", "receive")
            ],
            unit="By",
        )
    )
    assert {key: fold for key, (fold, _) in keys.items()} == {
        f"system/node_0/gpu_0_{link}_{direction}_megabytes_per_second": Fold.RATE
        for link in ("pcie", "nvlink")
        for direction in ("transmit", "receive")
    }


def test_no_node_prefix_is_mlflows_plain_system_prefix() -> None:
    values = values_of(gauge("otel_forge.cpu.utilization", [({}, 0.1)]), prefix=system_prefix(None))

    assert list(values) == ["system/cpu_utilization_percentage"]
    assert system_prefix("node_0") == "system/node_0/"
    assert system_prefix("rack 3/node:7") == "system/rack_3_node_7/"


def test_nan_and_inf_are_skipped_and_unmapped_metrics_ignored() -> None:
    gpu0, gpu1, gpu2 = ({**GPU, "hw.id": str(i)} for i in range(3))
    values = values_of(
        gauge("hw.power", [(gpu0, math.nan), (gpu1, math.inf), (gpu2, 100.0)], unit="W"),
        gauge("otel_forge.cpu.utilization", [({}, -math.inf)]),
        gauge("system.cpu.load_average.15m", [({}, 1.0)]),  # no MLflow key
        gauge("not.in.the.table", [({}, 1.0)]),
    )

    assert values == {"system/node_0/gpu_2_power_usage_watts": 100.0}


def test_a_point_without_the_placeholders_attribute_makes_no_key() -> None:
    assert values_of(gauge("hw.gpu.utilization", [({"hw.name": "x"}, 0.5)])) == {}


@pytest.mark.parametrize(
    ("value", "segment"),
    [
        ("/", "root"),
        ("/mnt/data", "mnt_data"),
        ("eth0", "eth0"),
        ("/dev/nvme0n1p1", "dev_nvme0n1p1"),
        ("a b:c@d", "a_b_c_d"),
        ("", "root"),
        ("___", "root"),
        (3, "3"),
    ],
)
def test_key_segment(value: object, segment: str) -> None:
    assert key_segment(value) == segment


@pytest.mark.parametrize(
    ("key", "sanitized"),
    [
        ("system/gpu_0_utilization_percentage", "system/gpu_0_utilization_percentage"),
        ("system/a@b#c/d", "system/a_b_c/d"),
        ("system//x", "system/_/x"),
        ("system/x/", "system/x/_"),
        ("/x", "_/x"),
        ("with space:and.colon-dash", "with space:and.colon-dash"),
    ],
)
def test_sanitize_key(key: str, sanitized: str) -> None:
    from mlflow.utils.validation import _validate_metric_name

    assert sanitize_key(key) == sanitized
    _validate_metric_name(sanitize_key(key))  # MLflow's own check accepts it


@pytest.mark.parametrize("key", ["system/./cpu_utilization_percentage", "system/../cpu_utilization_percentage"])
def test_sanitize_key_output_is_always_accepted_by_mlflow(key: str) -> None:
    from mlflow.utils.validation import _validate_metric_name

    _validate_metric_name(sanitize_key(key))


# --- WindowFolder ------------------------------------------------------------------------------


def gauge_sample(key: str, value: float) -> dict[str, tuple[Fold, float]]:
    return {key: (Fold.MEAN, value)}


def test_window_mean_max_min_of_a_known_sequence() -> None:
    folder = WindowFolder(samples_per_window=5, stats=("mean", "max", "min"))
    sequence = [10, 20, 90, 40, 15, 60, 70, 5, 30, 95]
    windows = [folder.add(gauge_sample("k", v), 1000.0 + i) for i, v in enumerate(sequence)]

    assert windows[:4] == [None] * 4 and windows[5:9] == [None] * 4
    first, second = windows[4], windows[9]
    assert (first.index, second.index) == (0, 1)
    assert dict(first.values) == {"k": 35.0, "k_max": 90.0, "k_min": 10.0}
    assert dict(second.values) == {"k": 52.0, "k_max": 95.0, "k_min": 5.0}
    # Timestamp = the window's end: the time of its last sample, in ms.
    assert (first.timestamp_ms, second.timestamp_ms) == (1_004_000, 1_009_000)


def test_mean_only_by_default() -> None:
    folder = WindowFolder(samples_per_window=2)
    folder.add(gauge_sample("k", 1.0), 1.0)

    assert dict(folder.add(gauge_sample("k", 2.0), 2.0).values) == {"k": 1.5}


def test_since_start_grows_from_the_first_sample_ever() -> None:
    folder = WindowFolder(samples_per_window=3)
    readings = [100, 110, 130, 150, 170, 200]
    windows = [folder.add({"c": (Fold.SINCE_START, v)}, float(i)) for i, v in enumerate(readings)]

    assert dict(windows[2].values) == {"c": 30.0}
    assert dict(windows[5].values) == {"c": 100.0}


def test_rates_cover_real_elapsed_time_without_gaps_between_windows() -> None:
    folder = WindowFolder(samples_per_window=3)
    # (time s, counter): uneven sampling, as a loaded machine does.
    readings = [
        (0.0, 0.0),
        (1.0, 10.0),
        (2.5, 30.0),
        (3.0, 40.0),
        (4.5, 40.0),
        (6.0, 70.0),
        (7.0, 71.0),
        (7.5, 73.0),
        (9.0, 100.0),
    ]
    windows = [w for t, v in readings if (w := folder.add({"r": (Fold.RATE, v)}, t)) is not None]

    rates = [dict(w.values)["r"] for w in windows]
    assert rates == pytest.approx([30.0 / 2.5, 40.0 / 3.5, 30.0 / 3.0])
    # No gap, no overlap: each window's rate spans from the previous window's last sample, so
    # rate x window duration adds up to the counter's whole growth.
    durations = [2.5, 3.5, 3.0]
    assert sum(r * d for r, d in zip(rates, durations, strict=False)) == pytest.approx(100.0)


def test_the_first_window_is_the_baseline_and_first_sample_whatever_the_window() -> None:
    # A 2,048-node job's 12-sample windows: the agent's baseline (t=0) and first sample (t=1 s) are
    # window 0, rates and growth included; the windows after it have the job's length.
    folder = WindowFolder(samples_per_window=12, first_window_samples=2)
    times = [0.0, 1.0] + [1.0 + 10 * n for n in range(1, 25)]
    windows = [
        (i, w)
        for i, t in enumerate(times)
        if (w := folder.add({"g": (Fold.MEAN, t), "r": (Fold.RATE, 5 * t), "c": (Fold.SINCE_START, 2 * t)}, t))
    ]

    assert [i for i, _ in windows] == [1, 13, 25]
    first = windows[0][1]
    assert (first.index, first.timestamp_ms) == (0, 1000)
    assert dict(first.values) == {"g": 0.5, "r": 5.0, "c": 2.0}
    assert dict(windows[1][1].values)["r"] == pytest.approx(5.0)  # from the first sample on: no gap


def test_a_counter_that_goes_backwards_gives_no_rate_for_that_window() -> None:
    folder = WindowFolder(samples_per_window=1)
    folder.add({"r": (Fold.RATE, 100.0)}, 0.0)
    backwards = folder.add({"r": (Fold.RATE, 50.0)}, 1.0)
    after = folder.add({"r": (Fold.RATE, 60.0)}, 2.0)

    assert dict(backwards.values) == {}
    assert dict(after.values) == {"r": 10.0}  # restarts from the reset value


def test_flush_closes_a_partial_window_and_the_next_window_continues_the_index() -> None:
    folder = WindowFolder(samples_per_window=5, stats=("mean", "max"))
    assert folder.flush() is None  # nothing yet
    folder.add(gauge_sample("k", 4.0), 10.0)
    folder.add(gauge_sample("k", 8.0), 10.2)

    partial = folder.flush()

    assert partial.index == 0
    assert dict(partial.values) == {"k": 6.0, "k_max": 8.0}
    assert partial.timestamp_ms == 10_200
    assert folder.flush() is None
    for i in range(5):
        last = folder.add(gauge_sample("k", 1.0), 11.0 + i)
    assert last.index == 1
    assert dict(last.values) == {"k": 1.0, "k_max": 1.0}


def test_a_window_holds_only_the_gauges_sampled_in_it() -> None:
    folder = WindowFolder(samples_per_window=1)
    folder.add({"a": (Fold.MEAN, 1.0), "b": (Fold.MEAN, 2.0)}, 0.0)

    assert dict(folder.add({"a": (Fold.MEAN, 3.0)}, 1.0).values) == {"a": 3.0}


# --- WindowSpool -------------------------------------------------------------------------------


def window(index: int, n_values: int = 1) -> Window:
    values = tuple((f"system/k{j}", float(index)) for j in range(n_values))
    return Window(index, 1_700_000_000_000 + index * 1000, values)


def test_spool_keeps_order_across_reopen(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    spool = WindowSpool(path, max_bytes=1 << 20, header={"run_id": "r1", "prefix": "system/"})
    for i in range(5):
        assert spool.append(window(i))

    reopened = WindowSpool(path, max_bytes=1 << 20)
    assert len(reopened) == 5
    assert reopened.peek() == window(0)
    reopened.pop()
    reopened.pop()
    assert reopened.append(window(5))  # numbered after the files already there

    again = WindowSpool.open(path)
    order = []
    while (item := again.peek()) is not None:
        order.append(item.index)
        again.pop()
    assert order == [2, 3, 4, 5]
    assert again.header["run_id"] == "r1"
    assert again.remove_if_empty() and not path.exists()


def test_spool_reads_ahead_up_to_a_window_it_cannot_read(tmp_path: Path) -> None:
    spool = WindowSpool(tmp_path / "spool", max_bytes=1 << 20)
    for i in range(4):
        assert spool.append(window(i))
    assert spool.peek_many(3) == [window(0), window(1), window(2)]
    WindowSpool.pending_files(spool.path)[2].write_text("{not json")

    assert spool.peek_many(10) == [window(0), window(1)]  # up to the unreadable one, which stays
    assert len(spool) == 4 and spool.set_aside == 0


def test_spool_cap_refuses_and_the_worker_counts_the_drop(tmp_path: Path) -> None:
    one = len(json.dumps(window(0).to_json()))
    spool = WindowSpool(tmp_path / "spool", max_bytes=3 * one)
    assert [spool.append(window(i)) for i in range(4)] == [True, True, True, False]
    assert len(spool) == 3 and spool.size_bytes == 3 * one

    release = threading.Event()
    worker = DeliveryWorker(
        lambda item: release.wait(),
        name="cap",
        max_queue=1,
        overflow=WindowSpool(tmp_path / "worker-spool", max_bytes=2 * one),
    )
    try:
        results = [worker.submit(window(i)) for i in range(5)]
        # 1 in the queue, 2 in the spool, 2 refused by the cap and counted.
        assert results == [True, True, True, False, False]
        assert (worker.stats.spooled, worker.stats.dropped) == (2, 2)
    finally:
        release.set()
        worker.close(5)


def test_spool_header_records_first_step(tmp_path: Path) -> None:
    path = tmp_path / "spool"
    spool = WindowSpool(path, max_bytes=1 << 20, header={"run_id": "r1", "node_id": "node_0"})
    spool.update_header(first_step=8)  # known before the first window spills: kept for it
    spool.append(window(0))

    assert json.loads((path / HEADER).read_text())["first_step"] == 8
    assert WindowSpool.open(path).header == {"run_id": "r1", "node_id": "node_0", "first_step": 8}
    spool.update_header(first_step=9)
    assert WindowSpool.open(path).header["first_step"] == 9


def test_open_refuses_a_directory_that_is_not_a_spool(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not an otel-forge spool"):
        WindowSpool.open(tmp_path)


# --- DeliveryWorker ----------------------------------------------------------------------------


def call_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"{name}-call"]


def test_worker_delivers_in_order() -> None:
    delivered: list[int] = []
    worker: DeliveryWorker[int] = DeliveryWorker(delivered.append, name="order", max_queue=1000)
    for i in range(200):
        assert worker.submit(i)

    assert worker.close(10) == 0
    assert delivered == list(range(200))
    assert worker.stats.delivered == 200


def test_worker_spills_to_the_spool_when_the_queue_is_full_and_keeps_order(tmp_path: Path) -> None:
    release = threading.Event()
    delivered: list[int] = []

    def deliver(item: Window) -> None:
        release.wait()
        delivered.append(item.index)

    spool = WindowSpool(tmp_path / "spool", max_bytes=1 << 20)
    worker = DeliveryWorker(deliver, name="spill", max_queue=2, overflow=spool, call_deadline_s=30)
    for i in range(10):
        assert worker.submit(window(i))

    assert worker.stats.spooled == 8  # 0 and 1 wait in memory (0 is being delivered)
    assert len(spool) == 8 and worker.pending() == 10
    release.set()
    wait_for(lambda: worker.pending() == 0, 5, 0.01)
    assert worker.close(5) == 0
    assert delivered == list(range(10))
    assert len(spool) == 0


def _write_ahead_worker(tmp_path: Path, deliver) -> DeliveryWorker[Window]:
    spool = WindowSpool(tmp_path / "spool", max_bytes=1 << 20)
    return DeliveryWorker(
        deliver, name="write-ahead", overflow=spool, write_ahead=True, backoff_initial_s=0.01, backoff_max_s=0.01
    )


def test_windows_behind_a_slow_first_call_are_not_spooled_but_behind_a_later_one_are(tmp_path: Path) -> None:
    # The first call carries the deliverer's own start (importing MLflow, reading the run): windows
    # that wait for it say nothing of the server, so the spooling alert must not count them.
    gates = [threading.Event(), threading.Event()]
    delivered: list[int] = []

    def deliver(item: Window) -> None:
        if item.index in (0, 5):
            gates[item.index // 5].wait()
        delivered.append(item.index)

    worker = _write_ahead_worker(tmp_path, deliver)
    try:
        for i in range(5):
            worker.submit(window(i))
        gates[0].set()
        wait_for(lambda: worker.pending() == 0, 5, 0.01)
        assert worker.stats.spooled == 0
        for i in range(5, 8):  # 5 is slow: 6 and 7 wait behind a server that answered before
            worker.submit(window(i))
        assert worker.stats.spooled == 2
    finally:
        gates[1].set()
        assert worker.close(5) == 0
    assert delivered == list(range(8))


def test_windows_behind_a_first_call_that_fails_are_spooled(tmp_path: Path) -> None:
    release = threading.Event()
    calls: list[int] = []

    def deliver(item: Window) -> None:
        calls.append(item.index)
        if len(calls) == 1:
            release.wait()
            raise ConnectionError("the tracking server is down")

    worker = _write_ahead_worker(tmp_path, deliver)
    try:
        for i in range(4):
            worker.submit(window(i))
        assert worker.stats.spooled == 0
        release.set()
        wait_for(lambda: worker.stats.retried == 1, 5, 0.01)
        assert worker.stats.spooled == 3  # 1, 2 and 3 wait behind a failure
    finally:
        assert worker.close(5) == 0
    assert calls == [0, 0, 1, 2, 3]


def _joining_worker(tmp_path: Path, deliver, due_s: float, room: int, **options) -> DeliveryWorker[Window]:
    """Write-ahead, every window due ``due_s`` from now; windows of at most ``room`` values in all join."""
    due_at = time.time() + due_s
    spool = WindowSpool(tmp_path / "spool", max_bytes=1 << 20)
    return DeliveryWorker(
        deliver,
        name="joining",
        overflow=spool,
        write_ahead=True,
        due=lambda item: due_at,
        join=lambda item, later: item.joined(later) if item.size + later.size <= room else None,
        backoff_initial_s=0.01,
        backoff_max_s=0.01,
        **options,
    )


def test_windows_due_together_go_in_one_call_as_far_as_it_holds_them(tmp_path: Path) -> None:
    calls: list[list[int]] = []
    worker = _joining_worker(tmp_path, lambda item: calls.append([p.index for p in item.parts]), 60.0, room=5)
    for i in range(7):
        worker.submit(window(i, n_values=2))
    time.sleep(0.2)
    assert calls == []  # nothing is due before the close

    assert worker.close(5) == 0
    assert calls == [[0, 1], [2, 3], [4, 5], [6]]  # 2 values each: two windows a call
    assert worker.stats.delivered == 7 and len(worker._outbox._overflow) == 0  # type: ignore[arg-type]


def test_a_joined_call_the_server_refuses_is_sent_window_by_window(tmp_path: Path) -> None:
    calls: list[list[int]] = []

    def deliver(item: Window) -> None:
        calls.append([p.index for p in item.parts])
        if 2 in calls[-1]:
            raise ValueError("window 2 is refused")

    worker = _joining_worker(tmp_path, deliver, 60.0, room=100, classify=lambda error: Outcome.DROP)
    for i in range(4):
        worker.submit(window(i))

    assert worker.close(5) == 0
    # One refused window does not cost the three others: each is tried alone, and only 2 is dropped.
    assert calls == [[0, 1, 2, 3], [0], [1], [2], [3]]
    assert (worker.stats.delivered, worker.stats.dropped) == (3, 1)


def test_a_hung_deliver_costs_one_thread_and_a_warning_never_the_caller(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge.mlflow.delivery.engine")
    release = threading.Event()
    calls: list[int] = []

    def deliver(item: int) -> None:
        calls.append(item)
        release.wait()

    worker = DeliveryWorker(
        deliver, name="hung", max_queue=4, call_deadline_s=0.2, backoff_initial_s=0.01, backoff_max_s=0.01
    )
    try:
        for i in range(50):  # far more than the queue holds: the rest are dropped, never waited for
            worker.submit(i)
            time.sleep(0.01)

        # Every submit returned while the first call is still hung (release is never set): none waited.
        assert not release.is_set() and worker.stats.dropped > 0
        # The deadline passes again and again; the item is never sent a second time meanwhile.
        wait_for(lambda: worker.stats.hung_calls >= 3, 5, 0.01)
        assert calls == [0]
        assert len(call_threads("hung")) == 1
        hung = [r for r in caplog.records if "exceeded its" in r.getMessage()]
        assert len(hung) == 1, [r.getMessage() for r in caplog.records]  # rate-limited
        assert worker.stats.dropped == 50 - 4  # the queue holds 4 (no spool here): the rest are counted
    finally:
        release.set()
        worker.close(5)
    wait_for(lambda: not call_threads("hung"), 5, 0.01)
    assert calls == [0, 1, 2, 3]  # the slow call counted as delivered: nothing sent twice
    assert worker.stats.delivered == 4


def test_a_call_past_its_deadline_that_fails_is_retried_once_it_has_ended() -> None:
    release = threading.Event()
    calls: list[int] = []

    def deliver(item: int) -> None:
        calls.append(item)
        if len(calls) == 1:
            release.wait()
            raise ConnectionError("the slow first call failed in the end")

    worker = DeliveryWorker(deliver, name="late", call_deadline_s=0.05, backoff_initial_s=0.01, backoff_max_s=0.01)
    worker.submit(7)
    wait_for(lambda: worker.stats.hung_calls >= 2, 5, 0.01)
    assert calls == [7]
    release.set()
    wait_for(lambda: worker.stats.delivered == 1, 5, 0.01)
    assert calls == [7, 7] and worker.stats.retried == 1  # awaiting the slow call was no new try
    worker.close(1)


def test_retries_back_off_with_jitter(monkeypatch: pytest.MonkeyPatch) -> None:
    failures = 6
    draws = iter([0.0, 1.0, 0.5, 0.25, 0.75, 0.1])  # controlled random() draws
    sent: list[int] = []

    def deliver(item: int) -> None:
        sent.append(item)
        if len(sent) <= failures:
            raise ConnectionError("down")

    monkeypatch.setattr(retry_module.random, "random", lambda: next(draws))
    outbox: Outbox[int] = Outbox("jitter", DeliveryStats(), max_queue=4, overflow=None, write_ahead=False, join=None)
    delivery = Delivery(outbox, deliver, name="jitter", policy=Policy(backoff=Backoff(0.02, 0.08)))
    outbox.put(1)
    # Stepped by hand: each failed step says the pause before the next (the test is not about time).
    pauses = [delivery.step() for _ in range(failures)]
    assert delivery.step() == 0.0 and sent == [1] * (failures + 1) and delivery.stats.delivered == 1
    # Each pause is half its backoff plus a random half; the backoff doubles up to its cap.
    caps = [0.02, 0.04, 0.08, 0.08, 0.08, 0.08]
    expected = [cap * (0.5 + r / 2) for cap, r in zip(caps, [0.0, 1.0, 0.5, 0.25, 0.75, 0.1], strict=True)]
    assert pauses == pytest.approx(expected)
    assert delivery.step() == math.inf  # nothing left: idle until nudged
    delivery.finish(1.0)
    assert delivery.step() is Ended.ALL


def _failing(errors: dict[int, list[BaseException]], delivered: list[int]):  # type: ignore[no-untyped-def]
    def deliver(item: int) -> None:
        if errors.get(item):
            raise errors[item].pop(0)
        delivered.append(item)

    return deliver


class Gone(Exception):
    pass


class Refused(Exception):
    pass


def _classify(error: BaseException) -> Outcome:
    if isinstance(error, Gone):
        return Outcome.STOP
    if isinstance(error, Refused):
        return Outcome.DROP
    return Outcome.RETRY


def test_retry_keeps_the_item_first_in_line() -> None:
    delivered: list[int] = []
    errors = {1: [ConnectionError("down"), ConnectionError("down"), TimeoutError("slow")]}
    worker = DeliveryWorker(_failing(errors, delivered), name="retry", classify=_classify, backoff_initial_s=0.01)
    for i in range(4):
        worker.submit(i)

    assert worker.close(5) == 0
    assert delivered == [0, 1, 2, 3]
    assert worker.stats.retried == 3 and worker.stats.dropped == 0


def test_drop_skips_only_that_item() -> None:
    delivered: list[int] = []
    worker = DeliveryWorker(_failing({1: [Refused("bad key")]}, delivered), name="drop", classify=_classify)
    for i in range(4):
        worker.submit(i)

    worker.close(5)
    assert delivered == [0, 2, 3]
    assert worker.stats.dropped == 1 and not worker.stopped


def test_stop_ends_delivery_for_good_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge.mlflow.delivery.engine")
    delivered: list[int] = []
    worker = DeliveryWorker(_failing({1: [Gone("run deleted")]}, delivered), name="stop", classify=_classify)
    for i in range(4):
        worker.submit(i)

    wait_for(lambda: worker.stopped, 5, 0.01)
    assert worker.submit(99) is False
    worker.close(5)
    assert delivered == [0]
    assert [r.getMessage() for r in caplog.records if "delivery stopped" in r.getMessage()] == [
        "stop: delivery stopped: run deleted"
    ]


def test_close_drains_under_its_deadline_and_leaves_the_rest_in_the_spool(tmp_path: Path) -> None:
    def slow(item: Window) -> None:
        time.sleep(0.1)

    spool = WindowSpool(tmp_path / "spool", max_bytes=1 << 20)
    worker = DeliveryWorker(slow, name="drain", max_queue=100, overflow=spool)
    for i in range(30):
        worker.submit(window(i))

    left = worker.close(0.55)

    delivered = worker.stats.delivered  # acknowledged; the call in flight at the deadline is not
    assert 2 <= delivered <= 7, delivered  # 0.1 s each: about as many as the deadline allows, not 30
    assert left == len(spool) == 30 - delivered
    spooled = []
    while (item := spool.peek()) is not None:
        spooled.append(item.index)
        spool.pop()
    assert spooled == list(range(delivered, 30))  # exactly the rest, in order


def test_close_keeps_order_when_the_queue_and_the_spool_both_hold_windows(tmp_path: Path) -> None:
    release = threading.Event()
    spool = WindowSpool(tmp_path / "spool", max_bytes=1 << 20)
    worker = DeliveryWorker(
        lambda item: release.wait(), name="order-at-close", max_queue=2, overflow=spool, call_deadline_s=30
    )
    try:
        for i in range(6):
            worker.submit(window(i))  # 0, 1 in memory; 2..5 in the spool
        left = worker.close(0.2)
    finally:
        release.set()

    spooled = []
    while (item := spool.peek()) is not None:
        spooled.append(item.index)
        spool.pop()
    assert left == 6
    assert spooled == [0, 1, 2, 3, 4, 5]


def test_retry_warnings_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="otel_forge.mlflow.delivery.engine")

    def always_down(item: int) -> None:
        raise ConnectionError("connection refused")

    worker = DeliveryWorker(always_down, name="noisy", backoff_initial_s=0.01, backoff_max_s=0.01)
    worker.submit(1)
    wait_for(lambda: worker.stats.retried >= 10, 5, 0.01)
    worker.close(0.1)

    retries = [r for r in caplog.records if "retrying" in r.getMessage()]
    assert len(retries) == 1
    assert worker.stats.retried >= 10


# --- what a window sends, and when ------------------------------------------------------------


def test_changed_values_keep_the_anchor_and_what_changed_and_refresh_the_rest() -> None:
    changed = ChangedValues(refresh_windows=3)
    sent = []
    for index in range(7):
        window = Window(index, 1000 + index, (("a_anchor", 1.0), ("b_total", 64.0), ("c_util", float(index // 2))))
        sent.append([key for key, _ in changed.keep(window).values])
    assert sent == [
        ["a_anchor", "b_total", "c_util"],
        ["a_anchor"],
        ["a_anchor", "c_util"],
        ["a_anchor", "b_total"],
        ["a_anchor", "c_util"],
        ["a_anchor"],
        ["a_anchor", "b_total", "c_util"],
    ]


def test_a_held_value_that_changes_is_sent_at_the_step_before_too() -> None:
    """100, 100, 100, 90: the 100 held back at step 2 goes with step 3's 90, at step 2's time."""
    changed = ChangedValues(refresh_windows=10)
    windows = [
        changed.keep(Window(i, 1000 * i, (("a_anchor", 1.0), ("gpu", v)))) for i, v in enumerate([100, 100, 100, 90])
    ]
    assert [dict(w.values).get("gpu") for w in windows] == [100, None, None, 90]
    assert [w.before for w in windows] == [(), (), (), (("gpu", 100),)]
    assert windows[3].before_timestamp_ms == 2000
    # Sent at the previous step already (it changed there): nothing to add.
    again = changed.keep(Window(4, 4000, (("a_anchor", 1.0), ("gpu", 80.0))))
    assert again.before == () and dict(again.values)["gpu"] == 80
    # The spool keeps it.
    assert Window.from_json(windows[3].to_json()) == windows[3]


def test_a_nan_is_sent_every_window_as_it_never_equals_itself() -> None:
    changed = ChangedValues(refresh_windows=10)
    for index in range(3):
        assert len(changed.keep(Window(index, index, (("a", 1.0), ("b", math.nan)))).values) == 2


def test_delivery_phases_of_many_nodes_cover_the_window_evenly() -> None:
    phases = [delivery_phase_s(f"node_{i}", 60.0) for i in range(2048)]
    assert all(0.0 <= p < 60.0 for p in phases)
    per_second = [0] * 60
    for phase in phases:
        per_second[int(phase)] += 1
    # 2,048 nodes over 60 s: about 34 a second, no second more than twice that.
    assert max(per_second) < 2 * 2048 / 60 and min(per_second) > 0, per_second
    assert delivery_phase_s("node_7", 10.0) == delivery_phase_s("node_7", 10.0)  # stable across restarts


def test_an_overloaded_store_is_retried_and_a_bad_request_dropped() -> None:
    from mlflow.exceptions import RestException

    from otel_forge.mlflow.client import classify

    overloaded = RestException(
        {
            "error_code": "BAD_REQUEST",
            "message": "(sqlalchemy.exc.TimeoutError) QueuePool "
            "limit of size 5 overflow 10 reached, connection timed out, timeout 30.00",
        }
    )
    locked = RestException({"error_code": "BAD_REQUEST", "message": "(sqlite3.OperationalError) database is locked"})
    refused = RestException({"error_code": "INVALID_PARAMETER_VALUE", "message": "Invalid value for metric key"})
    assert classify(overloaded) is Outcome.RETRY
    assert classify(locked) is Outcome.RETRY
    assert classify(refused) is Outcome.DROP
    assert classify(RestException({"error_code": "INTERNAL_ERROR", "message": "boom"})) is Outcome.RETRY


def test_close_cuts_a_backoff_pause_short_and_tries_again_at_once() -> None:
    tries: list[float] = []

    def deliver(item: int) -> None:
        tries.append(time.monotonic())
        if len(tries) == 1:
            raise ConnectionError("down for a moment")

    worker = DeliveryWorker(deliver, name="wake", backoff_initial_s=30.0, backoff_max_s=30.0)
    worker.submit(1)
    wait_for(lambda: worker.stats.retried == 1, 5, 0.01)
    assert worker.close(5.0) == 0  # within 5 s, not after 30 s of backoff: the drain tries at once
    assert worker.stats.delivered == 1 and len(tries) == 2


@pytest.mark.parametrize("spread_s", [0.0, 0.6])
def test_a_close_with_a_spread_sends_nothing_before_it_and_everything_within_the_drain(spread_s: float) -> None:
    """The nodes of a job stop together: each waits its share of the spread before its last calls."""
    sent: list[float] = []
    worker = DeliveryWorker(lambda item: sent.append(time.time()), name="spread", due=lambda item: time.time() + 60)
    for item in range(3):
        worker.submit(item)  # due in a minute: the close hurries them
    closed_at = time.time()
    assert worker.close(5.0, spread_s=spread_s) == 0
    assert len(sent) == 3 and all(t - closed_at >= spread_s for t in sent), (sent, closed_at)


def test_window_timestamps_rise_even_for_samples_in_the_same_millisecond() -> None:
    folder = WindowFolder(samples_per_window=1)
    windows = [folder.add({"k": (Fold.MEAN, float(i))}, 1000.0001) for i in range(3)]
    assert [w.timestamp_ms for w in windows] == [1_000_000, 1_000_001, 1_000_002]
