"""The NVIDIA collector against the fake pynvml (tests/fakes/pynvml.py, real NVML error classes)."""

from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from collector_helpers import by_gpu, messages, opened_with, read
from gpu_fakes import fake_nvml

from otel_forge.collectors import nvidia
from otel_forge.collectors.base import CollectorUnavailable
from otel_forge.collectors.nvidia import NvidiaCollector
from otel_forge.config import ForgeConfig
from otel_forge.names import METRICS

LOGGER = "otel_forge.collectors.nvidia"
SPECS = {spec.name: spec for spec in METRICS if spec.source == "nvidia"}
THROTTLE_REASONS = {
    "gpu_idle",
    "applications_clocks_setting",
    "sw_power_cap",
    "hw_slowdown",
    "sync_boost",
    "sw_thermal_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "display_clock_setting",
}
MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def short_xid_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """close() waits for the event thread's current wait: keep that short here (one test uses the real one)."""
    monkeypatch.setattr(nvidia, "XID_WAIT_MS", 50)


def opened(scenario: dict, **settings: Any) -> contextlib.AbstractContextManager[tuple[Any, NvidiaCollector]]:
    return opened_with(fake_nvml, NvidiaCollector, scenario, **settings)


# --- every metric ----------------------------------------------------------------------------


def test_four_gpus_report_every_metric_with_units_and_attributes() -> None:
    scenario = {
        "count": 4,
        "sequences": {
            "0": {
                "utilization": [30],
                "memory_activity": [12],
                "memory_total": [80 * 1024 * MiB],
                "memory_used": [20 * 1024 * MiB],
                "power": [250],
                "power_limit": [700],
                "energy": [12345],
                "temperature": [61],
                "sm_clock": [1980],
                "memory_clock": [2619],
                "pcie_tx": [1000],
                "pcie_rx": [3000],
                "ecc_corrected": [5],
                "ecc_uncorrected": [1],
            }
        },
    }
    with opened(scenario) as (_, collector):
        readings = read(collector)

    assert set(readings.metrics()) == set(SPECS) - {"otel_forge.gpu.xid.errors"}  # no XID event yet
    for metric in readings.metrics():  # attribute keys exactly as names.py declares them
        for attributes, _ in readings.get(metric):
            assert set(attributes) == set(SPECS[metric].attributes), metric
    for metric in ("hw.gpu.utilization", "hw.gpu.memory.usage", "hw.power", "hw.energy", "hw.temperature"):
        assert set(by_gpu(readings, metric)) == {"0", "1", "2", "3"}, metric

    gpu0 = next(attrs for attrs, _ in readings.get("hw.power") if attrs["hw.id"] == "0")
    assert gpu0["hw.vendor"] == "NVIDIA" and gpu0["hw.type"] == "gpu"
    assert gpu0["hw.name"] == "NVIDIA H100 80GB HBM3"
    assert gpu0["otel_forge.gpu.uuid"] == "GPU-1a2b0000-0000-4000-8000-000000000000"
    assert gpu0["otel_forge.gpu.pci_bus_id"] == "00000000:17:00.0"
    # semconv's identity attributes, from NVML
    assert gpu0["hw.model"] == "NVIDIA H100 80GB HBM3" and gpu0["hw.serial_number"] == "1654922000000"
    assert gpu0["hw.driver_version"] == "999.99-fake" and gpu0["hw.firmware_version"] == "96.00.89.00.01"
    expected = {
        ("hw.gpu.utilization", ()): 0.30,
        ("otel_forge.gpu.memory.activity", ()): 0.12,
        ("hw.gpu.memory.usage", ()): 20 * 1024 * MiB,
        ("hw.gpu.memory.limit", ()): 80 * 1024 * MiB,
        ("hw.gpu.memory.utilization", ()): 0.25,
        ("hw.power", ()): 250.0,
        ("otel_forge.gpu.power.limit", ()): 700.0,
        ("otel_forge.gpu.power.utilization", ()): 250 / 700,
        ("hw.energy", ()): 12345.0,
        ("hw.temperature", (("hw.sensor_location", "gpu"),)): 61,
        ("otel_forge.gpu.clock.frequency", (("otel_forge.gpu.clock", "sm"),)): 1980e6,
        ("otel_forge.gpu.clock.frequency", (("otel_forge.gpu.clock", "memory"),)): 2619e6,
        ("hw.gpu.io", (("network.io.direction", "transmit"),)): 0,  # a byte counter: 0 at the first read
        ("hw.gpu.io", (("network.io.direction", "receive"),)): 0,
        ("hw.errors", (("error.type", "corrected"),)): 5,
        ("hw.errors", (("error.type", "uncorrected"),)): 1,
        ("otel_forge.gpu.process.memory.usage", ()): 0,
        ("hw.status", (("hw.state", "ok"),)): 1,
        ("hw.status", (("hw.state", "failed"),)): 0,
    }
    for (metric, attributes), value in expected.items():
        assert by_gpu(readings, metric, **dict(attributes))["0"] == pytest.approx(value), (metric, attributes)
    assert by_gpu(readings, "hw.gpu.utilization")["0"] == 0.30
    assert {a["hw.gpu.task"] for a, _ in readings.get("hw.gpu.utilization")} == {"general"}


def test_pcie_bytes_add_the_mean_throughput_times_the_time_between_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 100.0, 102.0, 102.0, 112.0, 112.0])  # tx, rx at each of three reads
    monkeypatch.setattr(nvidia.time, "monotonic", lambda: next(clock))
    scenario = {"count": 1, "sequences": {"0": {"pcie_tx": [1000, 3000, 3000], "pcie_rx": [0, 0, 500]}}}
    with opened(scenario, gpus="all") as (_, collector):
        totals = [
            (
                by_gpu(readings, "hw.gpu.io", **{"network.io.direction": "transmit"})["0"],
                by_gpu(readings, "hw.gpu.io", **{"network.io.direction": "receive"})["0"],
            )
            for readings in (read(collector), read(collector), read(collector))
        ]
    kib = 1024
    assert totals == [(0, 0), (2 * 2000 * kib, 0), (2 * 2000 * kib + 10 * 3000 * kib, 10 * 250 * kib)]


def test_a_board_without_a_serial_number_leaves_the_attribute_out() -> None:
    with opened({"count": 2, "not_supported": {"1": ["nvmlDeviceGetSerial"]}}) as (_, collector):
        readings = read(collector)
    serials = {a["hw.id"]: a.get("hw.serial_number") for a, _ in readings.get("hw.power")}
    assert serials == {"0": "1654922000000", "1": None}


def test_one_read_calls_each_nvml_function_once_per_gpu() -> None:
    with opened({"count": 4}) as (nvml, collector):
        nvml.reset_counts()
        read(collector)
        for function in (
            "nvmlDeviceGetUtilizationRates",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetTotalEnergyConsumption",
            "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetCurrentClocksEventReasons",
        ):
            assert nvml.calls(function) == 4, function
        assert nvml.calls("nvmlDeviceGetClockInfo") == 8  # sm and memory
        assert nvml.calls("nvmlDeviceGetPcieThroughput") == 8  # transmit and receive


def test_values_follow_the_scenario_sequence_read_after_read() -> None:
    with opened({"count": 1, "sequences": {"0": {"utilization": [10, 20, 30]}}}) as (_, collector):
        seen = [by_gpu(read(collector), "hw.gpu.utilization")["0"] for _ in range(4)]
    assert seen == pytest.approx([0.1, 0.2, 0.3, 0.1])


def test_energy_is_monotonic_without_a_sequence() -> None:
    with opened({"count": 2}) as (_, collector):
        first, second = (by_gpu(read(collector), "hw.energy") for _ in range(2))
    assert all(second[gpu] > first[gpu] for gpu in first)


# --- failures --------------------------------------------------------------------------------


def test_unsupported_field_is_switched_off_for_that_gpu_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 4, "not_supported": {"1": ["power"]}}) as (nvml, collector):
        reads = [read(collector) for _ in range(3)]
        assert nvml.calls("nvmlDeviceGetPowerUsage", 1) == 1
        assert nvml.calls("nvmlDeviceGetPowerUsage", 0) == 3
        assert "not supported: power" in collector.describe()[1]
    for readings in reads:
        assert set(by_gpu(readings, "hw.power")) == {"0", "2", "3"}
        assert "1" in by_gpu(readings, "otel_forge.gpu.power.limit")  # the GPU's other fields go on
    assert len(messages(caplog, logging.DEBUG, "GPU 1: power not supported")) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_lost_gpu_reports_failed_and_the_others_go_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 4, "lost_after_reads": {"2": 1}}) as (nvml, collector):
        before = read(collector)
        during = read(collector)
        calls_after_loss = sum(count for (_, gpu), count in nvml.call_counts().items() if gpu == 2)
        after = read(collector)
        assert sum(count for (_, gpu), count in nvml.call_counts().items() if gpu == 2) == calls_after_loss
        assert "(failed)" in collector.describe()[2]

    assert by_gpu(before, "hw.status", **{"hw.state": "ok"})["2"] == 1
    for readings in (during, after):
        assert by_gpu(readings, "hw.status", **{"hw.state": "failed"}) == {"0": 0, "1": 0, "2": 1, "3": 0}
        assert by_gpu(readings, "hw.status", **{"hw.state": "ok"}) == {"0": 1, "1": 1, "2": 0, "3": 1}
        for metric in readings.metrics():
            if metric != "hw.status":
                assert "2" not in by_gpu(readings, metric), metric
        assert set(by_gpu(readings, "hw.gpu.utilization")) == {"0", "1", "3"}
    assert len(messages(caplog, logging.WARNING, "GPU 2")) == 1


def test_gpu_lost_before_start_is_reported_failed() -> None:
    with opened({"count": 3, "lost": ["1"]}) as (_, collector):
        readings = read(collector)
    assert by_gpu(readings, "hw.status", **{"hw.state": "failed"}) == {"0": 0, "1": 1, "2": 0}
    assert set(by_gpu(readings, "hw.power")) == {"0", "2"}


def test_other_errors_skip_the_field_this_read_and_warn_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 2, "errors": {"0": {"temperature": "Unknown"}}}) as (nvml, collector):
        reads = [read(collector) for _ in range(3)]
        assert nvml.calls("nvmlDeviceGetTemperature", 0) == 3  # not switched off: tried every read
    for readings in reads:
        assert set(by_gpu(readings, "hw.temperature")) == {"1"}
        assert by_gpu(readings, "hw.status", **{"hw.state": "ok"})["0"] == 1
    assert len(messages(caplog, logging.WARNING, "reading temperature failed")) == 1


def test_event_reasons_missing_in_the_driver_falls_back_to_throttle_reasons() -> None:
    scenario = {
        "count": 1,
        "errors": {"0": {"nvmlDeviceGetCurrentClocksEventReasons": "FunctionNotFound"}},
        "sequences": {"0": {"throttle": [4]}},
    }
    with opened(scenario) as (nvml, collector):
        readings = [read(collector) for _ in range(2)][-1]
        assert nvml.calls("nvmlDeviceGetCurrentClocksEventReasons") == 1
        assert nvml.calls("nvmlDeviceGetCurrentClocksThrottleReasons") == 2
    assert by_gpu(readings, "otel_forge.gpu.throttle", **{"otel_forge.gpu.throttle.reason": "sw_power_cap"}) == {"0": 1}


# --- opening ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "reason"),
    [
        ({"library_missing": True}, "libnvidia-ml.so.1) not found"),
        ({"driver_not_loaded": True}, "driver is not loaded"),
        ({"count": 0}, "NVML found no GPUs"),
        ({"count": 2, "nvidia": False}, "libnvidia-ml.so.1) not found"),
    ],
)
def test_unavailable_nvml_gives_the_reason(scenario: dict, reason: str) -> None:
    with fake_nvml(scenario) as nvml:
        with pytest.raises(CollectorUnavailable, match=reason.replace("(", r"\(").replace(")", r"\)")):
            NvidiaCollector.create(ForgeConfig.resolve(environ={}))
        assert nvml.initialized() == 0


def test_missing_nvidia_ml_py_gives_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    with pytest.raises(CollectorUnavailable, match="nvidia-ml-py is not installed"):
        NvidiaCollector.create(ForgeConfig.resolve(environ={}))


def test_gpus_setting_selects_by_index_and_uuid() -> None:
    with opened({"count": 4}, gpus="1,GPU-1a2b0003") as (_, collector):
        assert [gpu.index for gpu in collector.gpus] == [1, 3]
        assert set(by_gpu(read(collector), "hw.power")) == {"1", "3"}


def test_gpus_visible_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-1a2b0002,0")
    with opened({"count": 4}, gpus="visible") as (_, collector):
        assert [gpu.index for gpu in collector.gpus] == [2, 0]


def test_unknown_gpu_is_unavailable_and_nvml_shut_down() -> None:
    with fake_nvml({"count": 2}) as nvml:
        with pytest.raises(CollectorUnavailable, match="no GPU with index 9"):
            NvidiaCollector.create(ForgeConfig.resolve(environ={}, gpus="0,9"))
        assert nvml.initialized() == 0


def test_describe_is_one_line_per_gpu() -> None:
    with opened({"count": 2}) as (_, collector):
        assert collector.describe() == [
            "gpu 0: NVIDIA H100 80GB HBM3 GPU-1a2b0000-0000-4000-8000-000000000000 00000000:17:00.0",
            "gpu 1: NVIDIA H100 80GB HBM3 GPU-1a2b0001-0000-4000-8000-000000000001 00000000:27:00.0",
        ]


def test_close_shuts_nvml_down_once() -> None:
    with fake_nvml({"count": 1}) as nvml:
        collector = NvidiaCollector.create(ForgeConfig.resolve(environ={}))
        collector.close()
        collector.close()
        assert nvml.initialized() == 0
        assert nvml.calls("nvmlShutdown") == 1


# --- XID events ------------------------------------------------------------------------------


def xid_counts(collector: NvidiaCollector, expected: dict, timeout_s: float = 3.0) -> dict[tuple[str, str], float]:
    """The XID counts of a read, once they reach ``expected`` (the event thread counts them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = {
            (attrs["hw.id"], attrs["otel_forge.gpu.xid"]): value
            for attrs, value in read(collector).get("otel_forge.gpu.xid.errors")
        }
        if counts == expected or time.monotonic() > deadline:
            return counts
        time.sleep(0.02)


def xid_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "otel-forge-nvml-xid"]


def test_xid_events_are_counted_by_gpu_and_code_and_the_thread_ends_on_close(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidia, "XID_WAIT_MS", 500)  # the real wait: close() must still end it within ~1 s
    with fake_nvml({"count": 4, "xid_events": [[0, 79], [0, 79], [2, 13]]}) as nvml:
        collector = NvidiaCollector.create(ForgeConfig.resolve(environ={}))
        assert len(xid_threads()) == 1
        assert xid_counts(collector, {("0", "79"): 2, ("2", "13"): 1}) == {("0", "79"): 2, ("2", "13"): 1}
        nvml.inject_xid(3, 48)
        assert xid_counts(collector, {("0", "79"): 2, ("2", "13"): 1, ("3", "48"): 1})[("3", "48")] == 1

        collector.close()
        assert xid_threads() == []  # close() ended the thread blocked in nvmlEventSetWait
        assert nvml.calls("nvmlEventSetFree") == 1
        assert nvml.initialized() == 0


def test_gpu_without_event_support_is_not_watched() -> None:
    with opened({"count": 3, "not_supported": {"1": ["events"]}}) as (nvml, collector):
        assert collector.xid_watched == [0, 2]
        nvml.inject_xid(1, 79)
        nvml.inject_xid(2, 79)
        assert xid_counts(collector, {("2", "79"): 1}) == {("2", "79"): 1}


def test_xid_counts_carry_the_gpu_attributes() -> None:
    with opened({"count": 1, "xid_events": [[0, 31]]}) as (_, collector):
        xid_counts(collector, {("0", "31"): 1})
        ((attributes, value),) = read(collector).get("otel_forge.gpu.xid.errors")
    assert value == 1
    assert set(attributes) == set(SPECS["otel_forge.gpu.xid.errors"].attributes)


# --- throttle reasons and process memory -------------------------------------------------------


def test_throttle_reasons_are_decoded_one_reading_per_reason() -> None:
    with fake_nvml({"count": 1}) as nvml:
        mask = (
            nvml.nvmlClocksEventReasonGpuIdle
            | nvml.nvmlClocksEventReasonSwPowerCap
            | nvml.nvmlClocksEventReasonHwPowerBrakeSlowdown
        )
        nvml.configure({"count": 1, "sequences": {"0": {"throttle": [mask, 0]}}})
        collector = NvidiaCollector.create(ForgeConfig.resolve(environ={}))
        try:
            first, second = read(collector), read(collector)
        finally:
            collector.close()
    reasons = {a["otel_forge.gpu.throttle.reason"]: v for a, v in first.get("otel_forge.gpu.throttle")}
    assert set(reasons) == THROTTLE_REASONS
    assert {reason for reason, value in reasons.items() if value == 1} == {
        "gpu_idle",
        "sw_power_cap",
        "hw_power_brake_slowdown",
    }
    assert all(value == 0 for _, value in second.get("otel_forge.gpu.throttle"))


def test_hot_gpu_shows_thermal_throttling() -> None:
    with opened({"count": 1, "hot": True}) as (_, collector):
        readings = read(collector)
    active = {a["otel_forge.gpu.throttle.reason"] for a, v in readings.get("otel_forge.gpu.throttle") if v}
    assert active == {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    assert by_gpu(readings, "hw.temperature")["0"] >= 85


@pytest.fixture
def child_pid() -> Iterator[int]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child.pid
    finally:
        child.kill()
        child.wait()


def test_process_memory_sums_the_monitored_tree_only(child_pid: int) -> None:
    scenario = {
        "count": 2,
        "processes": {"0": [["self", 100 * MiB], [child_pid, 20 * MiB], [1, 999 * MiB], ["self", None]]},
    }
    with opened(scenario) as (_, collector):
        assert by_gpu(read(collector), "otel_forge.gpu.process.memory.usage") == {"0": 120 * MiB, "1": 0}
    with opened(scenario, pid=child_pid) as (_, collector):
        assert by_gpu(read(collector), "otel_forge.gpu.process.memory.usage") == {"0": 20 * MiB, "1": 0}


def test_process_memory_of_a_vanished_pid_is_not_reported_but_the_rest_is() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with opened({"count": 1}, pid=gone.pid) as (nvml, collector):
        readings = read(collector)
        assert nvml.calls("nvmlDeviceGetComputeRunningProcesses") == 0
    assert readings.get("otel_forge.gpu.process.memory.usage") == []
    assert by_gpu(readings, "hw.power") == {"0": pytest.approx(100.0)}
