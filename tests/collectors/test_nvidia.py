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

from otel_forge.collectors import nvidia
from otel_forge.collectors.base import CollectorUnavailable
from otel_forge.collectors.nvidia import NvidiaCollector
from otel_forge.config import ForgeConfig
from otel_forge.names import METRICS, MIG_ATTRIBUTES
from testkit.gpu_fakes import fake_nvml

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
                "encoder": [7],
                "decoder": [42],
                "memory_temperature": [71],
                "nvlink_tx": [3 * MiB],
                "nvlink_rx": [5 * MiB],
                "nvlink_crc_flit": [4],
                "nvlink_crc_data": [3],
                "nvlink_replay": [2],
                "nvlink_recovery": [1],
                "pcie_replays": [17],
                "remapped_corrected": [6],
                "remapped_uncorrected": [2],
                "remap_pending": [1],
                "remap_failure": [0],
                "retired_sbe": [3],
                "retired_dbe": [1],
                "retired_pending": [1],
                "power_violation": [2_500_000_000],
                "thermal_violation": [500_000_000],
            }
        },
    }
    with opened(scenario) as (_, collector):
        readings = read(collector)

    # No XID event yet; GPM is off unless a scenario turns it on (tests/collectors/test_gpm.py).
    gpm = {
        "otel_forge.gpu.sm.activity",
        "otel_forge.gpu.sm.occupancy",
        "otel_forge.gpu.pipe.activity",
        "otel_forge.gpu.dram.activity",
        "otel_forge.gpu.io.rate",
    }
    assert set(readings.metrics()) == set(SPECS) - {"otel_forge.gpu.xid.errors"} - gpm
    for metric in readings.metrics():  # attribute keys exactly as names.py declares them
        for attributes, _ in readings.get(metric):  # a whole GPU: no MIG attribute
            assert set(attributes) == set(SPECS[metric].attributes) - set(MIG_ATTRIBUTES), metric
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
        ("hw.gpu.utilization", (("hw.gpu.task", "general"),)): 0.30,
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
        # PCIe: a byte counter from throughputs, 0 at the first read; NVLink: NVML's KiB counters
        ("hw.gpu.io", (("otel_forge.gpu.link", "pcie"), ("network.io.direction", "transmit"))): 0,
        ("hw.gpu.io", (("otel_forge.gpu.link", "pcie"), ("network.io.direction", "receive"))): 0,
        ("hw.gpu.io", (("otel_forge.gpu.link", "nvlink"), ("network.io.direction", "transmit"))): 3 * 1024 * MiB,
        ("hw.gpu.io", (("otel_forge.gpu.link", "nvlink"), ("network.io.direction", "receive"))): 5 * 1024 * MiB,
        ("hw.errors", (("error.type", "corrected"),)): 5,
        ("hw.errors", (("error.type", "uncorrected"),)): 1,
        ("hw.gpu.utilization", (("hw.gpu.task", "encoder"),)): 0.07,
        ("hw.gpu.utilization", (("hw.gpu.task", "decoder"),)): 0.42,
        ("hw.temperature", (("hw.sensor_location", "memory"),)): 71,
        ("otel_forge.gpu.nvlink.errors", (("error.type", "crc_flit"),)): 4,
        ("otel_forge.gpu.nvlink.errors", (("error.type", "crc_data"),)): 3,
        ("otel_forge.gpu.nvlink.errors", (("error.type", "replay"),)): 2,
        ("otel_forge.gpu.nvlink.errors", (("error.type", "recovery"),)): 1,
        ("otel_forge.gpu.pcie.replays", ()): 17,
        ("otel_forge.gpu.memory.remapped_rows", (("error.type", "corrected"),)): 6,
        ("otel_forge.gpu.memory.remapped_rows", (("error.type", "uncorrected"),)): 2,
        ("otel_forge.gpu.memory.remap.pending", ()): 1,
        ("otel_forge.gpu.memory.remap.failed", ()): 0,
        ("otel_forge.gpu.memory.retired_pages", (("error.type", "corrected"),)): 3,
        ("otel_forge.gpu.memory.retired_pages", (("error.type", "uncorrected"),)): 1,
        ("otel_forge.gpu.memory.retirement.pending", ()): 1,
        ("otel_forge.gpu.violation.time", (("otel_forge.gpu.violation", "power"),)): 2.5,
        ("otel_forge.gpu.violation.time", (("otel_forge.gpu.violation", "thermal"),)): 0.5,
        ("otel_forge.gpu.process.memory.usage", ()): 0,
        ("hw.status", (("hw.state", "ok"),)): 1,
        ("hw.status", (("hw.state", "failed"),)): 0,
    }
    for (metric, attributes), value in expected.items():
        assert by_gpu(readings, metric, **dict(attributes))["0"] == pytest.approx(value), (metric, attributes)
    assert by_gpu(readings, "hw.gpu.utilization", **{"hw.gpu.task": "general"})["0"] == 0.30
    assert {a["hw.gpu.task"] for a, _ in readings.get("hw.gpu.utilization")} == {"general", "encoder", "decoder"}


def test_pcie_bytes_add_the_mean_throughput_times_the_time_between_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([100.0, 100.0, 102.0, 102.0, 112.0, 112.0])  # tx, rx at each of three reads
    monkeypatch.setattr(nvidia.time, "monotonic", lambda: next(clock))
    scenario = {"count": 1, "sequences": {"0": {"pcie_tx": [1000, 3000, 3000], "pcie_rx": [0, 0, 500]}}}
    pcie = {"otel_forge.gpu.link": "pcie"}
    with opened(scenario, gpus="all") as (_, collector):
        totals = [
            (
                by_gpu(readings, "hw.gpu.io", **pcie, **{"network.io.direction": "transmit"})["0"],
                by_gpu(readings, "hw.gpu.io", **pcie, **{"network.io.direction": "receive"})["0"],
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


# NVML calls per whole GPU per read, as the README states: each one once, but the clocks (sm, memory)
# and the PCIe throughput (transmit, receive) twice; every field-id reading is in the one batch.
CALLS_PER_GPU = {
    "nvmlDeviceGetUtilizationRates": 1,
    "nvmlDeviceGetEncoderUtilization": 1,
    "nvmlDeviceGetDecoderUtilization": 1,
    "nvmlDeviceGetMemoryInfo": 1,
    "nvmlDeviceGetPowerUsage": 1,
    "nvmlDeviceGetEnforcedPowerLimit": 1,
    "nvmlDeviceGetTemperature": 1,
    "nvmlDeviceGetClockInfo": 2,
    "nvmlDeviceGetPcieThroughput": 2,
    "nvmlDeviceGetCurrentClocksEventReasons": 1,
    "nvmlDeviceGetComputeRunningProcesses": 1,
    "nvmlDeviceGetFieldValues": 1,
}


def test_one_read_is_14_nvml_calls_per_gpu_every_field_id_in_one_batch() -> None:
    with opened({"count": 4}) as (nvml, collector):
        read(collector)  # the first read: nothing switched off yet either way
        nvml.reset_counts()
        read(collector)
        counts = nvml.call_counts()
    assert sum(CALLS_PER_GPU.values()) == 14
    for gpu in range(4):
        assert {function: n for (function, index), n in counts.items() if index == gpu} == CALLS_PER_GPU, gpu
    assert {function for function, index in counts if index is None} <= {"nvmlEventSetWait_v2"}  # the XID thread
    for function in ("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTotalEccErrors"):
        assert nvml.calls(function) == 0, function  # in the batch


def test_the_batch_asks_for_every_field_id_once_and_nvlink_over_all_links() -> None:
    with fake_nvml({"count": 1}) as nvml:
        asked: list[list] = []
        real_call = nvml.nvmlDeviceGetFieldValues

        def spy(handle: Any, field_ids: list) -> Any:
            asked.append(list(field_ids))
            return real_call(handle, field_ids)

        nvml.nvmlDeviceGetFieldValues = spy
        try:
            collector = NvidiaCollector.create(ForgeConfig.resolve(environ={}))
            try:
                read(collector)
            finally:
                collector.close()
        finally:
            nvml.nvmlDeviceGetFieldValues = real_call
    ((ids,),) = [asked]
    assert len({field_id for field_id, _ in ids}) == len(ids) == 20
    scopes = dict(ids)
    assert scopes[nvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX] == 0xFFFFFFFF
    assert scopes[nvml.NVML_FI_DEV_MEMORY_TEMP] == 0


def test_values_follow_the_scenario_sequence_read_after_read() -> None:
    with opened({"count": 1, "sequences": {"0": {"utilization": [10, 20, 30]}}}) as (_, collector):
        seen = [by_gpu(read(collector), "hw.gpu.utilization", **{"hw.gpu.task": "general"})["0"] for _ in range(4)]
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
        assert set(by_gpu(readings, "hw.temperature", **{"hw.sensor_location": "gpu"})) == {"1"}
        assert set(by_gpu(readings, "hw.temperature", **{"hw.sensor_location": "memory"})) == {"0", "1"}
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


def test_describe_is_one_line_per_gpu_and_one_for_gpm() -> None:
    with opened({"count": 2}) as (_, collector):
        assert collector.describe() == [
            "gpu 0: NVIDIA H100 80GB HBM3 GPU-1a2b0000-0000-4000-8000-000000000000 00000000:17:00.0",
            "gpu 1: NVIDIA H100 80GB HBM3 GPU-1a2b0001-0000-4000-8000-000000000001 00000000:27:00.0",
            "GPM: not supported (driver/GPU)",  # the fake's GPM is off unless the scenario turns it on
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


# --- the field-values batch: each field on its own --------------------------------------------------


def test_a_batch_field_not_supported_on_one_gpu_is_absent_there_only_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 3, "not_supported": {"1": ["memory_temperature", "nvlink_io"]}}) as (nvml, collector):
        reads = [read(collector) for _ in range(3)]
        assert nvml.calls("nvmlDeviceGetFieldValues", 1) == 3  # the batch goes on for the rest
        assert "not supported: memory_temperature, nvlink_io" in collector.describe()[1]
    memory = {"hw.sensor_location": "memory"}
    for readings in reads:
        assert set(by_gpu(readings, "hw.temperature", **memory)) == {"0", "2"}
        assert set(by_gpu(readings, "hw.gpu.io", **{"otel_forge.gpu.link": "nvlink"})) == {"0", "2"}
        assert set(by_gpu(readings, "otel_forge.gpu.pcie.replays")) == {"0", "1", "2"}  # its other fields go on
        assert set(by_gpu(readings, "hw.energy")) == {"0", "1", "2"}
    assert len(messages(caplog, logging.DEBUG, "GPU 1: memory_temperature not supported")) == 1
    assert len(messages(caplog, logging.DEBUG, "GPU 1: nvlink_io not supported")) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_pcie_only_board_has_no_nvlink_readings_and_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 2, "no_nvlink": True}) as (_, collector):
        readings = [read(collector) for _ in range(2)][-1]
    assert readings.get("otel_forge.gpu.nvlink.errors") == []
    assert {a["otel_forge.gpu.link"] for a, _ in readings.get("hw.gpu.io")} == {"pcie"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_an_error_in_one_batch_entry_skips_that_field_this_read_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 2, "errors": {"0": {"row_remapping": "Unknown"}}}) as (_, collector):
        reads = [read(collector) for _ in range(3)]
        assert "not supported" not in collector.describe()[0]  # not switched off
    for readings in reads:
        assert set(by_gpu(readings, "otel_forge.gpu.memory.remap.failed")) == {"1"}
        assert set(by_gpu(readings, "hw.temperature", **{"hw.sensor_location": "memory"})) == {"0", "1"}
    assert len(messages(caplog, logging.WARNING, "GPU 0: reading row_remapping failed")) == 1


def test_the_whole_batch_unsupported_switches_off_its_fields_only() -> None:
    with opened({"count": 1, "not_supported": {"0": ["field_values"]}}) as (nvml, collector):
        readings = [read(collector) for _ in range(2)][-1]
        assert nvml.calls("nvmlDeviceGetFieldValues") == 1
    assert readings.get("hw.energy") == [] and readings.get("otel_forge.gpu.pcie.replays") == []
    assert by_gpu(readings, "hw.power") == {"0": pytest.approx(105.0)}


def test_a_gpu_lost_mid_run_stops_its_batch_and_reports_failed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 2}) as (nvml, collector):
        before = read(collector)
        nvml.lose_gpu(1)
        during, after = read(collector), read(collector)
        assert nvml.calls("nvmlDeviceGetFieldValues", 1) == 1  # only the read before the loss got that far
    assert set(by_gpu(before, "otel_forge.gpu.memory.remap.failed")) == {"0", "1"}
    for readings in (during, after):
        assert by_gpu(readings, "hw.status", **{"hw.state": "failed"}) == {"0": 0, "1": 1}
        for metric in readings.metrics():
            if metric != "hw.status":
                assert "1" not in by_gpu(readings, metric), metric
    assert len(messages(caplog, logging.WARNING, "GPU 1 (")) == 1


def test_degraded_memory_and_links_show_in_the_readings() -> None:
    with opened({"count": 1, "degraded": True}) as (_, collector):
        first, second = read(collector), read(collector)
    assert by_gpu(second, "otel_forge.gpu.memory.remap.failed") == {"0": 1}
    assert by_gpu(second, "otel_forge.gpu.memory.remap.pending") == {"0": 1}
    assert by_gpu(second, "otel_forge.gpu.pcie.replays")["0"] > by_gpu(first, "otel_forge.gpu.pcie.replays")["0"]
    crc = {"error.type": "crc_flit"}
    assert by_gpu(second, "otel_forge.gpu.nvlink.errors", **crc)["0"] > 0


# --- MIG -----------------------------------------------------------------------------------------------

MIG = {"count": 2, "mig": {"0": ["1g.10gb", "3g.40gb"]}}
MIG_UUID = "MIG-3c4d0002-0000-4000-8000-000000000002"  # GPU 0's second instance (GPU instance 2)


def test_each_mig_instance_is_a_device_with_its_gpu_as_parent() -> None:
    with opened(MIG) as (_, collector):
        assert [gpu.key for gpu in collector.gpus] == [0, "0_mig1", "0_mig2", 1]
        readings = read(collector)
    limits = by_gpu(readings, "hw.gpu.memory.limit")
    assert limits == {"0": 80 * 1024 * MiB, "0_mig1": 10 * 1024 * MiB, "0_mig2": 40 * 1024 * MiB, "1": 80 * 1024 * MiB}
    instance = next(a for a, _ in readings.get("hw.gpu.memory.usage") if a["hw.id"] == "0_mig2")
    assert instance["hw.parent"] == "0" and instance["otel_forge.gpu.mig.instance"] == "2"
    assert instance["otel_forge.gpu.uuid"] == MIG_UUID
    assert instance["hw.name"] == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    for metric in readings.metrics():  # a MIG instance: memory and status; no whole-GPU reading
        for attributes, _ in readings.get(metric):
            if "hw.parent" in attributes:
                assert metric in {
                    "hw.gpu.memory.usage",
                    "hw.gpu.memory.limit",
                    "hw.gpu.memory.utilization",
                    "hw.status",
                }, metric
                assert set(attributes) <= set(SPECS[metric].attributes), metric
    assert "0_mig1" not in by_gpu(readings, "hw.power") and "0" in by_gpu(readings, "hw.power")


def test_mig_utilization_is_read_where_nvml_gives_it() -> None:
    with opened({**MIG, "mig_utilization": True, "sequences": {"0_mig1": {"utilization": [55]}}}) as (_, collector):
        readings = read(collector)
    assert by_gpu(readings, "hw.gpu.utilization", **{"hw.gpu.task": "general"})["0_mig1"] == pytest.approx(0.55)


def test_mig_utilization_not_supported_is_switched_off_for_the_instances(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened(MIG) as (nvml, collector):
        read(collector)
        nvml.reset_counts()
        read(collector)
        assert nvml.calls(None, "0_mig1") == 1  # memory only, from now on
        assert "not supported: utilization" in collector.describe()[1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_mig_instances_are_enumerated_once_not_per_read() -> None:
    with opened(MIG) as (nvml, collector):
        nvml.reset_counts()
        read(collector)
        read(collector)
        assert nvml.calls("nvmlDeviceGetMigMode") == 0
        assert nvml.calls("nvmlDeviceGetMigDeviceHandleByIndex") == 0


@pytest.mark.parametrize(
    ("gpus", "selected"),
    [
        (MIG_UUID, ["0_mig2"]),
        (MIG_UUID.lower(), ["0_mig2"]),
        ("MIG-3c4d0001", ["0_mig1"]),  # a prefix, as CUDA takes one
        ("0", [0, "0_mig1", "0_mig2"]),  # a GPU brings its instances
        ("GPU-1a2b0000", [0, "0_mig1", "0_mig2"]),
        (f"1,{MIG_UUID}", [1, "0_mig2"]),
    ],
)
def test_gpus_setting_understands_mig_uuids(gpus: str, selected: list) -> None:
    with opened(MIG, gpus=gpus) as (_, collector):
        assert [gpu.key for gpu in collector.gpus] == selected
        assert set(by_gpu(read(collector), "hw.status")) == {str(key) for key in selected}


def test_cuda_visible_devices_naming_a_mig_instance_selects_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_UUID)
    with opened(MIG, gpus="visible") as (_, collector):
        assert [gpu.key for gpu in collector.gpus] == ["0_mig2"]
        assert collector.xid_watched == []  # XID events are a whole GPU's


def test_a_mig_uuid_that_matches_nothing_is_unavailable() -> None:
    with fake_nvml(MIG) as nvml:
        with pytest.raises(CollectorUnavailable, match="no GPU with UUID MIG-ffff"):
            NvidiaCollector.create(ForgeConfig.resolve(environ={}, gpus="MIG-ffff"))
        assert nvml.initialized() == 0


def test_a_mig_instance_of_a_lost_gpu_reports_failed() -> None:
    with opened(MIG) as (nvml, collector):
        read(collector)
        nvml.lose_gpu(0)
        readings = read(collector)
    failed = by_gpu(readings, "hw.status", **{"hw.state": "failed"})
    assert failed == {"0": 1, "0_mig1": 1, "0_mig2": 1, "1": 0}
