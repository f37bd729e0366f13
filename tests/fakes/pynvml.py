"""A fake ``pynvml`` (nvidia-ml-py) for tests: NVML's Python API over simulated GPUs.

README
------
Put ``tests/fakes`` first on ``sys.path`` (or ``PYTHONPATH=tests/fakes``) and ``import pynvml``
finds this module instead of the real one. It is not a package on purpose.

Everything NVML defines is the real thing: the real pynvml is loaded from site-packages under
another name and its error classes (``NVMLError``, ``NVMLError_NotSupported``,
``NVMLError_GpuIsLost``, ``NVMLError_Timeout``, ...), ``NVML_*`` constants, ``nvmlEventType*``,
clock-reason bits and ctypes structs (``c_nvmlUtilization_t``, ``c_nvmlMemory_t``,
``nvmlPciInfo_t``, ``c_nvmlEventData_t``, device handles) are re-exported. Only the functions
are simulated.

Scenario: the env var ``OTEL_FORGE_FAKE_GPUS`` (JSON text, or a path to a JSON file), read again
at each first ``nvmlInit()`` (one with no other init outstanding); ``configure(dict)`` overrides
it in-process. The fake amdsmi reads the same variable: keys under ``"nvidia": {...}`` apply to
this fake only (over the top-level ones), and ``"nvidia": false`` means no NVIDIA driver
(``library_missing``). Keys (all optional; GPU keys are indices as strings):

- ``count`` (2): number of GPUs. ``name``: model name of every GPU. ``not_supported`` may name
  ``nvmlDeviceGetSerial`` (consumer boards have no serial number).
- ``library_missing`` / ``driver_not_loaded``: ``nvmlInit`` raises LibraryNotFound / DriverNotLoaded.
- ``not_supported``: {"1": ["power", ...]} fields (or function names) raising NotSupported.
  Fields: utilization encoder decoder memory power power_limit energy temperature clock pcie ecc
  throttle processes events, and the field-id groups memory_temperature nvlink_io nvlink_errors
  pcie_replays row_remapping retired_pages violation: in ``nvmlDeviceGetFieldValues`` a field
  unsupported (or in ``errors``) sets that entry's ``nvmlReturn``, as NVML does, and the call
  succeeds; ``field_values`` (or the function name) fails the whole call.
- ``errors``: {"0": {"power": "Unknown"}} field or function -> NVMLError_<name> raised every call.
- ``lost``: ["3"] GPUs lost from the start; ``lost_after_reads``: {"2": 3} a GPU that answers 3
  calls of each function, then raises GpuIsLost for everything.
- ``sequences``: {"0": {"utilization": [10, 20, 30]}} values returned in turn (cycling), per value
  key: utilization memory_activity (%), memory_used memory_total (bytes), power power_limit (W),
  energy (J), temperature (C), sm_clock memory_clock (MHz), pcie_tx pcie_rx (KB/s),
  ecc_corrected ecc_uncorrected, throttle (bitmask), encoder decoder (%), memory_temperature (C),
  nvlink_tx nvlink_rx (KiB since init), nvlink_crc_flit nvlink_crc_data nvlink_replay
  nvlink_recovery pcie_replays remapped_corrected remapped_uncorrected remap_pending
  remap_failure retired_sbe retired_dbe retired_pending, power_violation thermal_violation (ns).
  Without one, values change deterministically with the number of reads.
- ``degraded``: true: memory going bad and links erring: PCIe replays and NVLink CRC errors grow,
  an uncorrectable row remap happened, another waits (pending), remapping failed.
- ``mig``: {"0": ["1g.10gb", "3g.40gb"]} GPU 0 is in MIG mode with these instances (GPU instance
  ids 1, 2, ... in slots 0, 1, ...), each a device of its own: UUID ``MIG-...``, name
  "<GPU name> MIG <profile>", its own memory; ``nvmlDeviceGetUtilizationRates`` on it raises
  NotSupported (as today's drivers do) unless ``mig_utilization`` is true. Scenario keys of an
  instance are "<gpu>_mig<id>" ({"sequences": {"0_mig1": {"memory_used": [...]}}}); its calls are
  counted under that key.
- ``no_nvlink``: true: the NVLink fields are NotSupported everywhere (a PCIe-only board).
- ``processes``: {"0": [["self", 1048576], [1234, null]]} compute processes (pid, used bytes);
  "self" is the pid of the process calling NVML, "parent" its parent.
- ``xid_events``: [[0, 79], ...] XID events delivered by ``nvmlEventSetWait_v2`` after init.
- ``hot``: true: temperatures near 90 C and the thermal throttle bits set.
- ``gpm``: true: GPM (GPU Performance Monitoring) on every GPU whose model has it (Hopper and newer:
  the default H100 name does; ``"name": "NVIDIA A100-SXM4-80GB"`` does not); or a list of GPU
  indices (["0"]). Off by default, so a scenario that does not ask for it makes no GPM call per read.
  ``nvmlGpmQueryDeviceSupport`` answers ``isSupportedDevice`` 0 where GPM is off (as NVML does on
  a GPU without it); ``not_supported``/``errors`` field ``gpm`` (or a function name) covers every
  nvmlGpm* call of a device (``"0_mig1"`` for ``nvmlGpmMigSampleGet`` of an instance), and a
  metric's constant name (``NVML_GPM_METRIC_FP64_UTIL``) sets that metric's ``nvmlReturn`` only.
  Samples are numbered per device from 0; ``nvmlGpmMetricsGet`` computes every metric from the
  pair (values depend on the later sample's number n, and the GPU): sequences keys
  sm_activity sm_occupancy tensor_activity fp64_activity fp32_activity fp16_activity
  dram_activity (%), gpm_pcie_tx gpm_pcie_rx gpm_nvlink_tx gpm_nvlink_rx (MiB/s) are taken at
  index n - 1 (the first pair gives the first value). A MIG instance's pair has no PCIe/NVLink
  metric (NotSupported entries); ``no_nvlink`` makes the NVLink ones NotSupported too.
- ``cuda_driver_version`` (12040): what ``nvmlSystemGetCudaDriverVersion`` returns; null: NotSupported.

Python API for in-process tests: ``configure``, ``calls``, ``call_counts``, ``reset_counts``,
``inject_xid``, ``lose_gpu``, ``set_error``, ``gpm_samples_alive``, ``initialized``. Call counts
start again at each first init.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
import threading
import time
from typing import Any

from _fakegpu import FakeState, load_scenario

_REAL_MODULE = "_otel_forge_real_pynvml"
_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_real_pynvml() -> Any:
    """The installed nvidia-ml-py, loaded under another name (once per process)."""
    if _REAL_MODULE in sys.modules:
        return sys.modules[_REAL_MODULE]
    search = [entry for entry in sys.path if os.path.abspath(entry or os.getcwd()) != _HERE]
    found = importlib.machinery.PathFinder.find_spec("pynvml", search)
    if found is None or not found.origin:
        raise ImportError("the fake pynvml re-uses the real nvidia-ml-py, which is not installed")
    spec = importlib.util.spec_from_file_location(_REAL_MODULE, found.origin)
    real = importlib.util.module_from_spec(spec)
    sys.modules[_REAL_MODULE] = real  # its error classes are generated through sys.modules[__name__]
    spec.loader.exec_module(real)
    return real


_real = _load_real_pynvml()
_EXPORTED = (
    "NVML_",
    "NVMLError",
    "NVMLLibraryMismatchError",
    "nvmlEventType",
    "nvmlClocksEventReason",
    "nvmlClocksThrottleReason",
    "c_nvml",
    "struct_c_nvml",
    "nvmlPciInfo_t",
    "nvmlFriendlyObject",
    "nvmlStructToFriendlyObject",
    "nvmlExceptionClass",
)
globals().update({name: getattr(_real, name) for name in dir(_real) if name.startswith(_EXPORTED)})
NVMLError = _real.NVMLError

# field -> the NVML functions it covers (not_supported / errors accept either).
_FIELDS = {
    "utilization": ("nvmlDeviceGetUtilizationRates",),
    "encoder": ("nvmlDeviceGetEncoderUtilization",),
    "decoder": ("nvmlDeviceGetDecoderUtilization",),
    "field_values": ("nvmlDeviceGetFieldValues",),
    "memory": ("nvmlDeviceGetMemoryInfo",),
    "power": ("nvmlDeviceGetPowerUsage",),
    "power_limit": ("nvmlDeviceGetEnforcedPowerLimit",),
    "energy": ("nvmlDeviceGetTotalEnergyConsumption",),
    "temperature": ("nvmlDeviceGetTemperature", "nvmlDeviceGetTemperatureV"),
    "clock": ("nvmlDeviceGetClockInfo",),
    "pcie": ("nvmlDeviceGetPcieThroughput",),
    "ecc": ("nvmlDeviceGetTotalEccErrors",),
    "row_remapping": ("nvmlDeviceGetRemappedRows",),
    "retired_pages": ("nvmlDeviceGetRetiredPages", "nvmlDeviceGetRetiredPagesPendingStatus"),
    "violation": ("nvmlDeviceGetViolationStatus",),
    "throttle": ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
    "processes": ("nvmlDeviceGetComputeRunningProcesses",),
    "events": ("nvmlDeviceRegisterEvents",),
    "gpm": ("nvmlGpmQueryDeviceSupport", "nvmlGpmSampleGet", "nvmlGpmMigSampleGet", "nvmlGpmMetricsGet"),
}
_FIELD_OF = {function: name for name, functions in _FIELDS.items() for function in functions}
_GIB = 1024**3
_THERMAL = _real.nvmlClocksEventReasonSwThermalSlowdown | _real.nvmlClocksEventReasonHwThermalSlowdown
_SAMPLING_PERIOD_US = 167_000
_MAX_MIG_DEVICES = 7
nvmlTemperature_v1 = _real.nvmlTemperature_v1


class _Device:
    def __init__(self, index: int, scenario: dict) -> None:
        self.index: int | str = index  # a MIG instance's is "<gpu>_mig<id>"
        self.struct = _real.struct_c_nvmlDevice_t()  # the handle points at it: a real device handle
        self.name = scenario.get("name", "NVIDIA H100 80GB HBM3")
        self.uuid = f"GPU-{0x1A2B0000 + index:08x}-0000-4000-8000-{index:012x}"
        self.pci_bus_id = f"00000000:{0x17 + 0x10 * index:02X}:00.0"
        self.lost = str(index) in {str(i) for i in scenario.get("lost", ())}
        self.lost_after = scenario.get("lost_after_reads", {}).get(str(index))
        self.parent: _Device | None = None
        self.mig: list[_Device] = [
            _MigDevice(self, gpu_instance, profile, scenario)
            for gpu_instance, profile in enumerate(scenario.get("mig", {}).get(str(index), ()), start=1)
        ]

    @property
    def handle(self) -> Any:
        return ctypes.pointer(self.struct)


class _MigDevice(_Device):
    """A MIG instance of ``parent``: its own handle, UUID and memory (the profile's size)."""

    def __init__(self, parent: _Device, gpu_instance: int, profile: str, scenario: dict) -> None:
        self.index = f"{parent.index}_mig{gpu_instance}"
        self.struct = _real.struct_c_nvmlDevice_t()
        self.name = f"{parent.name} MIG {profile}"
        number = int(str(parent.index)) * 16 + gpu_instance
        self.uuid = f"MIG-{0x3C4D0000 + number:08x}-0000-4000-8000-{number:012x}"
        self.pci_bus_id = parent.pci_bus_id
        self.parent = parent
        self.gpu_instance = gpu_instance
        self.ordinal = number  # what the default values are computed from
        self.memory_total = int(profile.split(".")[-1].removesuffix("gb")) * _GIB
        self.mig = []
        self.lost_after = None

    @property  # type: ignore[override]
    def lost(self) -> bool:
        return self.parent is not None and self.parent.lost

    @lost.setter
    def lost(self, value: bool) -> None:
        if self.parent is not None and value:
            self.parent.lost = True


class _State(FakeState):
    def __init__(self) -> None:
        super().__init__(threading.Condition(threading.RLock()))
        self.override: dict | None = None
        self.devices: list[_Device] = []
        self.pending_xids: list[tuple[int, int]] = []
        self.event_sets: dict[int, set[int]] = {}  # event set address -> registered GPU indices
        self.event_set_objects: dict[int, Any] = {}  # keeps each set's memory alive
        self.gpm_samples: dict[int, _GpmSample] = {}  # sample address -> the sample (alive until freed)


_state = _State()
calls, call_counts, reset_counts = _state.count_calls, _state.call_counts, _state.reset_counts
_value = _state.value


# --- Python API for tests ----------------------------------------------------------------------


def configure(scenario: dict | None) -> None:
    """Use ``scenario`` at the next first ``nvmlInit`` instead of the env var (None: the env var)."""
    with _state.lock:
        _state.override = None if scenario is None else dict(scenario)


def inject_xid(index: int, code: int) -> None:
    """Deliver an XID event for GPU ``index`` to the event sets it is registered on."""
    with _state.lock:
        _state.pending_xids.append((index, code))
        _state.lock.notify_all()


def lose_gpu(index: int) -> None:
    """GPU ``index`` falls off the bus: every later call for it raises NVMLError_GpuIsLost."""
    with _state.lock:
        _state.devices[index].lost = True


def set_error(gpu: int | str, what: str, error: str | None) -> None:
    """From now on, ``what`` (a field or function) of GPU ``gpu`` raises NVMLError_<error> ("NotSupported",
    "Unknown", ...); None: it answers again."""
    with _state.lock:
        errors = _state.scenario.setdefault("errors", {}).setdefault(str(gpu), {})
        if error is None:
            errors.pop(what, None)
        else:
            errors[what] = error


def gpm_samples_alive() -> int:
    """GPM samples allocated and not yet freed."""
    with _state.lock:
        return len(_state.gpm_samples)


def initialized() -> int:
    """Outstanding nvmlInit calls (0 once every init was shut down)."""
    return _state.initialized


# --- library lifecycle -----------------------------------------------------------------------


def _load_scenario() -> dict:
    return load_scenario(_state.override, "nvidia", "library_missing")


def nvmlInit() -> None:
    with _state.lock:
        scenario = _load_scenario() if _state.initialized == 0 else _state.scenario
        if scenario.get("library_missing"):
            raise _real.NVMLError_LibraryNotFound()
        if scenario.get("driver_not_loaded"):
            raise _real.NVMLError_DriverNotLoaded()
        if _state.initialized == 0:
            _start(scenario)
        _state.initialized += 1
        _count("nvmlInit")


def nvmlInitWithFlags(flags: int) -> None:
    nvmlInit()


def _start(scenario: dict) -> None:
    _state.scenario = scenario
    _state.devices = [_Device(index, scenario) for index in range(int(scenario.get("count", 2)))]
    _state.ticks.clear()
    _state.variant_calls.clear()
    _state.pending_xids = [(int(gpu), int(code)) for gpu, code in scenario.get("xid_events", ())]
    _state.event_sets.clear()
    _state.event_set_objects.clear()
    _state.gpm_samples.clear()
    _state.calls.clear()


def nvmlShutdown() -> None:
    _count("nvmlShutdown")
    with _state.lock:
        _require_init()
        _state.initialized -= 1
        _state.lock.notify_all()


def nvmlSystemGetDriverVersion() -> str:
    _count("nvmlSystemGetDriverVersion")
    _require_init()
    return "999.99-fake"


def nvmlSystemGetCudaDriverVersion() -> int:
    """The CUDA version the driver supports, as 1000 * major + 10 * minor (12040: 12.4)."""
    _count("nvmlSystemGetCudaDriverVersion")
    _require_init()
    version = _state.scenario.get("cuda_driver_version", 12040)
    if version is None:
        raise _real.NVMLError_NotSupported()
    return int(version)


nvmlSystemGetCudaDriverVersion_v2 = nvmlSystemGetCudaDriverVersion


def nvmlErrorString(code: int) -> str:
    return NVMLError._errcode_to_string.get(code, f"fake NVML error {code}")


# --- devices -----------------------------------------------------------------------------------


def nvmlDeviceGetCount() -> int:
    _count("nvmlDeviceGetCount")
    _require_init()
    return len(_state.devices)


def nvmlDeviceGetHandleByIndex(index: int) -> Any:
    _count("nvmlDeviceGetHandleByIndex", index)
    _require_init()
    if not 0 <= index < len(_state.devices):
        raise _real.NVMLError_InvalidArgument()
    device = _state.devices[index]
    if device.lost:
        raise _real.NVMLError_GpuIsLost()
    return device.handle


def nvmlDeviceGetName(handle: Any) -> str:
    return _call("nvmlDeviceGetName", handle).name


def nvmlDeviceGetUUID(handle: Any) -> str:
    return _call("nvmlDeviceGetUUID", handle).uuid


def nvmlDeviceGetSerial(handle: Any) -> str:
    return f"{1654922000000 + _call('nvmlDeviceGetSerial', handle).index}"


def nvmlDeviceGetVbiosVersion(handle: Any) -> str:
    _call("nvmlDeviceGetVbiosVersion", handle)
    return "96.00.89.00.01"


def nvmlDeviceGetIndex(handle: Any) -> int:
    return _call("nvmlDeviceGetIndex", handle).index


def nvmlDeviceGetPciInfo(handle: Any) -> Any:
    device = _call("nvmlDeviceGetPciInfo", handle)
    info = _real.nvmlPciInfo_t()
    info.busId = info.busIdLegacy = device.pci_bus_id.encode()
    return info


def nvmlDeviceGetUtilizationRates(handle: Any) -> Any:
    device = _call("nvmlDeviceGetUtilizationRates", handle)
    if device.parent is not None and not _state.scenario.get("mig_utilization"):
        raise _real.NVMLError_NotSupported()  # what today's drivers answer for a MIG instance
    gpu = _value(device, "utilization", lambda n, i: (10 * i + 7 * n) % 101)
    memory = _value(device, "memory_activity", lambda n, i: (5 * i + 3 * n) % 101)
    return _real.c_nvmlUtilization_t(gpu=int(gpu), memory=int(memory))


def nvmlDeviceGetEncoderUtilization(handle: Any) -> list[int]:
    device = _call("nvmlDeviceGetEncoderUtilization", handle)
    return [int(_value(device, "encoder", lambda n, i: 0)), _SAMPLING_PERIOD_US]


def nvmlDeviceGetDecoderUtilization(handle: Any) -> list[int]:
    device = _call("nvmlDeviceGetDecoderUtilization", handle)
    return [int(_value(device, "decoder", lambda n, i: (3 * n + i) % 20)), _SAMPLING_PERIOD_US]


def nvmlDeviceGetMemoryInfo(handle: Any, version: Any = None) -> Any:
    device = _call("nvmlDeviceGetMemoryInfo", handle)
    size = device.memory_total if isinstance(device, _MigDevice) else 80 * _GIB
    total = int(_value(device, "memory_total", lambda n, i: size))
    used = int(_value(device, "memory_used", lambda n, i: total * ((20 + 5 * i + n) % 90) // 100))
    return _real.c_nvmlMemory_t(total=total, free=total - used, used=used)


def nvmlDeviceGetPowerUsage(handle: Any) -> int:
    device = _call("nvmlDeviceGetPowerUsage", handle)
    return int(_value(device, "power", lambda n, i: 100 + 10 * i + 5 * (n % 10)) * 1000)  # mW


def nvmlDeviceGetEnforcedPowerLimit(handle: Any) -> int:
    device = _call("nvmlDeviceGetEnforcedPowerLimit", handle)
    return int(_value(device, "power_limit", lambda n, i: 700) * 1000)  # mW


def nvmlDeviceGetTotalEnergyConsumption(handle: Any) -> int:
    device = _call("nvmlDeviceGetTotalEnergyConsumption", handle)
    return int(_value(device, "energy", lambda n, i: 10_000 + n * (100 + 10 * i)) * 1000)  # mJ


def nvmlDeviceGetTemperature(handle: Any, sensor: int) -> int:
    device = _call("nvmlDeviceGetTemperature", handle, sensor)
    hot = _state.scenario.get("hot")
    return int(_value(device, "temperature", lambda n, i: (88 if hot else 40) + i + n % 5))


def nvmlDeviceGetTemperatureV(handle: Any, sensor: int, version: int = nvmlTemperature_v1) -> int:
    if version != nvmlTemperature_v1:
        raise _real.NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    device = _call("nvmlDeviceGetTemperatureV", handle, sensor)
    hot = _state.scenario.get("hot")
    return int(_value(device, "temperature", lambda n, i: (88 if hot else 40) + i + n % 5))


def nvmlDeviceGetClockInfo(handle: Any, clock_type: int) -> int:
    device = _call("nvmlDeviceGetClockInfo", handle, clock_type)
    if clock_type == _real.NVML_CLOCK_MEM:
        return int(_value(device, "memory_clock", lambda n, i: 2619))
    return int(_value(device, "sm_clock", lambda n, i: 1980 - 15 * ((n + i) % 4)))


def nvmlDeviceGetPcieThroughput(handle: Any, counter: int) -> int:
    device = _call("nvmlDeviceGetPcieThroughput", handle, counter)
    if counter == _real.NVML_PCIE_UTIL_TX_BYTES:
        return int(_value(device, "pcie_tx", lambda n, i: 1000 * (1 + (n + i) % 50)))
    return int(_value(device, "pcie_rx", lambda n, i: 2000 * (1 + (n + i) % 50)))


def nvmlDeviceGetTotalEccErrors(handle: Any, error_type: int, counter_type: int) -> int:
    device = _call("nvmlDeviceGetTotalEccErrors", handle, error_type)
    if error_type == _real.NVML_MEMORY_ERROR_TYPE_CORRECTED:
        return int(_value(device, "ecc_corrected", lambda n, i: n // 3))
    return int(_value(device, "ecc_uncorrected", lambda n, i: 0))


def nvmlDeviceGetRemappedRows(handle: Any) -> tuple[int, int, int, int]:
    """(corrRows, uncRows, isPending, failureOccurred), as nvidia-ml-py returns them."""
    device = _call("nvmlDeviceGetRemappedRows", handle)
    return tuple(int(_FIELD_VALUES[field_id][1](device)) for field_id in _REMAP_IDS)  # type: ignore[return-value]


def nvmlDeviceGetRetiredPages(handle: Any, source_filter: int) -> list[int]:
    device = _call("nvmlDeviceGetRetiredPages", handle, source_filter)
    single = source_filter == _real.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
    count = int(_FIELD_VALUES[_real.NVML_FI_DEV_RETIRED_SBE if single else _real.NVML_FI_DEV_RETIRED_DBE][1](device))
    return [0x1000 * (page + 1) for page in range(count)]


def nvmlDeviceGetRetiredPagesPendingStatus(handle: Any) -> int:
    device = _call("nvmlDeviceGetRetiredPagesPendingStatus", handle)
    return int(_FIELD_VALUES[_real.NVML_FI_DEV_RETIRED_PENDING][1](device))


def nvmlDeviceGetViolationStatus(handle: Any, perf_policy_type: int) -> Any:
    device = _call("nvmlDeviceGetViolationStatus", handle, perf_policy_type)
    field_id = {
        _real.NVML_PERF_POLICY_POWER: _real.NVML_FI_DEV_PERF_POLICY_POWER,
        _real.NVML_PERF_POLICY_THERMAL: _real.NVML_FI_DEV_PERF_POLICY_THERMAL,
    }.get(perf_policy_type)
    if field_id is None:
        raise _real.NVMLError_NotSupported()
    return _real.c_nvmlViolationTime_t(
        referenceTime=int(time.time() * 1_000_000), violationTime=int(_FIELD_VALUES[field_id][1](device))
    )


def nvmlDeviceGetFieldValues(handle: Any, fieldIds: list) -> Any:  # noqa: N803 - nvidia-ml-py's name
    """An array of c_nvmlFieldValue_t, one per requested id (or (id, scopeId)): each with its own nvmlReturn."""
    device = _call("nvmlDeviceGetFieldValues", handle)
    values = (_real.c_nvmlFieldValue_t * len(fieldIds))()
    for value, requested in zip(values, fieldIds, strict=True):
        field_id, scope = requested if isinstance(requested, tuple) else (requested, 0)
        value.fieldId, value.scopeId = field_id, scope
        value.timestamp = int(time.time() * 1_000_000)
        value.nvmlReturn = _field_return(device, field_id)
        if value.nvmlReturn == _real.NVML_SUCCESS:
            value_type, read = _FIELD_VALUES[field_id]
            value.valueType = value_type
            setattr(value.value, _MEMBER[value_type], read(device))
    return values


def _field_return(device: _Device, field_id: int) -> int:
    """The nvmlReturn of one entry: NotSupported for an id the fake does not simulate or a MIG
    instance asks for, else as the scenario says for the id's field."""
    if field_id not in _FIELD_VALUES or device.parent is not None:
        return _real.NVML_ERROR_NOT_SUPPORTED
    field = _FIELD_OF_ID[field_id]
    gpu_key = str(device.index)
    if field in _state.scenario.get("not_supported", {}).get(gpu_key, ()) or (
        field in ("nvlink_io", "nvlink_errors") and _state.scenario.get("no_nvlink")
    ):
        return _real.NVML_ERROR_NOT_SUPPORTED
    error_name = _state.scenario.get("errors", {}).get(gpu_key, {}).get(field)
    if error_name:
        return getattr(_real, f"NVMLError_{error_name}")().value
    return _real.NVML_SUCCESS


def nvmlDeviceGetCurrentClocksEventReasons(handle: Any) -> int:
    return _throttle(_call("nvmlDeviceGetCurrentClocksEventReasons", handle))


def nvmlDeviceGetCurrentClocksThrottleReasons(handle: Any) -> int:
    return _throttle(_call("nvmlDeviceGetCurrentClocksThrottleReasons", handle))


def _throttle(device: _Device) -> int:
    hot = _state.scenario.get("hot")
    return int(_value(device, "throttle", lambda n, i: _THERMAL if hot else 0))


def nvmlDeviceGetComputeRunningProcesses(handle: Any) -> list:
    device = _call("nvmlDeviceGetComputeRunningProcesses", handle)
    pids = {"self": os.getpid(), "parent": os.getppid()}
    return [
        _real.nvmlFriendlyObject(
            {
                "pid": pids.get(pid, pid),
                "usedGpuMemory": used,
                "gpuInstanceId": 0xFFFFFFFF,
                "computeInstanceId": 0xFFFFFFFF,
            }
        )
        for pid, used in _state.scenario.get("processes", {}).get(str(device.index), ())
    ]


# --- MIG ---------------------------------------------------------------------------------------


def nvmlDeviceGetMigMode(handle: Any) -> list[int]:
    """[current, pending]: enabled on the GPUs the scenario gives MIG instances."""
    device = _call("nvmlDeviceGetMigMode", handle)
    if device.parent is not None:
        raise _real.NVMLError_InvalidArgument()
    mode = _real.NVML_DEVICE_MIG_ENABLE if device.mig else _real.NVML_DEVICE_MIG_DISABLE
    return [mode, mode]


def nvmlDeviceGetMaxMigDeviceCount(handle: Any) -> int:
    device = _call("nvmlDeviceGetMaxMigDeviceCount", handle)
    return _MAX_MIG_DEVICES if device.mig else 0


def nvmlDeviceGetMigDeviceHandleByIndex(handle: Any, index: int) -> Any:
    device = _call("nvmlDeviceGetMigDeviceHandleByIndex", handle, index)
    if not device.mig or not 0 <= index < _MAX_MIG_DEVICES:
        raise _real.NVMLError_InvalidArgument()
    if index >= len(device.mig):
        raise _real.NVMLError_NotFound()  # an empty slot
    return device.mig[index].handle


def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice: Any) -> Any:  # noqa: N803 - nvidia-ml-py's name
    device = _call("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", migDevice)
    if device.parent is None:
        raise _real.NVMLError_InvalidArgument()
    return device.parent.handle


def nvmlDeviceIsMigDeviceHandle(handle: Any) -> int:
    return int(_call("nvmlDeviceIsMigDeviceHandle", handle).parent is not None)


def nvmlDeviceGetGpuInstanceId(handle: Any) -> int:
    device = _call("nvmlDeviceGetGpuInstanceId", handle)
    if not isinstance(device, _MigDevice):
        raise _real.NVMLError_InvalidArgument()
    return device.gpu_instance


def nvmlDeviceGetComputeInstanceId(handle: Any) -> int:
    device = _call("nvmlDeviceGetComputeInstanceId", handle)
    if not isinstance(device, _MigDevice):
        raise _real.NVMLError_InvalidArgument()
    return 0


# --- GPM (GPU Performance Monitoring) ----------------------------------------------------------


class _GpmSample:
    """An allocated GPM sample: its memory, and once taken, the device and its number there."""

    def __init__(self) -> None:
        self.struct = _real.struct_c_nvmlGpmSample_t()
        self.device: _Device | None = None
        self.number = -1


_GPM_MODELS = ("H100", "H200", "H800", "H20", "GH200", "B100", "B200", "GB200", "B300")
_MIB = 1024 * 1024


def _gpm_default(base: int, gpu_step: int, sample_step: int, modulo: int = 101) -> Any:
    return lambda n, i: (base + gpu_step * i + sample_step * n) % modulo


# metric id -> (sequence key, default value of (later sample's number, GPU ordinal)), as NVML computes
# them: percentages 0..100, throughputs in MiB/s.
_GPM_VALUES: dict[int, tuple[str, Any]] = {
    _real.NVML_GPM_METRIC_SM_UTIL: ("sm_activity", _gpm_default(40, 10, 3)),
    _real.NVML_GPM_METRIC_SM_OCCUPANCY: ("sm_occupancy", _gpm_default(20, 5, 2)),
    _real.NVML_GPM_METRIC_ANY_TENSOR_UTIL: ("tensor_activity", _gpm_default(30, 7, 1)),
    _real.NVML_GPM_METRIC_FP64_UTIL: ("fp64_activity", _gpm_default(0, 2, 1, 10)),
    _real.NVML_GPM_METRIC_FP32_UTIL: ("fp32_activity", _gpm_default(15, 1, 1)),
    _real.NVML_GPM_METRIC_FP16_UTIL: ("fp16_activity", _gpm_default(5, 1, 2)),
    _real.NVML_GPM_METRIC_DRAM_BW_UTIL: ("dram_activity", _gpm_default(25, 4, 1)),
    _real.NVML_GPM_METRIC_PCIE_TX_PER_SEC: ("gpm_pcie_tx", lambda n, i: 1000 + 100 * i + 10 * n),
    _real.NVML_GPM_METRIC_PCIE_RX_PER_SEC: ("gpm_pcie_rx", lambda n, i: 2000 + 100 * i + 10 * n),
    _real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: ("gpm_nvlink_tx", lambda n, i: 50_000 + 1000 * i + n),
    _real.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: ("gpm_nvlink_rx", lambda n, i: 40_000 + 1000 * i + n),
}
_GPM_LINKS = {
    _real.NVML_GPM_METRIC_PCIE_TX_PER_SEC,
    _real.NVML_GPM_METRIC_PCIE_RX_PER_SEC,
    _real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC,
    _real.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC,
}
_GPM_NVLINK = {_real.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC, _real.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC}
_GPM_METRIC_NAMES = {
    getattr(_real, name): name
    for name in dir(_real)
    if name.startswith("NVML_GPM_METRIC_") and name != "NVML_GPM_METRIC_MAX"
}


def _gpm_supported(device: _Device) -> bool:
    gpu = device.parent or device
    wanted = _state.scenario.get("gpm")
    on = wanted is True or (isinstance(wanted, list) and str(gpu.index) in {str(key) for key in wanted})
    return on and any(model in gpu.name for model in _GPM_MODELS)


def nvmlGpmQueryDeviceSupport(device: Any) -> Any:
    """A c_nvmlGpmSupport_t: isSupportedDevice 1 where the scenario turns GPM on (Hopper and newer)."""
    found = _call("nvmlGpmQueryDeviceSupport", device)
    support = _real.c_nvmlGpmSupport_t()
    support.version = _real.NVML_GPM_SUPPORT_VERSION
    support.isSupportedDevice = int(found.parent is None and _gpm_supported(found))
    return support


def nvmlGpmSampleAlloc() -> Any:
    _count("nvmlGpmSampleAlloc")
    _require_init()
    sample = _GpmSample()
    pointer = ctypes.pointer(sample.struct)
    with _state.lock:
        _state.gpm_samples[_address(pointer)] = sample
    return pointer


def nvmlGpmSampleFree(gpmSample: Any) -> None:  # noqa: N803 - nvidia-ml-py's name
    _count("nvmlGpmSampleFree")
    with _state.lock:
        if _state.gpm_samples.pop(_address(gpmSample), None) is None:
            raise _real.NVMLError_InvalidArgument()


def nvmlGpmSampleGet(device: Any, gpmSample: Any) -> Any:  # noqa: N803 - nvidia-ml-py's name
    found = _call("nvmlGpmSampleGet", device)
    if found.parent is not None or not _gpm_supported(found):
        raise _real.NVMLError_NotSupported()  # a MIG instance is sampled through nvmlGpmMigSampleGet
    _take(found, gpmSample)
    return gpmSample


def nvmlGpmMigSampleGet(device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:  # noqa: N803 - nvidia-ml-py's names
    """A sample of GPU instance ``gpuInstanceId`` of GPU ``device`` (counted under the instance's key)."""
    with _state.lock:
        _require_init()
        gpu = _device(device)
    instance = next((mig for mig in gpu.mig if mig.gpu_instance == gpuInstanceId), None)
    if instance is None:
        _count("nvmlGpmMigSampleGet", gpu.index)
        raise _real.NVMLError_InvalidArgument()
    _call("nvmlGpmMigSampleGet", instance.handle)
    if not _gpm_supported(instance):
        raise _real.NVMLError_NotSupported()
    _take(instance, gpmSample)
    return gpmSample


def _take(device: _Device, pointer: Any) -> None:
    with _state.lock:
        sample = _state.gpm_samples.get(_address(pointer))
        if sample is None:
            raise _real.NVMLError_InvalidArgument()
        sample.device = device
        sample.number = _state.ticks[("gpm_sample", device.index)]
        _state.ticks[("gpm_sample", device.index)] += 1


def nvmlGpmMetricsGet(metricsGet: Any) -> Any:  # noqa: N803 - nvidia-ml-py's name
    """Fills ``metrics[i].value`` and ``.nvmlReturn`` for the first ``numMetrics`` ids, between sample1 and sample2."""
    if metricsGet.version != _real.NVML_GPM_METRICS_GET_VERSION:
        raise _real.NVMLError(_real.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
    with _state.lock:
        _require_init()
        first = _state.gpm_samples.get(_address(metricsGet.sample1)) if metricsGet.sample1 else None
        second = _state.gpm_samples.get(_address(metricsGet.sample2)) if metricsGet.sample2 else None
    if first is None or second is None or second.device is None or first.device is not second.device:
        _count("nvmlGpmMetricsGet")
        raise _real.NVMLError_InvalidArgument()
    device = second.device
    _call("nvmlGpmMetricsGet", device.handle)
    if not 0 < metricsGet.numMetrics <= _real.NVML_GPM_METRIC_MAX:
        raise _real.NVMLError_InvalidArgument()
    for position in range(metricsGet.numMetrics):
        metric = metricsGet.metrics[position]
        metric.nvmlReturn = _gpm_return(device, metric.metricId)
        metric.value = _gpm_value(device, metric.metricId, second.number) if metric.nvmlReturn == 0 else 0.0
    return metricsGet


def _gpm_return(device: _Device, metric_id: int) -> int:
    unsupported = set(_state.scenario.get("not_supported", {}).get(str(device.index), ()))
    if (
        metric_id not in _GPM_VALUES
        or _GPM_METRIC_NAMES.get(metric_id) in unsupported
        or (metric_id in _GPM_LINKS and device.parent is not None)
        or (metric_id in _GPM_NVLINK and _state.scenario.get("no_nvlink"))
    ):
        return _real.NVML_ERROR_NOT_SUPPORTED
    return _real.NVML_SUCCESS


def _gpm_value(device: _Device, metric_id: int, number: int) -> float:
    key, default = _GPM_VALUES[metric_id]
    sequence = _state.scenario.get("sequences", {}).get(str(device.index), {}).get(key)
    if sequence:
        return float(sequence[(number - 1) % len(sequence)])
    return float(default(number, getattr(device, "ordinal", device.index)))


# --- events ------------------------------------------------------------------------------------


def nvmlEventSetCreate() -> Any:
    _count("nvmlEventSetCreate")
    _require_init()
    event_set = ctypes.pointer(_real.struct_c_nvmlEventSet_t())
    with _state.lock:
        _state.event_sets[_address(event_set)] = set()
        _state.event_set_objects[_address(event_set)] = event_set
    return event_set


def nvmlDeviceRegisterEvents(handle: Any, event_types: int, event_set: Any) -> None:
    device = _call("nvmlDeviceRegisterEvents", handle)
    with _state.lock:
        registered = _state.event_sets.get(_address(event_set))
        if registered is None:
            raise _real.NVMLError_InvalidArgument()
        if event_types & _real.nvmlEventTypeXidCriticalError:
            registered.add(device.index)


def nvmlEventSetWait_v2(event_set: Any, timeout_ms: int) -> Any:
    _count("nvmlEventSetWait_v2")
    with _state.lock:
        _require_init()
        registered = _state.event_sets.get(_address(event_set))
        if registered is None:
            raise _real.NVMLError_InvalidArgument()
        if not _state.lock.wait_for(
            lambda: _pending_for(registered) is not None or not _state.initialized, timeout=timeout_ms / 1000
        ):
            raise _real.NVMLError_Timeout()
        _require_init()
        gpu, code = _state.pending_xids.pop(_pending_for(registered))
        return _real.c_nvmlEventData_t(
            device=_state.devices[gpu].handle, eventType=_real.nvmlEventTypeXidCriticalError, eventData=code
        )


nvmlEventSetWait = nvmlEventSetWait_v2


def nvmlEventSetFree(event_set: Any) -> None:
    _count("nvmlEventSetFree")
    with _state.lock:
        if _state.event_sets.pop(_address(event_set), None) is None:
            raise _real.NVMLError_InvalidArgument()
        _state.event_set_objects.pop(_address(event_set), None)


def _pending_for(registered: set[int]) -> int | None:
    return next((position for position, (gpu, _) in enumerate(_state.pending_xids) if gpu in registered), None)


# --- the simulation ----------------------------------------------------------------------------


def _count(function: str, index: int | None = None) -> None:
    with _state.lock:
        _state.calls[(function, index)] += 1


def _require_init() -> None:
    if not _state.initialized:
        raise _real.NVMLError_Uninitialized()


def _call(function: str, handle: Any, variant: Any = None) -> _Device:
    """Count a per-GPU call and raise what the scenario says this call raises.

    ``variant`` tells apart the calls of one function in one read (the clock, the counter), so
    ``lost_after_reads`` counts reads.
    """
    with _state.lock:
        _require_init()
        device = _device(handle)
        _state.calls[(function, device.index)] += 1
        previous_calls = _state.variant_calls[(function, variant, device.index)]
        _state.variant_calls[(function, variant, device.index)] += 1
        if device.lost_after is not None and previous_calls >= int(device.lost_after):
            device.lost = True
        if device.lost:
            raise _real.NVMLError_GpuIsLost()
        gpu_key = str(device.index)
        field = _FIELD_OF.get(function)
        if {function, field} & set(_state.scenario.get("not_supported", {}).get(gpu_key, ())):
            raise _real.NVMLError_NotSupported()
        errors = _state.scenario.get("errors", {}).get(gpu_key, {})
        error_name = errors.get(function) or errors.get(field)
        if error_name:
            raise getattr(_real, f"NVMLError_{error_name}")()
        return device


def _device(handle: Any) -> _Device:
    address = _address(handle)
    for device in (device for gpu in _state.devices for device in (gpu, *gpu.mig)):
        if ctypes.addressof(device.struct) == address:
            return device
    raise _real.NVMLError_InvalidArgument()


def _address(pointer: Any) -> int:
    try:
        return ctypes.cast(pointer, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        raise _real.NVMLError_InvalidArgument() from None


# --- field values (nvmlDeviceGetFieldValues) ---------------------------------------------------------


def _degraded() -> bool:
    return bool(_state.scenario.get("degraded"))


def _counter(key: str, default: Any) -> Any:
    """A reader of scenario value ``key`` (``default(n, index)`` without a sequence)."""
    return lambda device: _value(device, key, default)


_ULL, _UINT = _real.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, _real.NVML_VALUE_TYPE_UNSIGNED_INT
_MEMBER = {_ULL: "ullVal", _UINT: "uiVal"}
# field id -> (value type, reader of one value for a device), as NVML types each field.
_FIELD_VALUES: dict[int, tuple[int, Any]] = {
    _real.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: (
        _ULL,
        lambda device: int(_value(device, "energy", lambda n, i: 10_000 + n * (100 + 10 * i)) * 1000),  # mJ
    ),
    _real.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: (_ULL, _counter("ecc_corrected", lambda n, i: n // 3)),
    _real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: (_ULL, _counter("ecc_uncorrected", lambda n, i: 0)),
    _real.NVML_FI_DEV_MEMORY_TEMP: (
        _UINT,
        _counter("memory_temperature", lambda n, i: (92 if _state.scenario.get("hot") else 48) + i + n % 3),
    ),
    # KiB since the driver loaded, over all links.
    _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: (_ULL, _counter("nvlink_tx", lambda n, i: n * (50_000 + 1000 * i))),
    _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: (_ULL, _counter("nvlink_rx", lambda n, i: n * (40_000 + 1000 * i))),
    _real.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: (
        _ULL,
        _counter("nvlink_crc_flit", lambda n, i: 2 * n if _degraded() else 0),
    ),
    _real.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: (
        _ULL,
        _counter("nvlink_crc_data", lambda n, i: n if _degraded() else 0),
    ),
    _real.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: (_ULL, _counter("nvlink_replay", lambda n, i: 0)),
    _real.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: (_ULL, _counter("nvlink_recovery", lambda n, i: 0)),
    _real.NVML_FI_DEV_PCIE_REPLAY_COUNTER: (_UINT, _counter("pcie_replays", lambda n, i: 25 * n if _degraded() else 0)),
    _real.NVML_FI_DEV_REMAPPED_COR: (_UINT, _counter("remapped_corrected", lambda n, i: 0)),
    _real.NVML_FI_DEV_REMAPPED_UNC: (_UINT, _counter("remapped_uncorrected", lambda n, i: 1 if _degraded() else 0)),
    _real.NVML_FI_DEV_REMAPPED_PENDING: (_UINT, _counter("remap_pending", lambda n, i: 1 if _degraded() else 0)),
    _real.NVML_FI_DEV_REMAPPED_FAILURE: (_UINT, _counter("remap_failure", lambda n, i: 1 if _degraded() else 0)),
    _real.NVML_FI_DEV_RETIRED_SBE: (_ULL, _counter("retired_sbe", lambda n, i: 0)),
    _real.NVML_FI_DEV_RETIRED_DBE: (_ULL, _counter("retired_dbe", lambda n, i: 0)),
    _real.NVML_FI_DEV_RETIRED_PENDING: (_UINT, _counter("retired_pending", lambda n, i: 0)),
    # ns the clocks were held down, since the driver loaded.
    _real.NVML_FI_DEV_PERF_POLICY_POWER: (_ULL, _counter("power_violation", lambda n, i: n * 1_000_000)),
    _real.NVML_FI_DEV_PERF_POLICY_THERMAL: (
        _ULL,
        _counter("thermal_violation", lambda n, i: n * 400_000_000 if _state.scenario.get("hot") else 0),
    ),
}
_REMAP_IDS = (
    _real.NVML_FI_DEV_REMAPPED_COR,
    _real.NVML_FI_DEV_REMAPPED_UNC,
    _real.NVML_FI_DEV_REMAPPED_PENDING,
    _real.NVML_FI_DEV_REMAPPED_FAILURE,
)
# field id -> the scenario's field name (not_supported / errors).
_FIELD_OF_ID = {
    _real.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: "energy",
    _real.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: "ecc",
    _real.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: "ecc",
    _real.NVML_FI_DEV_MEMORY_TEMP: "memory_temperature",
    _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: "nvlink_io",
    _real.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: "nvlink_io",
    _real.NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL: "nvlink_errors",
    _real.NVML_FI_DEV_NVLINK_CRC_DATA_ERROR_COUNT_TOTAL: "nvlink_errors",
    _real.NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL: "nvlink_errors",
    _real.NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL: "nvlink_errors",
    _real.NVML_FI_DEV_PCIE_REPLAY_COUNTER: "pcie_replays",
    **{field_id: "row_remapping" for field_id in _REMAP_IDS},
    _real.NVML_FI_DEV_RETIRED_SBE: "retired_pages",
    _real.NVML_FI_DEV_RETIRED_DBE: "retired_pages",
    _real.NVML_FI_DEV_RETIRED_PENDING: "retired_pages",
    _real.NVML_FI_DEV_PERF_POLICY_POWER: "violation",
    _real.NVML_FI_DEV_PERF_POLICY_THERMAL: "violation",
}
