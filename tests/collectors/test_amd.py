"""The AMD collector against the fake amdsmi (tests/fakes/amdsmi.py)."""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Any

import pytest
from collector_helpers import by_gpu, messages, opened_with, read

from otel_forge.collectors.amd import AmdCollector
from otel_forge.collectors.base import CollectorUnavailable
from otel_forge.config import ForgeConfig
from otel_forge.names import METRICS
from testkit.gpu_fakes import fake_amdsmi

LOGGER = "otel_forge.collectors.amd"
SPECS = {spec.name: spec for spec in METRICS if spec.source == "amd"}
MiB = 1024 * 1024


def opened(scenario: dict, **settings: Any) -> contextlib.AbstractContextManager[tuple[Any, AmdCollector]]:
    return opened_with(fake_amdsmi, AmdCollector, scenario, **settings)


def test_four_gpus_report_every_metric_with_units_and_attributes() -> None:
    scenario = {
        "count": 4,
        "sequences": {
            "0": {
                "gfx_activity": [30],
                "umc_activity": [12],
                "vram_total": [192 * 1024 * MiB],
                "vram_used": [48 * 1024 * MiB],
                "socket_power": [250],
                "power_limit": [750],
                "energy": [12345],
                "temperature_edge": [50],
                "temperature_hotspot": [66],
                "gfx_clock": [2100],
                "mem_clock": [1300],
                "ecc_correctable": [5],
                "ecc_uncorrectable": [1],
            }
        },
    }
    with opened(scenario) as (_, collector):
        readings = read(collector)

    assert set(readings.metrics()) == set(SPECS)
    for metric in readings.metrics():
        for attributes, _ in readings.get(metric):
            # amdsmi's bad pages carry no cause: retired pages have no error.type on AMD
            unknown_cause = {"error.type"} if metric == "otel_forge.gpu.memory.retired_pages" else set()
            assert set(attributes) == set(SPECS[metric].attributes) - unknown_cause, metric
    for metric in SPECS:
        assert set(by_gpu(readings, metric)) == {"0", "1", "2", "3"}, metric

    gpu0 = next(attrs for attrs, _ in readings.get("hw.power") if attrs["hw.id"] == "0")
    assert (gpu0["hw.vendor"], gpu0["hw.type"], gpu0["hw.name"]) == ("AMD", "gpu", "AMD Instinct MI300X")
    assert gpu0["otel_forge.gpu.uuid"] == "a1ff0000-0000-1000-80a9-000000000000"
    assert gpu0["otel_forge.gpu.pci_bus_id"] == "0000:0c:00.0"
    expected = {
        ("hw.gpu.utilization", (("hw.gpu.task", "general"),)): 0.30,
        ("otel_forge.gpu.memory.activity", ()): 0.12,
        ("hw.gpu.memory.usage", ()): 48 * 1024 * MiB,
        ("hw.gpu.memory.limit", ()): 192 * 1024 * MiB,
        ("hw.gpu.memory.utilization", ()): 0.25,
        ("hw.power", ()): 250.0,
        ("otel_forge.gpu.power.limit", ()): 750.0,
        ("otel_forge.gpu.power.utilization", ()): 250 / 750,
        ("hw.energy", ()): 12345.0,
        ("hw.temperature", (("hw.sensor_location", "edge"),)): 50,
        ("hw.temperature", (("hw.sensor_location", "hotspot"),)): 66,
        ("otel_forge.gpu.clock.frequency", (("otel_forge.gpu.clock", "sm"),)): 2100e6,
        ("otel_forge.gpu.clock.frequency", (("otel_forge.gpu.clock", "memory"),)): 1300e6,
        ("hw.errors", (("error.type", "corrected"),)): 5,
        ("hw.errors", (("error.type", "uncorrected"),)): 1,
        ("otel_forge.gpu.process.memory.usage", ()): 0,
        ("hw.status", (("hw.state", "ok"),)): 1,
        ("hw.status", (("hw.state", "failed"),)): 0,
    }
    for (metric, attributes), value in expected.items():
        assert by_gpu(readings, metric, **dict(attributes))["0"] == pytest.approx(value, rel=1e-6), metric


def test_power_limit_in_microwatts_and_the_old_energy_key_are_understood() -> None:
    scenario = {
        "count": 1,
        "power_limit_uw": True,
        "legacy_energy_key": True,
        "sequences": {"0": {"power_limit": [750], "energy": [500]}},
    }
    with opened(scenario) as (_, collector):
        readings = read(collector)
    assert by_gpu(readings, "otel_forge.gpu.power.limit") == {"0": 750.0}
    assert by_gpu(readings, "hw.energy")["0"] == pytest.approx(500.0, rel=1e-6)


def test_not_available_values_are_skipped_without_switching_the_field_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    scenario = {
        "count": 1,
        "sequences": {
            "0": {"gfx_activity": ["N/A", 40], "umc_activity": [0xFFFF], "ecc_correctable": [0xFFFFFFFFFFFFFFFF, 255]}
        },
    }
    with opened(scenario) as (amdsmi, collector):
        first, second = read(collector), read(collector)
        assert amdsmi.calls("amdsmi_get_gpu_activity") == 2
    assert first.get("hw.gpu.utilization") == []
    assert by_gpu(second, "hw.gpu.utilization") == {"0": 0.4}
    assert first.get("otel_forge.gpu.memory.activity") == second.get("otel_forge.gpu.memory.activity") == []
    assert "0" not in by_gpu(first, "hw.errors", **{"error.type": "corrected"})
    assert by_gpu(second, "hw.errors", **{"error.type": "corrected"}) == {"0": 255}  # a count, not "N/A"
    assert not [r for r in caplog.records if r.levelno >= logging.DEBUG]


def test_unsupported_field_is_switched_off_for_that_gpu_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 4, "not_supported": {"1": ["temperature_edge"]}}) as (amdsmi, collector):
        reads = [read(collector) for _ in range(3)]
        assert amdsmi.calls("amdsmi_get_temp_metric", 1) == 1 + 3 + 3  # edge once, hotspot and memory every read
        assert amdsmi.calls("amdsmi_get_temp_metric", 0) == 3 * 3
        assert "not supported: temperature_edge" in collector.describe()[1]
    for readings in reads:
        assert set(by_gpu(readings, "hw.temperature", **{"hw.sensor_location": "edge"})) == {"0", "2", "3"}
        assert set(by_gpu(readings, "hw.temperature", **{"hw.sensor_location": "hotspot"})) == {"0", "1", "2", "3"}
    assert len(messages(caplog, logging.DEBUG, "GPU 1: temperature_edge not supported")) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("lost_error", ["NOT_FOUND", "DRIVER_NOT_LOADED", "AMDGPU_RESTART_ERR"])
def test_lost_gpu_reports_failed_and_the_others_go_on(caplog: pytest.LogCaptureFixture, lost_error: str) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 3, "lost_after_reads": {"1": 1}, "lost_error": lost_error}) as (amdsmi, collector):
        before, during = read(collector), read(collector)
        calls_after_loss = sum(count for (_, gpu), count in amdsmi.call_counts().items() if gpu == 1)
        after = read(collector)
        assert sum(count for (_, gpu), count in amdsmi.call_counts().items() if gpu == 1) == calls_after_loss
    assert by_gpu(before, "hw.status", **{"hw.state": "ok"}) == {"0": 1, "1": 1, "2": 1}
    for readings in (during, after):
        assert by_gpu(readings, "hw.status", **{"hw.state": "failed"}) == {"0": 0, "1": 1, "2": 0}
        assert by_gpu(readings, "hw.status", **{"hw.state": "ok"}) == {"0": 1, "1": 0, "2": 1}
        for metric in readings.metrics():
            if metric != "hw.status":
                assert "1" not in by_gpu(readings, metric), metric
        assert set(by_gpu(readings, "hw.power")) == {"0", "2"}
    assert len(messages(caplog, logging.WARNING, "GPU 1")) == 1


def test_other_errors_skip_the_field_this_read_and_warn_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 2, "errors": {"0": {"power": "BUSY"}}}) as (amdsmi, collector):
        reads = [read(collector) for _ in range(3)]
        assert amdsmi.calls("amdsmi_get_power_info", 0) == 3
    for readings in reads:
        assert set(by_gpu(readings, "hw.power")) == {"1"}
    assert len(messages(caplog, logging.WARNING, "reading power failed")) == 1


def test_amdsmi_import_noise_never_reaches_stdout(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with fake_amdsmi({"import_error": True}):
        with pytest.raises(CollectorUnavailable, match="amdsmi cannot be loaded .KeyError"):
            AmdCollector.create(ForgeConfig.resolve(environ={}))
        print("stdout still works")
        assert "amdsmi" not in sys.modules
    assert capfd.readouterr().out == "stdout still works\n"
    printed = " ".join(messages(caplog, logging.DEBUG, "amdsmi printed"))
    assert "Unable to find amdsmi library" in printed and "Unable to load libamd_smi.so" in printed


def test_missing_amdsmi_package_gives_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)
    with pytest.raises(CollectorUnavailable, match="amdsmi is not installed"):
        AmdCollector.create(ForgeConfig.resolve(environ={}))


@pytest.mark.parametrize(
    ("scenario", "reason"),
    [
        ({"init_error": "DRIVER_NOT_LOADED"}, "amdsmi failed to initialise: .*34"),
        ({"count": 0}, "amdsmi found no GPUs"),
    ],
)
def test_unavailable_amdsmi_gives_the_reason(scenario: dict, reason: str) -> None:
    with fake_amdsmi(scenario) as amdsmi:
        with pytest.raises(CollectorUnavailable, match=reason):
            AmdCollector.create(ForgeConfig.resolve(environ={}))
        assert amdsmi.initialized() == 0


def test_gpus_visible_follows_rocr_then_hip(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROCR_VISIBLE_DEVICES", "a1ff0002,1")
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "0")
    with opened({"count": 4}, gpus="visible") as (_, collector):
        assert [gpu.index for gpu in collector.gpus] == [2, 1]
        assert set(by_gpu(read(collector), "hw.power")) == {"1", "2"}


def test_unknown_gpu_is_unavailable_and_amdsmi_shut_down() -> None:
    with fake_amdsmi({"count": 2}) as amdsmi:
        with pytest.raises(CollectorUnavailable, match="no GPU with UUID ffff"):
            AmdCollector.create(ForgeConfig.resolve(environ={}, gpus="ffff"))
        assert amdsmi.initialized() == 0


def test_process_memory_sums_the_monitored_pids() -> None:
    scenario = {"count": 2, "processes": {"0": [["self", 100 * MiB], [1, 999 * MiB]], "1": [[1, 5 * MiB]]}}
    with opened(scenario) as (_, collector):
        assert by_gpu(read(collector), "otel_forge.gpu.process.memory.usage") == {"0": 100 * MiB, "1": 0}


def test_describe_and_close() -> None:
    with fake_amdsmi({"count": 2}) as amdsmi:
        collector = AmdCollector.create(ForgeConfig.resolve(environ={}))
        assert collector.describe() == [
            "gpu 0: AMD Instinct MI300X a1ff0000-0000-1000-80a9-000000000000 0000:0c:00.0",
            "gpu 1: AMD Instinct MI300X a1ff0001-0000-1000-80a9-000000000001 0000:1c:00.0",
        ]
        collector.close()
        collector.close()
        assert amdsmi.initialized() == 0
        assert amdsmi.calls("amdsmi_shut_down") == 1


def test_vendor_keys_of_a_shared_scenario_apply_to_their_fake_only() -> None:
    scenario = {"count": 3, "amd": {"count": 1}, "nvidia": False}
    with opened(scenario) as (_, collector):
        assert [gpu.index for gpu in collector.gpus] == [0]
    with fake_amdsmi({"count": 3, "amd": False}) as amdsmi:
        assert amdsmi is None
        with pytest.raises(CollectorUnavailable, match="KeyError"):
            AmdCollector.create(ForgeConfig.resolve(environ={}))


# --- what AMD gives of the GPU-depth readings (issue 14) ---------------------------------------------


def test_memory_temperature_xgmi_traffic_replays_violations_and_bad_pages() -> None:
    scenario = {
        "count": 2,
        "violations": {"0": ["ppt_pwr"]},
        "bad_pages": {"0": {"reserved": 2, "pending": 1}},
        "sequences": {"0": {"temperature_vram": [77], "xgmi_read": [3000], "xgmi_write": [1000], "pcie_replays": [9]}},
    }
    with opened(scenario) as (_, collector):
        readings = read(collector)
    assert by_gpu(readings, "hw.temperature", **{"hw.sensor_location": "memory"})["0"] == 77
    xgmi = {"otel_forge.gpu.link": "xgmi"}
    assert by_gpu(readings, "hw.gpu.io", **xgmi, **{"network.io.direction": "receive"})["0"] == 3000 * 1024
    assert by_gpu(readings, "hw.gpu.io", **xgmi, **{"network.io.direction": "transmit"})["0"] == 1000 * 1024
    assert by_gpu(readings, "otel_forge.gpu.pcie.replays")["0"] == 9
    throttle = readings.get("otel_forge.gpu.throttle")
    reasons = {a["otel_forge.gpu.throttle.reason"]: v for a, v in throttle if a["hw.id"] == "0"}
    assert reasons == {"ppt_power": 1, "socket_thermal": 0, "prochot_thermal": 0, "vr_thermal": 0, "hbm_thermal": 0}
    assert by_gpu(readings, "otel_forge.gpu.memory.retired_pages") == {"0": 2, "1": 0}
    assert by_gpu(readings, "otel_forge.gpu.memory.retirement.pending") == {"0": 1, "1": 0}
    assert by_gpu(readings, "hw.errors", **{"error.type": "deferred"}) == {"0": 0, "1": 0}
    # NVML-only readings are absent on AMD
    nvml_only = ("otel_forge.gpu.memory.remap.failed", "otel_forge.gpu.violation.time", "otel_forge.gpu.nvlink.errors")
    for metric in nvml_only:
        assert readings.get(metric) == [], metric


def test_a_gpu_without_xgmi_or_violation_status_leaves_those_out_quietly(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({"count": 2, "no_xgmi": True, "not_supported": {"1": ["violation"]}}) as (amdsmi, collector):
        readings = [read(collector) for _ in range(3)][-1]
        assert amdsmi.calls("amdsmi_get_violation_status", 1) == 1
    assert readings.get("hw.gpu.io") == []
    assert set(by_gpu(readings, "otel_forge.gpu.throttle")) == {"0"}
    assert set(by_gpu(readings, "otel_forge.gpu.pcie.replays")) == {"0", "1"}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_hot_amd_gpu_shows_thermal_violations() -> None:
    with opened({"count": 1, "hot": True}) as (_, collector):
        readings = read(collector)
    active = {a["otel_forge.gpu.throttle.reason"] for a, v in readings.get("otel_forge.gpu.throttle") if v}
    assert active == {"socket_thermal", "hbm_thermal"}
