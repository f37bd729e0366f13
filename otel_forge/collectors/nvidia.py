"""NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py): every selected GPU, every field, one pass.

The read loop and the failure rules are ``GpuCollector``'s (``gpu.py``); NVML's errors map onto
them as: unsupported (the field is switched off for that GPU) for ``NVMLError_NotSupported``,
``_FunctionNotFound``, ``_NoPermission`` and ``NVMLLibraryMismatchError``; lost (the GPU reports
``hw.status`` failed from then on) for ``NVMLError_GpuIsLost`` and ``_ResetRequired``; any other
error skips the field for this read.

XID critical errors arrive as NVML events; a daemon thread waits on an event set and counts
them per (GPU, XID code); ``read`` reports the cumulative counts.

NVML gives PCIe traffic only as a throughput (KiB/s over 20 ms); semconv's ``hw.gpu.io`` is a byte
counter, so each read adds the throughput times the time since the previous read (trapezoids).

Everything NVML has a field id for (energy, ECC totals, memory temperature, NVLink traffic and
error counters, PCIe replays, row remapping, retired pages, power and thermal violation time) is
read in ONE ``nvmlDeviceGetFieldValues`` call per GPU per read (``_BATCH``); each entry carries its
own status, so each of those fields is switched off or skipped on its own. A read of a whole GPU
is 14 NVML calls: that one, utilization, encoder, decoder, memory, power, power limit,
temperature, two clocks, two PCIe throughputs, clock-event reasons and compute processes.

MIG: a GPU in MIG mode is read as a whole (power, temperature, NVLink, ...) and each of its MIG
instances as a device of its own (memory; utilization where NVML gives it, which it does not on
today's drivers: switched off then). MIG instances are enumerated once, when the GPUs are opened.

GPM (GPU Performance Monitoring, Hopper and newer) gives what the GPU really did between two
samples: SM activity and occupancy, the tensor/fp64/fp32/fp16 pipes, DRAM bandwidth, PCIe and
NVLink throughput. Where ``nvmlGpmQueryDeviceSupport`` says a GPU has it, the collector keeps two
samples per device (a MIG instance sampled through ``nvmlGpmMigSampleGet`` on its GPU): each read
takes a new sample into the older one and computes every metric between the two in ONE
``nvmlGpmMetricsGet`` (two more NVML calls per device per read). The first read only primes.
GPM is the ``gpm`` field (each metric's own status a field of its own: ``gpm_fp64_activity``,
``gpm_nvlink_io``, ...), so the failure rules hold for it; a device without GPM is said once, in
``describe``'s GPM line. The samples are freed at close.
"""

from __future__ import annotations

import ctypes
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from otel_forge.collectors.base import CollectorUnavailable, Readings
from otel_forge.collectors.gpu import Failure, FieldBatch, Gpu, GpuCollector, Row
from otel_forge.collectors.gpu_selection import NVIDIA_VISIBLE_ENV, DeviceKey
from otel_forge.collectors.process import MonitoredProcesses
from otel_forge.ratelimit import RateLimitedLogger

_logger = logging.getLogger(__name__)

# otel_forge.gpu.throttle.reason value -> suffix of pynvml's nvmlClocksEventReason*/ThrottleReason* bit.
_THROTTLE_REASONS = (
    ("gpu_idle", "GpuIdle"),
    ("applications_clocks_setting", "ApplicationsClocksSetting"),
    ("sw_power_cap", "SwPowerCap"),
    ("hw_slowdown", "HwSlowdown"),
    ("sync_boost", "SyncBoost"),
    ("sw_thermal_slowdown", "SwThermalSlowdown"),
    ("hw_thermal_slowdown", "HwThermalSlowdown"),
    ("hw_power_brake_slowdown", "HwPowerBrakeSlowdown"),
    ("display_clock_setting", "DisplayClockSetting"),
)

_UNSUPPORTED_ERRORS = (
    "NVMLError_NotSupported",
    "NVMLError_FunctionNotFound",
    "NVMLError_NoPermission",
    # nvmlDeviceGetComputeRunningProcesses turns FunctionNotFound into this one.
    "NVMLLibraryMismatchError",
)
_LOST_ERRORS = ("NVMLError_GpuIsLost", "NVMLError_ResetRequired")

XID_WAIT_MS = 500  # the event thread notices close() within this

_PCIE_COUNTERS = (("NVML_PCIE_UTIL_TX_BYTES", "transmit"), ("NVML_PCIE_UTIL_RX_BYTES", "receive"))

# NVLink throughput counters: a scope of UINT_MAX asks for the sum over the GPU's links.
_ALL_LINKS = 0xFFFFFFFF
_KIB = 1024
_NS = 1e-9


@dataclass(frozen=True)
class BatchEntry:
    """One field id of the ``nvmlDeviceGetFieldValues`` batch and the reading it becomes."""

    field: str  # the name it is switched off / warned under (several entries may share one)
    field_id: str  # pynvml's NVML_FI_* constant
    metric: str
    attributes: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0
    scope: int = 0


def _entries(
    field: str, metric: str, ids: dict[str, dict[str, str]], scale: float = 1.0, scope: int = 0
) -> list[BatchEntry]:
    """The entries of one field: NVML_FI_* id -> the attributes of its reading."""
    return [BatchEntry(field, field_id, metric, tuple(attrs.items()), scale, scope) for field_id, attrs in ids.items()]


def _by_error_type(**ids: str) -> dict[str, dict[str, str]]:
    return {field_id: {"error.type": error_type} for field_id, error_type in ids.items()}


# fmt: off
_BATCH = (
    *_entries("energy", "hw.energy", {"NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION": {}}, scale=1e-3),  # mJ
    *_entries("ecc", "hw.errors", _by_error_type(NVML_FI_DEV_ECC_SBE_VOL_TOTAL="corrected",
                                                 NVML_FI_DEV_ECC_DBE_VOL_TOTAL="uncorrected")),
    *_entries("memory_temperature", "hw.temperature", {"NVML_FI_DEV_MEMORY_TEMP": {"hw.sensor_location": "memory"}}),
    *_entries("nvlink_io", "hw.gpu.io", {
        "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX": {"otel_forge.gpu.link": "nvlink", "network.io.direction": "transmit"},
        "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX": {"otel_forge.gpu.link": "nvlink", "network.io.direction": "receive"},
    }, scale=_KIB, scope=_ALL_LINKS),  # KiB since the driver loaded, all links
    *_entries("nvlink_errors", "otel_forge.gpu.nvlink.errors", _by_error_type(
        NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL="crc_flit",
        NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL="crc_data",
        NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL="replay",
        NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL="recovery")),
    *_entries("pcie_replays", "otel_forge.gpu.pcie.replays", {"NVML_FI_DEV_PCIE_REPLAY_COUNTER": {}}),
    *_entries("row_remapping", "otel_forge.gpu.memory.remapped_rows", _by_error_type(
        NVML_FI_DEV_REMAPPED_COR="corrected", NVML_FI_DEV_REMAPPED_UNC="uncorrected")),
    *_entries("row_remapping", "otel_forge.gpu.memory.remap.pending", {"NVML_FI_DEV_REMAPPED_PENDING": {}}),
    *_entries("row_remapping", "otel_forge.gpu.memory.remap.failed", {"NVML_FI_DEV_REMAPPED_FAILURE": {}}),
    *_entries("retired_pages", "otel_forge.gpu.memory.retired_pages", _by_error_type(
        NVML_FI_DEV_RETIRED_SBE="corrected", NVML_FI_DEV_RETIRED_DBE="uncorrected")),
    *_entries("retired_pages", "otel_forge.gpu.memory.retirement.pending", {"NVML_FI_DEV_RETIRED_PENDING": {}}),
    # Time the clocks were held down by the power / thermal policy, in ns (as nvmlDeviceGetViolationStatus,
    # which NVML deprecates for these ids).
    *_entries("violation", "otel_forge.gpu.violation.time", {
        "NVML_FI_DEV_PERF_POLICY_POWER": {"otel_forge.gpu.violation": "power"},
        "NVML_FI_DEV_PERF_POLICY_THERMAL": {"otel_forge.gpu.violation": "thermal"},
    }, scale=_NS),
)
# fmt: on


@dataclass(frozen=True)
class GpmEntry:
    """One metric of the GPM request and the reading it becomes."""

    field: str  # the name it is switched off / warned under (several entries may share one)
    metric_id: str  # pynvml's NVML_GPM_METRIC_* constant
    metric: str
    attributes: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0


_PERCENT = 0.01  # GPM's utilizations are 0..100
_MIB = 1024 * 1024  # GPM's throughputs are MiB/s


def _gpm_link(field: str, metric_id: str, link: str, direction: str) -> GpmEntry:
    attributes = (("otel_forge.gpu.link", link), ("network.io.direction", direction))
    return GpmEntry(field, metric_id, "otel_forge.gpu.io.rate", attributes, _MIB)


def _gpm_pipe(pipe: str, metric_id: str) -> GpmEntry:
    return GpmEntry(
        f"gpm_{pipe}_activity", metric_id, "otel_forge.gpu.pipe.activity", (("otel_forge.gpu.pipe", pipe),), _PERCENT
    )


# fmt: off
_GPM = (
    GpmEntry("gpm_sm_activity", "NVML_GPM_METRIC_SM_UTIL", "otel_forge.gpu.sm.activity", scale=_PERCENT),
    GpmEntry("gpm_sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY", "otel_forge.gpu.sm.occupancy", scale=_PERCENT),
    _gpm_pipe("tensor", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
    _gpm_pipe("fp64", "NVML_GPM_METRIC_FP64_UTIL"),
    _gpm_pipe("fp32", "NVML_GPM_METRIC_FP32_UTIL"),
    _gpm_pipe("fp16", "NVML_GPM_METRIC_FP16_UTIL"),
    GpmEntry("gpm_dram_activity", "NVML_GPM_METRIC_DRAM_BW_UTIL", "otel_forge.gpu.dram.activity", scale=_PERCENT),
    _gpm_link("gpm_pcie_io", "NVML_GPM_METRIC_PCIE_TX_PER_SEC", "pcie", "transmit"),
    _gpm_link("gpm_pcie_io", "NVML_GPM_METRIC_PCIE_RX_PER_SEC", "pcie", "receive"),
    _gpm_link("gpm_nvlink_io", "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", "nvlink", "transmit"),
    _gpm_link("gpm_nvlink_io", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", "nvlink", "receive"),
)
# fmt: on
# What a pynvml must have for GPM at all, and for a MIG instance's.
_GPM_API = (
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleGet",
    "nvmlGpmSampleFree",
    "nvmlGpmMetricsGet",
    "c_nvmlGpmMetricsGet_t",
    "NVML_GPM_METRICS_GET_VERSION",
)
_GPM_MIG_API = "nvmlGpmMigSampleGet"
_GPM_NOT_SUPPORTED = "driver/GPU"  # the reason a device has no GPM, when NVML says so

# c_nvmlValue_t's member for each NVML_VALUE_TYPE_*.
_VALUE_MEMBERS = {
    "NVML_VALUE_TYPE_DOUBLE": "dVal",
    "NVML_VALUE_TYPE_UNSIGNED_INT": "uiVal",
    "NVML_VALUE_TYPE_UNSIGNED_LONG": "ulVal",
    "NVML_VALUE_TYPE_UNSIGNED_LONG_LONG": "ullVal",
    "NVML_VALUE_TYPE_SIGNED_LONG_LONG": "sllVal",
    "NVML_VALUE_TYPE_SIGNED_INT": "siVal",
    "NVML_VALUE_TYPE_UNSIGNED_SHORT": "usVal",
}


class ByteCounter:
    """Bytes per device, from throughput readings: each adds the mean throughput since the last
    one times the time between them (the first starts the count at 0)."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[float, float]] = {}  # device -> (bytes/s, monotonic s)
        self._totals: dict[int, float] = {}

    def add(self, device: int, bytes_per_s: float, now_s: float) -> float:
        last = self._last.get(device)
        total = self._totals.get(device, 0.0)
        if last is not None:
            total += (last[0] + bytes_per_s) / 2 * max(0.0, now_s - last[1])
        self._last[device], self._totals[device] = (bytes_per_s, now_s), total
        return total


class NvidiaCollector(GpuCollector):
    """All selected NVIDIA GPUs, and the XID critical errors NVML reports for them."""

    name = "nvidia"
    logger = _logger
    visible_env = NVIDIA_VISIBLE_ENV
    FIELDS = (
        "utilization",
        "encoder",
        "decoder",
        "memory",
        "power",
        "power_limit",
        "temperature",
        "clock_sm",
        "clock_memory",
        "pcie",
        "throttle",
        "process_memory",
        "field_values",  # the batch: energy, ecc, memory_temperature, nvlink_*, pcie_replays, ...
        "gpm",  # one nvmlGpmSampleGet and one nvmlGpmMetricsGet: SM, pipes, DRAM, PCIe, NVLink
    )
    MIG_FIELDS = ("utilization", "memory", "gpm")

    def __init__(self, nvml: Any, gpus: list[Gpu], processes: MonitoredProcesses | None) -> None:
        super().__init__(nvml, gpus, processes)
        self._unsupported_errors = _error_classes(nvml, _UNSUPPORTED_ERRORS)
        self._lost_errors = _error_classes(nvml, _LOST_ERRORS)
        self._throttle_bits = _throttle_bits(nvml)
        self._throttle_mask = (
            getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        self._xid = XidWatcher(nvml, [gpu for gpu in gpus if not gpu.lost and gpu.parent is None], self._warnings)
        self._pcie = {direction: ByteCounter() for _, direction in _PCIE_COUNTERS}
        # The batch's request: resolved once (a pynvml without an id leaves that entry out).
        self._batch = [entry for entry in _BATCH if hasattr(nvml, entry.field_id)]
        self._batch_ids = [(getattr(nvml, entry.field_id), entry.scope) for entry in self._batch]
        self._value_members = {
            getattr(nvml, name): member for name, member in _VALUE_MEMBERS.items() if hasattr(nvml, name)
        }
        # GPM: a sampler per device that has it (by handle), and why each other device has not.
        self._gpm_entries = [
            (entry, getattr(nvml, entry.metric_id)) for entry in _GPM if hasattr(nvml, entry.metric_id)
        ]
        self._gpm: dict[int, tuple[Gpu, GpmSampler]] = {}
        self._gpm_off: dict[DeviceKey, str] = {}
        self._open_gpm([gpu for gpu in gpus if not gpu.lost])

    @property
    def _nvml(self) -> Any:
        return self._library

    @property
    def xid_watched(self) -> list[int]:
        """Indices of the GPUs whose XID events are counted."""
        return self._xid.watched

    def read(self, readings: Readings) -> None:
        super().read(readings)
        by_index = {gpu.index: gpu for gpu in self._gpus if gpu.parent is None}
        for (index, code), count in sorted(self._xid.counts().items()):
            readings.add(
                "otel_forge.gpu.xid.errors", count, {**by_index[index].attributes, "otel_forge.gpu.xid": str(code)}
            )

    def close(self) -> None:
        if not self._closed:
            self._xid.close()  # its thread waits on NVML: stopped before NVML goes away
        super().close()

    def describe(self) -> list[str]:
        lines = [gpu.describe(apart=("gpm",)) for gpu in self._gpus]
        return lines + self._gpm_lines()

    # --- GPM -------------------------------------------------------------------------------------

    def _open_gpm(self, gpus: list[Gpu]) -> None:
        """A sampler (two samples) for each device GPM supports; "gpm" switched off on the others."""
        nvml = self._nvml
        missing = [name for name in _GPM_API if not hasattr(nvml, name)]
        support: dict[int, str | None] = {}  # id(whole GPU) -> why it has no GPM (None: it has)
        for gpu in gpus:
            whole = gpu.parent or gpu
            if missing:
                reason: str | None = "nvidia-ml-py without GPM"
            else:
                if id(whole) not in support:
                    support[id(whole)] = self._gpm_support(whole)
                reason = support[id(whole)]
                if reason is None and gpu.parent is not None and not hasattr(nvml, _GPM_MIG_API):
                    reason = "nvidia-ml-py without GPM for MIG"
            if reason is None:
                reason = self._open_sampler(gpu)
            if reason is not None:
                gpu.unsupported.add("gpm")
                self._gpm_off[gpu.key] = reason

    def _gpm_support(self, gpu: Gpu) -> str | None:
        """Why ``gpu`` has no GPM, or None when it has."""
        try:
            support = self._nvml.nvmlGpmQueryDeviceSupport(gpu.handle)
        except self._nvml.NVMLError as error:
            if self._failure(error) is Failure.OTHER:
                self.logger.warning("GPU %s: GPM support cannot be queried (%s); GPM is off", gpu.key, error)
                return f"query failed: {error}"
            self.logger.debug("GPU %s: GPM not supported (%s)", gpu.key, error)
            return _GPM_NOT_SUPPORTED
        return None if support.isSupportedDevice else _GPM_NOT_SUPPORTED

    def _open_sampler(self, gpu: Gpu) -> str | None:
        """Allocates ``gpu``'s two samples; why not, when that fails."""
        nvml = self._nvml
        samples: list[Any] = []
        try:
            while len(samples) < 2:
                samples.append(nvml.nvmlGpmSampleAlloc())
        except nvml.NVMLError as error:
            _free_samples(nvml, samples)
            self.logger.warning("GPU %s: GPM samples cannot be allocated (%s); GPM is off", gpu.key, error)
            return f"samples cannot be allocated: {error}"
        parent = gpu.parent
        if parent is None:
            handle = gpu.handle
            take: Callable[[Any], Any] = lambda sample: nvml.nvmlGpmSampleGet(handle, sample)  # noqa: E731
        else:
            gpu_handle, instance = parent.handle, gpu.instance
            take = lambda sample: nvml.nvmlGpmMigSampleGet(gpu_handle, instance, sample)  # noqa: E731
        self._gpm[_handle_key(gpu.handle)] = (gpu, GpmSampler(nvml, take, samples[0], samples[1]))
        return None

    def _gpm_lines(self) -> list[str]:
        """One line: the devices GPM samples, and those without it and why."""
        on = [str(gpu.key) for gpu in self._gpus if not gpu.lost and "gpm" not in gpu.unsupported]
        off: dict[str, list[str]] = {}
        for gpu in self._gpus:
            if "gpm" in gpu.unsupported:
                off.setdefault(self._gpm_off.get(gpu.key, _GPM_NOT_SUPPORTED), []).append(str(gpu.key))
        if not on and len(off) == 1:
            return [f"GPM: not supported ({next(iter(off))})"]
        parts = ([f"on for gpu {', '.join(on)}"] if on else []) + [
            f"not supported ({reason}) on gpu {', '.join(keys)}" for reason, keys in off.items()
        ]
        return [f"GPM: {'; '.join(parts)}"] if parts else []

    def _release(self) -> None:
        for _, sampler in self._gpm.values():
            sampler.free()
        self._gpm.clear()

    # --- inventory ----------------------------------------------------------------------------------

    def _driver_version(self) -> str | None:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def _cuda_version(self) -> str | None:
        version = int(self._nvml.nvmlSystemGetCudaDriverVersion())  # 1000 * major + 10 * minor
        return f"{version // 1000}.{version % 1000 // 10}"

    def _memory_bytes(self, gpu: Gpu) -> int | None:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(gpu.handle).total)

    # --- vendor hooks ------------------------------------------------------------------------

    @staticmethod
    def _start_library() -> Any:
        """Import pynvml and initialise NVML, or say why not."""
        try:
            import pynvml
        except ImportError as error:
            raise CollectorUnavailable(f"nvidia-ml-py is not installed ({error})") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound:
            raise CollectorUnavailable(
                "NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver installed"
            ) from None
        except pynvml.NVMLError_DriverNotLoaded:
            raise CollectorUnavailable("the NVIDIA driver is not loaded") from None
        except pynvml.NVMLError as error:
            raise CollectorUnavailable(f"NVML failed to initialise: {error}") from None
        return pynvml

    @staticmethod
    def _open_gpus(nvml: Any) -> list[Gpu]:
        count = nvml.nvmlDeviceGetCount()
        driver = _optional(nvml, nvml.nvmlSystemGetDriverVersion)
        present: list[Gpu] = []
        for gpu in (_open_gpu(nvml, index, driver) for index in range(count)):
            if gpu is not None:
                present += [gpu, *_open_mig_instances(nvml, gpu)]
        if not present:
            raise CollectorUnavailable("NVML found no GPUs" if count == 0 else "no GPU could be opened")
        return present

    @staticmethod
    def _shutdown_library(nvml: Any) -> None:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as error:
            _logger.debug("nvmlShutdown failed: %s", error)

    def _failure(self, error: Exception) -> Failure:
        if isinstance(error, self._unsupported_errors):
            return Failure.UNSUPPORTED
        if isinstance(error, self._lost_errors):
            return Failure.LOST
        return Failure.OTHER

    # --- field readers: handle -> rows --------------------------------------------------------

    def _read_utilization(self, handle: Any) -> list[Row]:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
        return [
            ("hw.gpu.utilization", rates.gpu / 100, {"hw.gpu.task": "general"}),
            ("otel_forge.gpu.memory.activity", rates.memory / 100, {}),
        ]

    def _read_encoder(self, handle: Any) -> list[Row]:
        utilization, _sampling_period_us = self._nvml.nvmlDeviceGetEncoderUtilization(handle)
        return [("hw.gpu.utilization", utilization / 100, {"hw.gpu.task": "encoder"})]

    def _read_decoder(self, handle: Any) -> list[Row]:
        utilization, _sampling_period_us = self._nvml.nvmlDeviceGetDecoderUtilization(handle)
        return [("hw.gpu.utilization", utilization / 100, {"hw.gpu.task": "decoder"})]

    def _read_memory(self, handle: Any) -> list[Row]:
        memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = memory.used / memory.total if memory.total else None
        return [
            ("hw.gpu.memory.usage", memory.used, {}),
            ("hw.gpu.memory.limit", memory.total, {}),
            ("hw.gpu.memory.utilization", utilization, {}),
        ]

    def _read_power(self, handle: Any) -> list[Row]:
        return [("hw.power", self._nvml.nvmlDeviceGetPowerUsage(handle) / 1000, {})]  # mW

    def _read_power_limit(self, handle: Any) -> list[Row]:
        return [("otel_forge.gpu.power.limit", self._nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000, {})]

    def _read_temperature(self, handle: Any) -> list[Row]:
        celsius = self._nvml.nvmlDeviceGetTemperature(handle, self._nvml.NVML_TEMPERATURE_GPU)
        return [("hw.temperature", celsius, {"hw.sensor_location": "gpu"})]

    def _read_clock_sm(self, handle: Any) -> list[Row]:
        return self._clock(handle, self._nvml.NVML_CLOCK_SM, "sm")

    def _read_clock_memory(self, handle: Any) -> list[Row]:
        return self._clock(handle, self._nvml.NVML_CLOCK_MEM, "memory")

    def _clock(self, handle: Any, clock_type: int, label: str) -> list[Row]:
        mhz = self._nvml.nvmlDeviceGetClockInfo(handle, clock_type)
        return [("otel_forge.gpu.clock.frequency", mhz * 1_000_000, {"otel_forge.gpu.clock": label})]

    def _read_pcie(self, handle: Any) -> list[Row]:
        # NVML reports KB/s (KiB) sampled over 20 ms, so each call takes ~20 ms.
        rows: list[Row] = []
        for counter, direction in _PCIE_COUNTERS:
            bytes_per_s = self._nvml.nvmlDeviceGetPcieThroughput(handle, getattr(self._nvml, counter)) * 1024
            total = self._pcie[direction].add(_handle_key(handle), bytes_per_s, time.monotonic())
            rows.append(("hw.gpu.io", total, {"otel_forge.gpu.link": "pcie", "network.io.direction": direction}))
        return rows

    def _read_throttle(self, handle: Any) -> list[Row]:
        try:
            mask = self._throttle_mask(handle)
        except self._nvml.NVMLError_FunctionNotFound:
            legacy = getattr(self._nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
            if legacy is None or self._throttle_mask is legacy:
                raise
            self._throttle_mask = legacy  # a driver older than the Event name
            mask = legacy(handle)
        return [
            ("otel_forge.gpu.throttle", 1 if mask & bit else 0, {"otel_forge.gpu.throttle.reason": reason})
            for reason, bit in self._throttle_bits
        ]

    def _read_process_memory(self, handle: Any) -> list[Row]:
        used: dict[int, float] = {}
        for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            used[process.pid] = used.get(process.pid, 0) + (process.usedGpuMemory or 0)
        return self._process_memory(used)

    def _read_field_values(self, handle: Any) -> FieldBatch:
        values = self._nvml.nvmlDeviceGetFieldValues(handle, self._batch_ids)
        batch = FieldBatch()
        for entry, value in zip(self._batch, values, strict=True):
            if value.nvmlReturn != self._nvml.NVML_SUCCESS:
                batch.errors.setdefault(entry.field, self._nvml.NVMLError(value.nvmlReturn))
                continue
            number = self._field_number(value)
            row: Row = (entry.metric, None if number is None else number * entry.scale, dict(entry.attributes))
            batch.rows.setdefault(entry.field, []).append(row)
        return batch

    def _field_number(self, value: Any) -> float | None:
        member = self._value_members.get(value.valueType)
        return None if member is None else float(getattr(value.value, member))

    def _read_gpm(self, handle: Any) -> FieldBatch:
        found = self._gpm.get(_handle_key(handle))
        if found is None:  # sample_field on a device without GPM
            raise self._nvml.NVMLError_NotSupported()
        gpu, sampler = found
        return sampler.read(
            [(entry, metric_id) for entry, metric_id in self._gpm_entries if entry.field not in gpu.unsupported]
        )


class GpmSampler:
    """Two GPM samples of one device and the metrics between them.

    ``read`` takes a new sample into the older one, then asks ``nvmlGpmMetricsGet`` once for every
    metric between the previous sample and the new one. The first read only primes (no values);
    a failed sample leaves the previous one in place, a failed metrics call costs that read only.
    """

    def __init__(self, nvml: Any, take: Callable[[Any], Any], first: Any, second: Any) -> None:
        self._nvml = nvml
        self._take = take
        self._previous, self._spare = first, second
        self._primed = False
        self._request = nvml.c_nvmlGpmMetricsGet_t()  # ~19 KB: made once, filled each read
        self._request.version = nvml.NVML_GPM_METRICS_GET_VERSION

    def read(self, entries: list[tuple[GpmEntry, int]]) -> FieldBatch:
        """Rows and errors per entry field, between the last sample and one taken now."""
        self._take(self._spare)
        older, self._previous, self._spare = self._previous, self._spare, self._previous
        batch = FieldBatch()
        if not self._primed or not entries:
            self._primed = True
            return batch
        request = self._request
        request.sample1, request.sample2, request.numMetrics = older, self._previous, len(entries)
        for position, (_, metric_id) in enumerate(entries):
            request.metrics[position].metricId = metric_id
        self._nvml.nvmlGpmMetricsGet(request)
        for position, (entry, _) in enumerate(entries):
            metric = request.metrics[position]
            if metric.nvmlReturn != self._nvml.NVML_SUCCESS:
                batch.errors.setdefault(entry.field, self._nvml.NVMLError(metric.nvmlReturn))
                continue
            value = metric.value * entry.scale if math.isfinite(metric.value) else None
            batch.rows.setdefault(entry.field, []).append((entry.metric, value, dict(entry.attributes)))
        return batch

    def free(self) -> None:
        """Frees both samples; never raises."""
        _free_samples(self._nvml, [self._previous, self._spare])


class XidWatcher:
    """Counts XID critical-error events per (GPU index, XID code) on a daemon thread.

    GPUs whose events cannot be registered (``NotSupported``) are skipped. ``close`` stops the
    thread within ``XID_WAIT_MS`` and frees the event set.
    """

    def __init__(self, nvml: Any, gpus: list[Gpu], warnings: RateLimitedLogger) -> None:
        self._nvml = nvml
        self._warnings = warnings
        self._counts: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gpu_by_handle: dict[int, int] = {}
        self._event_set: Any = None
        self._thread: threading.Thread | None = None
        self._wait = getattr(nvml, "nvmlEventSetWait_v2", None) or nvml.nvmlEventSetWait
        self._start(gpus)

    @property
    def watched(self) -> list[int]:
        return sorted(self._gpu_by_handle.values())

    def counts(self) -> dict[tuple[int, int], int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=XID_WAIT_MS / 1000 + 1.0)
            if self._thread.is_alive():
                _logger.warning("the NVML XID event thread did not stop; its event set is left allocated")
                return
        self._free()

    def _start(self, gpus: list[Gpu]) -> None:
        try:
            self._event_set = self._nvml.nvmlEventSetCreate()
        except self._nvml.NVMLError as error:
            _logger.debug("NVML events unavailable (%s): XID errors are not counted", error)
            return
        for gpu in gpus:
            self._register(gpu)
        if not self._gpu_by_handle:
            self._free()
            return
        self._thread = threading.Thread(target=self._run, name="otel-forge-nvml-xid", daemon=True)
        self._thread.start()

    def _register(self, gpu: Gpu) -> None:
        nvml = self._nvml
        try:
            nvml.nvmlDeviceRegisterEvents(gpu.handle, nvml.nvmlEventTypeXidCriticalError, self._event_set)
        except nvml.NVMLError_NotSupported as error:
            _logger.debug("GPU %d: XID events not supported (%s)", gpu.index, error)
        except nvml.NVMLError as error:
            _logger.warning("GPU %d: XID events cannot be registered (%s); they are not counted", gpu.index, error)
        else:
            self._gpu_by_handle[_handle_key(gpu.handle)] = gpu.index

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                event = self._wait(self._event_set, XID_WAIT_MS)
            except self._nvml.NVMLError_Timeout:
                continue
            except Exception as error:  # noqa: BLE001 - the thread must outlive any one failure
                self._warnings.warning("xid", "waiting for NVML XID events failed: %s", error)
                self._stop.wait(XID_WAIT_MS / 1000)  # a failure that repeats must not spin
                continue
            self._record(event)

    def _record(self, event: Any) -> None:
        if not event.eventType & self._nvml.nvmlEventTypeXidCriticalError:
            return
        index = self._gpu_by_handle.get(_handle_key(event.device))
        if index is None:
            return
        code = int(event.eventData)
        with self._lock:
            self._counts[(index, code)] = self._counts.get((index, code), 0) + 1
        self._warnings.warning(f"xid {index} {code}", "GPU %d: XID %d critical error event", index, code)

    def _free(self) -> None:
        if self._event_set is None:
            return
        event_set, self._event_set = self._event_set, None
        try:
            self._nvml.nvmlEventSetFree(event_set)
        except self._nvml.NVMLError as error:
            _logger.debug("freeing the NVML event set failed: %s", error)


# --- opening ---------------------------------------------------------------------------------


def _open_gpu(nvml: Any, index: int, driver: str) -> Gpu | None:
    """The GPU at ``index``; a lost one is kept (it reports failed), an unreadable one skipped."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name, uuid = _text(nvml.nvmlDeviceGetName(handle)), _text(nvml.nvmlDeviceGetUUID(handle))
    except _error_classes(nvml, _LOST_ERRORS) as error:
        _logger.warning("GPU %d is lost (%s); it reports hw.status failed", index, error)
        return Gpu("NVIDIA", index, None, "unknown", "", "", lost=True)
    except nvml.NVMLError as error:
        _logger.warning("GPU %d cannot be opened (%s); it is not monitored", index, error)
        return None
    identity = {
        "hw.model": name,
        "hw.driver_version": driver,
        # Serial numbers exist on data-center boards only (NotSupported elsewhere).
        "hw.serial_number": _optional(nvml, nvml.nvmlDeviceGetSerial, handle),
        "hw.firmware_version": _optional(nvml, nvml.nvmlDeviceGetVbiosVersion, handle),
    }
    bus_id = _optional(nvml, lambda: nvml.nvmlDeviceGetPciInfo(handle).busId)
    return Gpu("NVIDIA", index, handle, name, uuid, bus_id, identity=identity)


def _open_mig_instances(nvml: Any, gpu: Gpu) -> list[Gpu]:
    """The MIG instances of ``gpu`` when it is in MIG mode (none otherwise, or when NVML cannot say)."""
    if gpu.lost:
        return []
    try:
        current_mode, _pending_mode = nvml.nvmlDeviceGetMigMode(gpu.handle)
        if current_mode != nvml.NVML_DEVICE_MIG_ENABLE:
            return []
        slots = nvml.nvmlDeviceGetMaxMigDeviceCount(gpu.handle)
    except nvml.NVMLError as error:  # NotSupported: a GPU without MIG
        _logger.debug("GPU %d: no MIG (%s)", gpu.index, error)
        return []
    instances = []
    for slot in range(slots):
        instance = _open_mig_instance(nvml, gpu, slot)
        if instance is not None:
            instances.append(instance)
    return instances


def _open_mig_instance(nvml: Any, gpu: Gpu, slot: int) -> Gpu | None:
    try:
        handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu.handle, slot)
    except nvml.NVMLError_NotFound:
        return None  # an empty slot
    except nvml.NVMLError as error:
        _logger.warning("GPU %d: MIG device %d cannot be opened (%s); it is not monitored", gpu.index, slot, error)
        return None
    try:
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        instance = nvml.nvmlDeviceGetGpuInstanceId(handle)
    except nvml.NVMLError as error:
        _logger.warning("GPU %d: MIG device %d cannot be opened (%s); it is not monitored", gpu.index, slot, error)
        return None
    # Its name carries the profile ("NVIDIA H100 80GB HBM3 MIG 1g.10gb").
    name = _optional(nvml, nvml.nvmlDeviceGetName, handle) or gpu.name
    return Gpu(
        "NVIDIA", gpu.index, handle, name, uuid, gpu.pci_bus_id, identity=gpu.identity, parent=gpu, instance=instance
    )


# --- small helpers ---------------------------------------------------------------------------


def _free_samples(nvml: Any, samples: list[Any]) -> None:
    for sample in samples:
        try:
            nvml.nvmlGpmSampleFree(sample)
        except nvml.NVMLError as error:
            _logger.debug("freeing a GPM sample failed: %s", error)


def _error_classes(nvml: Any, names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    return tuple(getattr(nvml, name) for name in names if hasattr(nvml, name))


def _throttle_bits(nvml: Any) -> tuple[tuple[str, int], ...]:
    bits = []
    for reason, suffix in _THROTTLE_REASONS:
        bit = getattr(nvml, f"nvmlClocksEventReason{suffix}", getattr(nvml, f"nvmlClocksThrottleReason{suffix}", None))
        if bit is not None:
            bits.append((reason, bit))
    return tuple(bits)


def _handle_key(handle: Any) -> int:
    """A device handle's address: the handle in an event is a new object for the same device."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        return id(handle)


def _optional(nvml: Any, function: Callable[..., str | bytes], *args: Any) -> str:
    """A text NVML may not give (not supported, no permission): "" then."""
    try:
        return _text(function(*args))
    except nvml.NVMLError:
        return ""


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
