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
  Fields: utilization memory power power_limit energy temperature clock pcie ecc throttle
  processes events.
- ``errors``: {"0": {"power": "Unknown"}} field or function -> NVMLError_<name> raised every call.
- ``lost``: ["3"] GPUs lost from the start; ``lost_after_reads``: {"2": 3} a GPU that answers 3
  calls of each function, then raises GpuIsLost for everything.
- ``sequences``: {"0": {"utilization": [10, 20, 30]}} values returned in turn (cycling), per value
  key: utilization memory_activity (%), memory_used memory_total (bytes), power power_limit (W),
  energy (J), temperature (C), sm_clock memory_clock (MHz), pcie_tx pcie_rx (KB/s),
  ecc_corrected ecc_uncorrected, throttle (bitmask). Without one, values change
  deterministically with the number of reads.
- ``processes``: {"0": [["self", 1048576], [1234, null]]} compute processes (pid, used bytes);
  "self" is the pid of the process calling NVML, "parent" its parent.
- ``xid_events``: [[0, 79], ...] XID events delivered by ``nvmlEventSetWait_v2`` after init.
- ``hot``: true: temperatures near 90 C and the thermal throttle bits set.

Python API for in-process tests: ``configure``, ``calls``, ``call_counts``, ``reset_counts``,
``inject_xid``, ``lose_gpu``, ``initialized``. Call counts start again at each first init.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import os
import sys
import threading
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
    "memory": ("nvmlDeviceGetMemoryInfo",),
    "power": ("nvmlDeviceGetPowerUsage",),
    "power_limit": ("nvmlDeviceGetEnforcedPowerLimit",),
    "energy": ("nvmlDeviceGetTotalEnergyConsumption",),
    "temperature": ("nvmlDeviceGetTemperature",),
    "clock": ("nvmlDeviceGetClockInfo",),
    "pcie": ("nvmlDeviceGetPcieThroughput",),
    "ecc": ("nvmlDeviceGetTotalEccErrors",),
    "throttle": ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"),
    "processes": ("nvmlDeviceGetComputeRunningProcesses",),
    "events": ("nvmlDeviceRegisterEvents",),
}
_FIELD_OF = {function: name for name, functions in _FIELDS.items() for function in functions}
_GIB = 1024**3
_THERMAL = _real.nvmlClocksEventReasonSwThermalSlowdown | _real.nvmlClocksEventReasonHwThermalSlowdown


class _Device:
    def __init__(self, index: int, scenario: dict) -> None:
        self.index = index
        self.struct = _real.struct_c_nvmlDevice_t()  # the handle points at it: a real device handle
        self.name = scenario.get("name", "NVIDIA H100 80GB HBM3")
        self.uuid = f"GPU-{0x1A2B0000 + index:08x}-0000-4000-8000-{index:012x}"
        self.pci_bus_id = f"00000000:{0x17 + 0x10 * index:02X}:00.0"
        self.lost = str(index) in {str(i) for i in scenario.get("lost", ())}
        self.lost_after = scenario.get("lost_after_reads", {}).get(str(index))

    @property
    def handle(self) -> Any:
        return ctypes.pointer(self.struct)


class _State(FakeState):
    def __init__(self) -> None:
        super().__init__(threading.Condition(threading.RLock()))
        self.override: dict | None = None
        self.devices: list[_Device] = []
        self.pending_xids: list[tuple[int, int]] = []
        self.event_sets: dict[int, set[int]] = {}  # event set address -> registered GPU indices
        self.event_set_objects: dict[int, Any] = {}  # keeps each set's memory alive


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
    gpu = _value(device, "utilization", lambda n, i: (10 * i + 7 * n) % 101)
    memory = _value(device, "memory_activity", lambda n, i: (5 * i + 3 * n) % 101)
    return _real.c_nvmlUtilization_t(gpu=int(gpu), memory=int(memory))


def nvmlDeviceGetMemoryInfo(handle: Any, version: Any = None) -> Any:
    device = _call("nvmlDeviceGetMemoryInfo", handle)
    total = int(_value(device, "memory_total", lambda n, i: 80 * _GIB))
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
    for device in _state.devices:
        if ctypes.addressof(device.struct) == address:
            return device
    raise _real.NVMLError_InvalidArgument()


def _address(pointer: Any) -> int:
    try:
        return ctypes.cast(pointer, ctypes.c_void_p).value or 0
    except (TypeError, ctypes.ArgumentError):
        raise _real.NVMLError_InvalidArgument() from None
