"""NVIDIA GPUs through NVML (``pynvml`` from nvidia-ml-py): every selected GPU, every field, one pass.

Each read goes through a table of field readers (field name -> ``reader(handle) -> rows``), so
the three failure rules are one mechanism:

- a field the device does not support (``NVMLError_NotSupported``, ``_FunctionNotFound``,
  ``_NoPermission``) is switched off for that device for good, logged once at DEBUG;
- a GPU that is lost (``NVMLError_GpuIsLost``, ``NVMLError_ResetRequired``) is warned once and
  from then on only reports ``hw.status`` failed; NVML is not called for it again;
- any other error skips the field for this read, warned at most once a minute per field.

XID critical errors arrive as NVML events; a daemon thread waits on an event set and counts
them per (GPU, XID code); ``read`` reports the cumulative counts.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from otel_forge.collectors.base import Collector, CollectorUnavailable, Readings
from otel_forge.collectors.gpu_selection import NVIDIA_VISIBLE_ENV, select_gpus
from otel_forge.collectors.process import ProcessTree
from otel_forge.config import ForgeConfig
from otel_forge.ratelimit import RateLimitedLogger

_logger = logging.getLogger(__name__)

# One reading of a field: (metric name, value, attributes beyond the GPU's own).
Row = tuple[str, float | None, dict[str, str]]
FieldReader = Callable[[Any], list[Row]]

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

_UNSUPPORTED_ERRORS = ("NVMLError_NotSupported", "NVMLError_FunctionNotFound", "NVMLError_NoPermission",
                       # nvmlDeviceGetComputeRunningProcesses turns FunctionNotFound into this one.
                       "NVMLLibraryMismatchError")
_LOST_ERRORS = ("NVMLError_GpuIsLost", "NVMLError_ResetRequired")

XID_WAIT_MS = 500  # the event thread notices close() within this


@dataclass
class NvidiaGpu:
    """One selected GPU: its NVML handle, identity attributes and what is switched off for it."""

    index: int
    handle: Any
    name: str
    uuid: str
    pci_bus_id: str
    lost: bool = False
    unsupported: set[str] = field(default_factory=set)
    attributes: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.attributes = {
            "hw.id": str(self.index), "hw.name": self.name, "hw.vendor": "NVIDIA", "hw.type": "gpu",
            "otel_forge.gpu.uuid": self.uuid, "otel_forge.gpu.pci_bus_id": self.pci_bus_id,
        }


class NvidiaCollector(Collector):
    """All selected NVIDIA GPUs; see the module docstring for the failure rules."""

    name = "nvidia"
    FIELDS = ("utilization", "memory", "power", "power_limit", "energy", "temperature", "clock_sm",
              "clock_memory", "pcie", "ecc", "throttle", "process_memory")

    def __init__(self, nvml: Any, gpus: list[NvidiaGpu], tree: ProcessTree | None) -> None:
        self._nvml = nvml
        self._gpus = gpus
        self._tree = tree
        self._pids: set[int] | None = None  # the monitored tree, found once per read when needed
        self._warnings = RateLimitedLogger(_logger)
        self._lock = threading.Lock()
        self._closed = False
        self._unsupported_errors = _error_classes(nvml, _UNSUPPORTED_ERRORS)
        self._lost_errors = _error_classes(nvml, _LOST_ERRORS)
        self._throttle_bits = _throttle_bits(nvml)
        self._throttle_mask = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                               or nvml.nvmlDeviceGetCurrentClocksThrottleReasons)
        self._readers: dict[str, FieldReader] = {name: getattr(self, f"_read_{name}") for name in self.FIELDS}
        if tree is None:
            for gpu in gpus:
                gpu.unsupported.add("process_memory")
        self._xid = XidWatcher(nvml, [gpu for gpu in gpus if not gpu.lost], self._warnings)

    @classmethod
    def create(cls, config: ForgeConfig) -> NvidiaCollector:
        nvml = _start_nvml()
        try:
            return cls(nvml, _open_gpus(nvml, config), _process_tree(config))
        except BaseException:
            _shutdown(nvml)
            raise

    @property
    def gpus(self) -> tuple[NvidiaGpu, ...]:
        return tuple(self._gpus)

    @property
    def xid_watched(self) -> list[int]:
        """Indices of the GPUs whose XID events are counted."""
        return self._xid.watched

    def read(self, readings: Readings) -> None:
        with self._lock:
            self._pids = None
            for gpu in self._gpus:
                if not gpu.lost:
                    self._read_gpu(gpu, readings)
                _add_status(gpu, readings)
            self._add_xid_counts(readings)

    def sample_field(self, index: int, field_name: str) -> list[Row]:
        """One raw read of one field of one GPU, errors raised as NVML raises them (for diagnostics)."""
        gpu = next(gpu for gpu in self._gpus if gpu.index == index)
        with self._lock:
            self._pids = None
            return self._readers[field_name](gpu.handle)

    def describe(self) -> list[str]:
        return [_describe(gpu) for gpu in self._gpus]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._xid.close()
        with self._lock:  # a read in progress finishes before NVML goes away
            _shutdown(self._nvml)

    # --- one GPU -----------------------------------------------------------------------------

    def _read_gpu(self, gpu: NvidiaGpu, readings: Readings) -> None:
        rows: list[Row] = []
        for name, reader in self._readers.items():
            if name not in gpu.unsupported:
                rows += self._read_field(gpu, name, reader)
                if gpu.lost:
                    return  # lost during this read: only hw.status from now on
        for metric, value, extra in rows + _power_utilization(rows):
            readings.add(metric, value, {**gpu.attributes, **extra})

    def _read_field(self, gpu: NvidiaGpu, name: str, reader: FieldReader) -> list[Row]:
        try:
            return reader(gpu.handle)
        except self._unsupported_errors as error:
            gpu.unsupported.add(name)
            _logger.debug("GPU %d: %s not supported (%s); no longer read", gpu.index, name, error)
        except self._lost_errors as error:
            gpu.lost = True
            _logger.warning("GPU %d (%s) is lost: %s; it reports hw.status failed from now on",
                            gpu.index, gpu.uuid, error)
        except Exception as error:  # noqa: BLE001 - one field's failure costs that field, this read
            self._warnings.warning(name, "GPU %d: reading %s failed: %s", gpu.index, name, error)
        return []

    def _add_xid_counts(self, readings: Readings) -> None:
        by_index = {gpu.index: gpu for gpu in self._gpus}
        for (index, code), count in sorted(self._xid.counts().items()):
            readings.add("otel_forge.gpu.xid.errors", count,
                         {**by_index[index].attributes, "otel_forge.gpu.xid": str(code)})

    # --- field readers: handle -> rows --------------------------------------------------------

    def _read_utilization(self, handle: Any) -> list[Row]:
        rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
        return [("hw.gpu.utilization", rates.gpu / 100, {"hw.gpu.task": "general"}),
                ("otel_forge.gpu.memory.activity", rates.memory / 100, {})]

    def _read_memory(self, handle: Any) -> list[Row]:
        memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = memory.used / memory.total if memory.total else None
        return [("hw.gpu.memory.usage", memory.used, {}), ("hw.gpu.memory.limit", memory.total, {}),
                ("hw.gpu.memory.utilization", utilization, {})]

    def _read_power(self, handle: Any) -> list[Row]:
        return [("hw.power", self._nvml.nvmlDeviceGetPowerUsage(handle) / 1000, {})]  # mW

    def _read_power_limit(self, handle: Any) -> list[Row]:
        return [("otel_forge.gpu.power.limit", self._nvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1000, {})]

    def _read_energy(self, handle: Any) -> list[Row]:
        return [("hw.energy", self._nvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1000, {})]  # mJ

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
        nvml = self._nvml
        # NVML reports KB/s (KiB) sampled over 20 ms, so each call takes ~20 ms.
        return [("otel_forge.gpu.pcie.throughput", nvml.nvmlDeviceGetPcieThroughput(handle, counter) * 1024,
                 {"network.io.direction": direction})
                for counter, direction in ((nvml.NVML_PCIE_UTIL_TX_BYTES, "transmit"),
                                           (nvml.NVML_PCIE_UTIL_RX_BYTES, "receive"))]

    def _read_ecc(self, handle: Any) -> list[Row]:
        nvml = self._nvml
        return [("hw.errors", nvml.nvmlDeviceGetTotalEccErrors(handle, error_type, nvml.NVML_VOLATILE_ECC),
                 {"hw.error.type": label})
                for error_type, label in ((nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED, "corrected"),
                                          (nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, "uncorrected"))]

    def _read_throttle(self, handle: Any) -> list[Row]:
        try:
            mask = self._throttle_mask(handle)
        except self._nvml.NVMLError_FunctionNotFound:
            legacy = getattr(self._nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
            if legacy is None or self._throttle_mask is legacy:
                raise
            self._throttle_mask = legacy  # a driver older than the Event name
            mask = legacy(handle)
        return [("otel_forge.gpu.throttle", 1 if mask & bit else 0, {"otel_forge.gpu.throttle.reason": reason})
                for reason, bit in self._throttle_bits]

    def _read_process_memory(self, handle: Any) -> list[Row]:
        processes = self._nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        pids = self._monitored_pids()
        used = sum(process.usedGpuMemory or 0 for process in processes if process.pid in pids)
        return [("otel_forge.gpu.process.memory.usage", used, {})]

    def _monitored_pids(self) -> set[int]:
        if self._pids is None:
            self._pids = self._tree.pids() if self._tree is not None else set()
        return self._pids


class XidWatcher:
    """Counts XID critical-error events per (GPU index, XID code) on a daemon thread.

    GPUs whose events cannot be registered (``NotSupported``) are skipped. ``close`` stops the
    thread within ``XID_WAIT_MS`` and frees the event set.
    """

    def __init__(self, nvml: Any, gpus: list[NvidiaGpu], warnings: RateLimitedLogger) -> None:
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

    def _start(self, gpus: list[NvidiaGpu]) -> None:
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

    def _register(self, gpu: NvidiaGpu) -> None:
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


def _start_nvml() -> Any:
    """Import pynvml and initialise NVML, or say why not."""
    try:
        import pynvml
    except ImportError as error:
        raise CollectorUnavailable(f"nvidia-ml-py is not installed ({error})") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise CollectorUnavailable("NVML library (libnvidia-ml.so.1) not found: no NVIDIA driver installed") from None
    except pynvml.NVMLError_DriverNotLoaded:
        raise CollectorUnavailable("the NVIDIA driver is not loaded") from None
    except pynvml.NVMLError as error:
        raise CollectorUnavailable(f"NVML failed to initialise: {error}") from None
    return pynvml


def _open_gpus(nvml: Any, config: ForgeConfig) -> list[NvidiaGpu]:
    count = nvml.nvmlDeviceGetCount()
    present = [gpu for gpu in (_open_gpu(nvml, index) for index in range(count)) if gpu is not None]
    if not present:
        raise CollectorUnavailable("NVML found no GPUs" if count == 0 else "no GPU could be opened")
    try:
        wanted = select_gpus(config.gpus, [(gpu.index, gpu.uuid) for gpu in present], NVIDIA_VISIBLE_ENV)
    except ValueError as error:
        raise CollectorUnavailable(f"GPU selection: {error}") from None
    if not wanted:
        raise CollectorUnavailable(f"no GPU selected (gpus={config.gpus!r})")
    by_index = {gpu.index: gpu for gpu in present}
    return [by_index[index] for index in wanted]


def _open_gpu(nvml: Any, index: int) -> NvidiaGpu | None:
    """The GPU at ``index``; a lost one is kept (it reports failed), an unreadable one skipped."""
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        name, uuid = _text(nvml.nvmlDeviceGetName(handle)), _text(nvml.nvmlDeviceGetUUID(handle))
    except _error_classes(nvml, _LOST_ERRORS) as error:
        _logger.warning("GPU %d is lost (%s); it reports hw.status failed", index, error)
        return NvidiaGpu(index, None, "unknown", "", "", lost=True)
    except nvml.NVMLError as error:
        _logger.warning("GPU %d cannot be opened (%s); it is not monitored", index, error)
        return None
    return NvidiaGpu(index, handle, name, uuid, _pci_bus_id(nvml, handle))


def _pci_bus_id(nvml: Any, handle: Any) -> str:
    try:
        return _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
    except nvml.NVMLError:
        return ""


def _process_tree(config: ForgeConfig) -> ProcessTree | None:
    pid = config.pid or os.getpid()
    try:
        return ProcessTree(pid)
    except CollectorUnavailable as error:
        _logger.warning("GPU memory of the monitored processes is not reported: %s", error)
        return None


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as error:
        _logger.debug("nvmlShutdown failed: %s", error)


# --- small helpers ---------------------------------------------------------------------------


def _add_status(gpu: NvidiaGpu, readings: Readings) -> None:
    for state, current in (("ok", not gpu.lost), ("failed", gpu.lost)):
        readings.add("hw.status", 1 if current else 0, {**gpu.attributes, "hw.state": state})


def _power_utilization(rows: list[Row]) -> list[Row]:
    """Power draw / enforced limit, when this read has both."""
    values = {metric: value for metric, value, _ in rows if metric in ("hw.power", "otel_forge.gpu.power.limit")}
    power, limit = values.get("hw.power"), values.get("otel_forge.gpu.power.limit")
    return [("otel_forge.gpu.power.utilization", power / limit, {})] if power is not None and limit else []


def _describe(gpu: NvidiaGpu) -> str:
    line = " ".join(filter(None, (f"gpu {gpu.index}:", gpu.name, gpu.uuid, gpu.pci_bus_id)))
    if gpu.lost:
        line += " (failed)"
    if gpu.unsupported:
        line += f" (not supported: {', '.join(sorted(gpu.unsupported))})"
    return line


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


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
