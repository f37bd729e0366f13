"""NVML GPM (GPU Performance Monitoring) in the NVIDIA collector, against the fake pynvml.

Two samples per device, one ``nvmlGpmMetricsGet`` per device per read, the first read only primes;
a device without GPM is said once in ``describe`` and costs nothing else.
"""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace
from typing import Any

import pytest
from collector_helpers import by_gpu, messages, opened_with, read

from otel_forge.collectors import nvidia
from otel_forge.collectors.base import Readings
from otel_forge.collectors.nvidia import NvidiaCollector
from otel_forge.mlflow.keys import KeyMapper
from otel_forge.names import METRICS, MIG_ATTRIBUTES
from testkit.gpu_fakes import fake_nvml

LOGGER = "otel_forge.collectors.nvidia"
GPM_METRICS = {
    "otel_forge.gpu.sm.activity",
    "otel_forge.gpu.sm.occupancy",
    "otel_forge.gpu.pipe.activity",
    "otel_forge.gpu.dram.activity",
    "otel_forge.gpu.io.rate",
}
SPECS = {spec.name: spec for spec in METRICS if spec.source == "nvidia"}
MiB = 1024 * 1024
H100 = {"count": 2, "gpm": True}
A100 = {"count": 2, "gpm": True, "name": "NVIDIA A100-SXM4-80GB"}
MIG = {"count": 2, "gpm": True, "mig": {"0": ["1g.10gb", "3g.40gb"]}}
PCIE_TX = {"otel_forge.gpu.link": "pcie", "network.io.direction": "transmit"}
PCIE_RX = {"otel_forge.gpu.link": "pcie", "network.io.direction": "receive"}
NVLINK_TX = {"otel_forge.gpu.link": "nvlink", "network.io.direction": "transmit"}
NVLINK_RX = {"otel_forge.gpu.link": "nvlink", "network.io.direction": "receive"}


@pytest.fixture(autouse=True)
def short_xid_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvidia, "XID_WAIT_MS", 50)


def opened(scenario: dict, **settings: Any) -> contextlib.AbstractContextManager[tuple[Any, NvidiaCollector]]:
    return opened_with(fake_nvml, NvidiaCollector, scenario, **settings)


def gpm_metrics(readings: Readings) -> set[str]:
    return set(readings.metrics()) & GPM_METRICS


def pipes(readings: Readings, gpu: str) -> dict[str, float]:
    return {
        attrs["otel_forge.gpu.pipe"]: value
        for attrs, value in readings.get("otel_forge.gpu.pipe.activity")
        if attrs["hw.id"] == gpu
    }


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# --- a GPU with GPM ----------------------------------------------------------------------------


def test_the_first_read_primes_and_the_second_has_every_gpm_metric() -> None:
    sequences = {
        "sm_activity": [62.5],
        "sm_occupancy": [31],
        "tensor_activity": [48],
        "fp64_activity": [0],
        "fp32_activity": [12],
        "fp16_activity": [3],
        "dram_activity": [71],
        "gpm_pcie_tx": [1500],
        "gpm_pcie_rx": [250],
        "gpm_nvlink_tx": [90_000],
        "gpm_nvlink_rx": [80_000],
    }
    with opened({**H100, "sequences": {"0": sequences}}) as (_, collector):
        first, second = read(collector), read(collector)

    assert gpm_metrics(first) == set()  # primed only: no value, never a made-up 0
    assert gpm_metrics(second) == GPM_METRICS
    assert by_gpu(second, "otel_forge.gpu.sm.activity")["0"] == pytest.approx(0.625)
    assert by_gpu(second, "otel_forge.gpu.sm.occupancy")["0"] == pytest.approx(0.31)
    assert by_gpu(second, "otel_forge.gpu.dram.activity")["0"] == pytest.approx(0.71)
    assert pipes(second, "0") == pytest.approx({"tensor": 0.48, "fp64": 0.0, "fp32": 0.12, "fp16": 0.03})
    io = {
        name: by_gpu(second, "otel_forge.gpu.io.rate", **attributes)["0"]
        for name, attributes in (
            ("pcie_tx", PCIE_TX),
            ("pcie_rx", PCIE_RX),
            ("nvlink_tx", NVLINK_TX),
            ("nvlink_rx", NVLINK_RX),
        )
    }
    assert io == {"pcie_tx": 1500 * MiB, "pcie_rx": 250 * MiB, "nvlink_tx": 90_000 * MiB, "nvlink_rx": 80_000 * MiB}
    for metric in GPM_METRICS:  # attribute keys exactly as names.py declares them (a whole GPU: no MIG ones)
        for attributes, _ in second.get(metric):
            assert set(attributes) == set(SPECS[metric].attributes) - set(MIG_ATTRIBUTES), metric
    assert set(by_gpu(second, "otel_forge.gpu.sm.activity")) == {"0", "1"}


def test_each_read_reports_the_pair_of_its_own_interval() -> None:
    # The fake's default: sm activity (40 + 10 * gpu + 3 * n) % 101 for the pair ending at sample n.
    with opened(H100) as (_, collector):
        reads = [by_gpu(read(collector), "otel_forge.gpu.sm.activity") for _ in range(4)]
    assert reads[0] == {}
    assert reads[1:] == [
        pytest.approx({"0": 0.43, "1": 0.53}),
        pytest.approx({"0": 0.46, "1": 0.56}),
        pytest.approx({"0": 0.49, "1": 0.59}),
    ]


def test_one_metrics_call_and_one_sample_per_gpu_per_read_and_two_samples_alive() -> None:
    with opened({**H100, "count": 4}) as (nvml, collector):
        assert nvml.gpm_samples_alive() == 8  # two per GPU, from the start
        assert nvml.calls("nvmlGpmSampleAlloc") == 8
        read(collector)
        assert nvml.calls("nvmlGpmMetricsGet") == 0  # the priming read
        for _ in range(3):
            nvml.reset_counts()
            read(collector)
            for gpu in range(4):
                assert nvml.calls("nvmlGpmMetricsGet", gpu) == 1, gpu
                assert nvml.calls("nvmlGpmSampleGet", gpu) == 1, gpu
            assert nvml.calls("nvmlGpmSampleAlloc") == 0
            assert nvml.gpm_samples_alive() == 8
        collector.close()
        assert nvml.gpm_samples_alive() == 0  # freed at close
        assert nvml.calls("nvmlGpmSampleFree") == 8


def test_a_board_without_nvlink_has_pcie_rates_only_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({**H100, "no_nvlink": True}) as (_, collector):
        readings = [read(collector) for _ in range(3)][-1]
        assert "not supported: gpm_nvlink_io" in collector.describe()[0]
        assert collector.describe()[-1] == "GPM: on for gpu 0, 1"
    assert {a["otel_forge.gpu.link"] for a, _ in readings.get("otel_forge.gpu.io.rate")} == {"pcie"}
    assert set(by_gpu(readings, "otel_forge.gpu.sm.activity")) == {"0", "1"}
    assert len(messages(caplog, logging.DEBUG, "GPU 0: gpm_nvlink_io not supported")) == 1
    assert warnings_of(caplog) == []


def test_a_metric_not_supported_is_left_out_of_the_next_request() -> None:
    with opened({**H100, "not_supported": {"0": ["NVML_GPM_METRIC_FP64_UTIL"]}}) as (_, collector):
        readings = [read(collector) for _ in range(3)]
        assert "not supported: gpm_fp64_activity" in collector.describe()[0]
    assert set(pipes(readings[-1], "0")) == {"tensor", "fp32", "fp16"}
    assert set(pipes(readings[-1], "1")) == {"tensor", "fp64", "fp32", "fp16"}


# --- a GPU without GPM ---------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", [A100, {"count": 2}], ids=["pre-hopper", "gpm-off"])
def test_a_gpu_without_gpm_has_no_gpm_series_one_describe_line_and_no_warning(
    scenario: dict, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened(scenario) as (nvml, collector):
        reads = [read(collector) for _ in range(3)]
        lines = collector.describe()
        assert nvml.calls("nvmlGpmQueryDeviceSupport") == 2  # asked once per GPU, at open
        assert nvml.calls("nvmlGpmSampleGet") == nvml.calls("nvmlGpmMetricsGet") == 0
        assert nvml.calls("nvmlGpmSampleAlloc") == 0
    assert all(gpm_metrics(readings) == set() for readings in reads)
    assert [line for line in lines if "GPM" in line] == ["GPM: not supported (driver/GPU)"]
    assert lines[:2] == [line.split(" (not supported")[0] for line in lines[:2]]  # the GPU lines unchanged
    assert set(by_gpu(reads[-1], "hw.power")) == {"0", "1"}  # nothing else changes
    assert warnings_of(caplog) == []


def test_the_support_query_raising_not_supported_turns_gpm_off_on_that_gpu_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened({**H100, "not_supported": {"1": ["gpm"]}}) as (nvml, collector):
        readings = [read(collector) for _ in range(2)][-1]
        assert collector.describe()[-1] == "GPM: on for gpu 0; not supported (driver/GPU) on gpu 1"
        assert nvml.gpm_samples_alive() == 2
    assert set(by_gpu(readings, "otel_forge.gpu.sm.activity")) == {"0"}
    assert len(messages(caplog, logging.DEBUG, "GPU 1: GPM not supported")) == 1
    assert warnings_of(caplog) == []


def test_a_pynvml_without_gpm_leaves_gpm_off(monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_nvml({**H100}) as nvml:
        monkeypatch.delattr(nvml, "nvmlGpmMetricsGet")
        with opened_with(contextlib.nullcontext, NvidiaCollector, nvml) as (_, collector):  # type: ignore[arg-type]
            readings = [read(collector) for _ in range(2)][-1]
            assert collector.describe()[-1] == "GPM: not supported (nvidia-ml-py without GPM)"
    assert gpm_metrics(readings) == set()


# --- failures mid-run ----------------------------------------------------------------------------


def test_not_supported_mid_run_switches_gpm_off_for_that_gpu_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened(H100) as (nvml, collector):
        read(collector), read(collector)
        nvml.set_error(0, "nvmlGpmSampleGet", "NotSupported")
        later = [read(collector) for _ in range(3)]
        assert nvml.calls("nvmlGpmSampleGet", 0) == 3  # two reads, then the one that failed: never again
        assert collector.describe()[-1] == "GPM: on for gpu 1; not supported (driver/GPU) on gpu 0"
    for readings in later:
        assert set(by_gpu(readings, "otel_forge.gpu.sm.activity")) == {"1"}
        assert set(by_gpu(readings, "hw.power")) == {"0", "1"}
    assert len(messages(caplog, logging.DEBUG, "GPU 0: gpm not supported")) == 1
    assert warnings_of(caplog) == []


def test_another_error_costs_that_reads_values_only_warned_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened(H100) as (nvml, collector):
        read(collector)
        nvml.set_error(0, "nvmlGpmMetricsGet", "Unknown")
        failing = [read(collector) for _ in range(3)]
        nvml.set_error(0, "nvmlGpmMetricsGet", None)
        after = read(collector)
        assert collector.describe()[-1] == "GPM: on for gpu 0, 1"
    for readings in failing:
        assert set(by_gpu(readings, "otel_forge.gpu.sm.activity")) == {"1"}
    # The samples went on: the read after the errors reports its own interval (samples 3 and 4), as GPU 1 does.
    assert by_gpu(after, "otel_forge.gpu.sm.activity") == pytest.approx({"0": (40 + 3 * 4) / 100, "1": 0.62})
    assert len(messages(caplog, logging.WARNING, "GPU 0: reading gpm failed")) == 1
    assert len(warnings_of(caplog)) == 1


def test_a_gpu_lost_mid_run_reports_failed_and_the_others_keep_gpm(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with opened(H100) as (nvml, collector):
        read(collector), read(collector)
        nvml.lose_gpu(1)
        during, after = read(collector), read(collector)
        collector.close()
        assert nvml.gpm_samples_alive() == 0  # a lost GPU's samples are freed too
    for readings in (during, after):
        assert by_gpu(readings, "hw.status", **{"hw.state": "failed"}) == {"0": 0, "1": 1}
        assert set(by_gpu(readings, "otel_forge.gpu.sm.activity")) == {"0"}
    assert len(messages(caplog, logging.WARNING, "GPU 1 (")) == 1


# --- MIG -----------------------------------------------------------------------------------------


def test_mig_instances_report_gpm_through_their_gpu_with_the_mig_attributes() -> None:
    with opened(MIG) as (nvml, collector):
        read(collector)
        nvml.reset_counts()
        readings = read(collector)
        for key in ("0_mig1", "0_mig2"):
            assert nvml.calls("nvmlGpmMigSampleGet", key) == 1, key  # type: ignore[arg-type]
            assert nvml.calls("nvmlGpmMetricsGet", key) == 1, key  # type: ignore[arg-type]
        assert nvml.gpm_samples_alive() == 8  # GPUs 0 and 1, and the two instances
        assert collector.describe()[-1] == "GPM: on for gpu 0, 0_mig1, 0_mig2, 1"
    # Instance 1 of GPU 0 is ordinal 1 in the fake: (40 + 10 * 1 + 3 * 1) % 101.
    assert by_gpu(readings, "otel_forge.gpu.sm.activity") == pytest.approx(
        {"0": 0.43, "0_mig1": 0.53, "0_mig2": 0.63, "1": 0.53}
    )
    instance = next(a for a, _ in readings.get("otel_forge.gpu.dram.activity") if a["hw.id"] == "0_mig2")
    assert instance["hw.parent"] == "0" and instance["otel_forge.gpu.mig.instance"] == "2"
    for metric in GPM_METRICS:
        for attributes, _ in readings.get(metric):
            assert set(attributes) <= set(SPECS[metric].attributes), metric
    # A GPU instance has no link of its own: its PCIe and NVLink rates are NotSupported, the GPU's are not.
    assert set(by_gpu(readings, "otel_forge.gpu.io.rate", **PCIE_TX)) == {"0", "1"}


def test_a_mig_instance_without_gpm_is_off_alone() -> None:
    with opened({**MIG, "not_supported": {"0_mig1": ["gpm"]}}) as (_, collector):
        readings = [read(collector) for _ in range(2)][-1]
        assert collector.describe()[-1] == "GPM: on for gpu 0, 0_mig2, 1; not supported (driver/GPU) on gpu 0_mig1"
    assert set(by_gpu(readings, "otel_forge.gpu.sm.occupancy")) == {"0", "0_mig2", "1"}


# --- where the values go -------------------------------------------------------------------------


def test_mlflow_keys_through_the_key_mapper() -> None:
    with opened(MIG) as (_, collector):
        read(collector)
        readings = read(collector)
    sample = KeyMapper("system/node_0/").sample(
        (metric, [SimpleNamespace(attributes=a, value=v) for a, v in readings.get(metric)]) for metric in GPM_METRICS
    )
    values = {key: value for key, (_, value) in sample.items()}
    expected_per_gpu = {
        "sm_activity_percentage",
        "sm_occupancy_percentage",
        "tensor_activity_percentage",
        "fp64_activity_percentage",
        "fp32_activity_percentage",
        "fp16_activity_percentage",
        "dram_activity_percentage",
    }
    assert set(values) == {
        f"system/node_0/gpu_{gpu}_{key}" for gpu in ("0", "0_mig1", "0_mig2", "1") for key in expected_per_gpu
    }
    assert values["system/node_0/gpu_0_sm_activity_percentage"] == pytest.approx(43.0)
    assert values["system/node_0/gpu_1_tensor_activity_percentage"] == pytest.approx(38.0)  # 30 + 7 + 1
    assert values["system/node_0/gpu_0_mig2_dram_activity_percentage"] == pytest.approx(34.0)  # 25 + 4 * 2 + 1


def test_prometheus_names() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_forge.pipeline.instruments import InstrumentSet
    from otel_forge.pipeline.prometheus_rendering import PrometheusRendering
    from testkit.servers import PROMETHEUS_ACCEPT

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    with opened(H100) as (_, collector):
        instruments = InstrumentSet(provider.get_meter("otel_forge"), [collector], max_age_s=0.0)
        try:
            reader.get_metrics_data()  # primes
            rendering = PrometheusRendering()
            rendering.export(reader.get_metrics_data())
            body, _ = rendering.body(PROMETHEUS_ACCEPT, None)
        finally:
            instruments.unregister()
            provider.shutdown()
    text = body.decode()
    names = {line.split("{")[0] for line in text.splitlines() if line.startswith("otel_forge_gpu_")}
    assert {
        "otel_forge_gpu_sm_activity",
        "otel_forge_gpu_sm_occupancy",
        "otel_forge_gpu_pipe_activity",
        "otel_forge_gpu_dram_activity",
        "otel_forge_gpu_io_rate_bytes_per_second",
    } <= names, sorted(names)
    assert 'otel_forge_gpu_pipe="tensor"' in text
    assert 'otel_forge_gpu_link="nvlink",' in text
