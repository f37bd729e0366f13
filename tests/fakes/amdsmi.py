"""A fake ``amdsmi`` (AMD SMI Python interface) for tests, over simulated AMD GPUs.

README
------
Put ``tests/fakes`` first on ``sys.path`` (or ``PYTHONPATH=tests/fakes``) and ``import amdsmi``
finds this module. It is not a package on purpose. amdsmi is not installed here, so the names
and shapes follow the ROCm amdsmi sources (``py-interface/amdsmi_interface.py`` and
``amdsmi_exception.py``, ROCm 6.4-7.x): ``AmdSmiLibraryException(err_code)`` with
``get_error_code()``, status codes as in ``amdsmi.h`` (``AmdSmiStatus``; older releases call the
enum ``AmdSmiRetCode``), ``AmdSmiMemoryType``, ``AmdSmiTemperatureType``,
``AmdSmiTemperatureMetric``, ``AmdSmiClkType``, processor handles that are
``amdsmi_wrapper.amdsmi_processor_handle`` (``ctypes.c_void_p``) and checked like the real
functions check them, and the dicts the real functions return ("N/A" for unsupported members).

Scenario: the env var ``OTEL_FORGE_FAKE_GPUS`` (JSON text, or a path to a JSON file), read at
import and again at each first ``amdsmi_init()``; ``configure(dict)`` overrides it in-process.
The fake pynvml reads the same variable: keys under ``"amd": {...}`` apply to this fake only
(over the top-level ones), and ``"amd": false`` means no ROCm (``import_error``). Keys (all
optional; GPU keys are indices as strings):

- ``import_error``: true: ``import amdsmi`` prints two lines to stdout (one through
  ``sys.stdout``, one straight to file descriptor 1) and raises KeyError, as the real module
  does without libamd_smi.so.
- ``init_error``: "DRIVER_NOT_LOADED" (an ``AmdSmiStatus`` name): ``amdsmi_init`` raises it.
- ``count`` (2), ``name`` (market name).
- ``not_supported``: {"1": ["power", ...]}, fields: activity memory power energy temperature
  temperature_edge temperature_hotspot clock clock_gfx clock_mem ecc processes (or function names).
- ``errors``: {"0": {"power": "BUSY"}} field or function -> AmdSmiLibraryException(that status).
- ``lost_after_reads``: {"2": 3}: after 3 calls of each function a GPU raises ``lost_error``
  (default "NOT_FOUND") for everything.
- ``sequences``: {"0": {"gfx_activity": [10, 20]}} values in turn (cycling), value keys:
  gfx_activity umc_activity (%), vram_used vram_total (bytes), socket_power power_limit (W),
  energy (J), temperature_edge temperature_hotspot (C), gfx_clock mem_clock (MHz),
  ecc_correctable ecc_uncorrectable.
- ``processes``: {"0": [["self", 1048576]]} (pid, VRAM bytes); "self"/"parent" as in the pynvml fake.
- more value keys: temperature_vram (C, the memory sensor), xgmi_read xgmi_write (KB since
  init, over all links: the fake has 8 links, the first holding the total), pcie_replays.
- ``no_xgmi``: true: the metrics table's XGMI members are "N/A" (a GPU without XGMI).
- ``violations``: {"0": ["ppt_pwr"]} the active violation flags (``active_<name>``); with ``hot``
  the socket and HBM thermal ones are active. Fields for not_supported/errors: gpu_metrics
  violation bad_pages.
- ``bad_pages``: {"0": {"reserved": 2, "pending": 1}} bad page records by status.
- ``power_limit_uw``: true: ``power_limit`` in microwatts, as some ROCm 7 releases report it.
- ``legacy_energy_key``: true: ``amdsmi_get_energy_count`` returns the old "power" key.

Python API: ``configure``, ``calls``, ``call_counts``, ``reset_counts``, ``lose_gpu``, ``initialized``.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import types
from enum import IntEnum
from typing import Any

from _fakegpu import FakeState, load_scenario


def _load_scenario() -> dict:
    return load_scenario(_OVERRIDE[0] if _OVERRIDE else None, "amd", "import_error")


_OVERRIDE: list[dict] = []

if _load_scenario().get("import_error"):
    # What amdsmi does when libamd_smi.so cannot be loaded: noise on stdout, then a KeyError.
    print("Unable to find amdsmi library, try installing amd-smi-lib from your package manager")
    sys.stdout.flush()
    os.write(1, b"Unable to load libamd_smi.so: cannot open shared object file\n")
    raise KeyError("libamd_smi.so")


# --- exceptions (amdsmi_exception.py) ----------------------------------------------------------


class AmdSmiStatus(IntEnum):
    SUCCESS = 0
    INVAL = 1
    NOT_SUPPORTED = 2
    NOT_YET_IMPLEMENTED = 3
    FAIL_LOAD_MODULE = 4
    FAIL_LOAD_SYMBOL = 5
    DRM_ERROR = 6
    API_FAILED = 7
    TIMEOUT = 8
    RETRY = 9
    NO_PERM = 10
    INTERRUPT = 11
    IO = 12
    ADDRESS_FAULT = 13
    FILE_ERROR = 14
    OUT_OF_RESOURCES = 15
    INTERNAL_EXCEPTION = 16
    INPUT_OUT_OF_BOUNDS = 17
    INIT_ERROR = 18
    REFCOUNT_OVERFLOW = 19
    DIRECTORY_NOT_FOUND = 20
    BUSY = 30
    NOT_FOUND = 31
    NOT_INIT = 32
    NO_SLOT = 33
    DRIVER_NOT_LOADED = 34
    MORE_DATA = 39
    NO_DATA = 40
    INSUFFICIENT_SIZE = 41
    UNEXPECTED_SIZE = 42
    UNEXPECTED_DATA = 43
    FILE_NOT_FOUND = 52
    AMDGPU_RESTART_ERR = 54
    SETTING_UNAVAILABLE = 55
    CORRUPTED_EEPROM = 56
    MAP_ERROR = 0xFFFFFFFE
    UNKNOWN_ERROR = 0xFFFFFFFF


# The pre-6.x name of the same codes.
AmdSmiRetCode = IntEnum(
    "AmdSmiRetCode",
    {(status.name if status == 0 else f"STATUS_{status.name}"): status.value for status in AmdSmiStatus},
)


class AmdSmiException(Exception):
    """Base smi exception class."""


class AmdSmiLibraryException(AmdSmiException):
    def __init__(self, err_code: int) -> None:
        err_code = abs(err_code)
        super().__init__(err_code)
        self.err_code = err_code
        try:
            self.err_info = f"AMDSMI_STATUS_{AmdSmiStatus(err_code).name}"
        except ValueError:
            self.err_info = "AMDSMI_STATUS_UNKNOWN_ERROR - An unknown error occurred"

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_info(self, detailed: bool = True) -> str:
        return self.err_info

    def get_error_code(self) -> int:
        return self.err_code


class AmdSmiRetryException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AmdSmiStatus.RETRY)


class AmdSmiTimeoutException(AmdSmiLibraryException):
    def __init__(self) -> None:
        super().__init__(AmdSmiStatus.TIMEOUT)


class AmdSmiParameterException(AmdSmiException):
    def __init__(self, received_value: Any, expected_type: Any, msg: str | None = None) -> None:
        super().__init__(msg)
        self.err_code = None
        self.err_msg = msg or f"Invalid parameter:\nActual type: {type(received_value)}\nExpected type: {expected_type}"

    def __str__(self) -> str:
        return self.err_msg


# --- enums (amdsmi_interface.py) ----------------------------------------------------------------


class AmdSmiInitFlags(IntEnum):
    INIT_ALL_PROCESSORS = 0xFFFFFFFF
    INIT_AMD_CPUS = 1 << 0
    INIT_AMD_GPUS = 1 << 1
    INIT_NON_AMD_CPUS = 1 << 2
    INIT_NON_AMD_GPUS = 1 << 3
    INIT_AMD_APUS = (1 << 0) | (1 << 1)


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiTemperatureType(IntEnum):
    EDGE = 0
    HOTSPOT = 1
    JUNCTION = 1
    VRAM = 2
    HBM_0 = 3
    HBM_1 = 4
    HBM_2 = 5
    HBM_3 = 6
    PLX = 7


class AmdSmiTemperatureMetric(IntEnum):
    CURRENT = 0
    MAX = 1
    MIN = 2
    MAX_HYST = 3
    MIN_HYST = 4
    CRITICAL = 5
    CRITICAL_HYST = 6
    EMERGENCY = 7
    EMERGENCY_HYST = 8
    CRIT_MIN = 9
    CRIT_MIN_HYST = 10
    OFFSET = 11
    LOWEST = 12
    HIGHEST = 13


class AmdSmiClkType(IntEnum):
    SYS = 0
    GFX = 0
    DF = 1
    DCEF = 2
    SOC = 3
    MEM = 4
    PCIE = 5
    VCLK0 = 6
    VCLK1 = 7
    DCLK0 = 8
    DCLK1 = 9


amdsmi_wrapper = types.SimpleNamespace(
    amdsmi_processor_handle=ctypes.c_void_p, **{f"AMDSMI_STATUS_{s.name}": s.value for s in AmdSmiStatus}
)
_NA = "N/A"
_GIB = 1024**3


# --- the simulation ----------------------------------------------------------------------------


class _Gpu:
    def __init__(self, index: int, scenario: dict) -> None:
        self.index = index
        self.memory = ctypes.create_string_buffer(8)  # the handle is its address
        self.name = scenario.get("name", "AMD Instinct MI300X")
        self.uuid = f"{0xA1FF0000 + index:08x}-0000-1000-80a9-{index:012x}"
        self.bdf = f"0000:{0x0C + 0x10 * index:02x}:00.0"
        self.lost = False
        self.lost_after = scenario.get("lost_after_reads", {}).get(str(index))

    @property
    def handle(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(ctypes.addressof(self.memory))


class _State(FakeState):
    def __init__(self) -> None:
        super().__init__(threading.RLock())
        self.gpus: list[_Gpu] = []


_state = _State()
calls, call_counts, reset_counts = _state.count_calls, _state.call_counts, _state.reset_counts
_value = _state.value


def configure(scenario: dict | None) -> None:
    """Use ``scenario`` at the next first ``amdsmi_init`` instead of the env var (None: the env var)."""
    _OVERRIDE.clear()
    if scenario is not None:
        _OVERRIDE.append(dict(scenario))


def lose_gpu(index: int) -> None:
    with _state.lock:
        _state.gpus[index].lost = True


def initialized() -> int:
    return _state.initialized


def amdsmi_init(flag: int = AmdSmiInitFlags.INIT_AMD_GPUS) -> None:
    with _state.lock:
        scenario = _load_scenario() if _state.initialized == 0 else _state.scenario
        if scenario.get("init_error"):
            raise AmdSmiLibraryException(AmdSmiStatus[scenario["init_error"]])
        if _state.initialized == 0:
            _state.scenario = scenario
            _state.gpus = [_Gpu(index, scenario) for index in range(int(scenario.get("count", 2)))]
            _state.calls.clear()
            _state.ticks.clear()
            _state.variant_calls.clear()
        _state.initialized += 1
        _state.calls[("amdsmi_init", None)] += 1


def amdsmi_shut_down() -> None:
    with _state.lock:
        _require_init()
        _state.initialized -= 1
        _state.calls[("amdsmi_shut_down", None)] += 1


def amdsmi_get_processor_handles() -> list[ctypes.c_void_p]:
    with _state.lock:
        _require_init()
        _state.calls[("amdsmi_get_processor_handles", None)] += 1
        return [gpu.handle for gpu in _state.gpus]


def amdsmi_get_gpu_device_uuid(handle: Any) -> str:
    return _call("amdsmi_get_gpu_device_uuid", handle).uuid


def amdsmi_get_gpu_device_bdf(handle: Any) -> str:
    return _call("amdsmi_get_gpu_device_bdf", handle).bdf


def amdsmi_get_gpu_asic_info(handle: Any) -> dict[str, Any]:
    gpu = _call("amdsmi_get_gpu_asic_info", handle)
    return {
        "market_name": gpu.name,
        "vendor_id": "0x1002",
        "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
        "subvendor_id": "0x1002",
        "device_id": "0x74a1",
        "rev_id": "0x00",
        "asic_serial": "0x0000000000000000",
        "oam_id": gpu.index,
        "num_compute_units": 304,
        "target_graphics_version": "gfx942",
        "subsystem_id": "0x74a1",
    }


def amdsmi_get_gpu_board_info(handle: Any) -> dict[str, Any]:
    gpu = _call("amdsmi_get_gpu_board_info", handle)
    return {
        "model_number": "102-G30211-00",
        "product_serial": f"692251001{gpu.index:03d}",
        "fru_id": "N/A",
        "product_name": gpu.name,
        "manufacturer_name": "AMD",
    }


def amdsmi_get_gpu_vbios_info(handle: Any) -> dict[str, Any]:
    _call("amdsmi_get_gpu_vbios_info", handle)
    return {
        "name": "AMD MI300X",
        "build_date": "2024/01/01 00:00",
        "part_number": "113-M3000100-102",
        "version": "022.040.003.043.000001",
    }


def amdsmi_get_gpu_driver_info(handle: Any) -> dict[str, Any]:
    _call("amdsmi_get_gpu_driver_info", handle)
    return {"driver_name": "amdgpu", "driver_version": "6.8.5", "driver_date": "2015/01/01 00:00"}


def amdsmi_get_gpu_activity(handle: Any) -> dict[str, Any]:
    gpu = _call("amdsmi_get_gpu_activity", handle, "activity")
    return {
        "gfx_activity": _value(gpu, "gfx_activity", lambda n, i: (10 * i + 7 * n) % 101),
        "umc_activity": _value(gpu, "umc_activity", lambda n, i: (5 * i + 3 * n) % 101),
        "mm_activity": _NA,
    }


def amdsmi_get_gpu_memory_total(handle: Any, mem_type: AmdSmiMemoryType) -> int:
    _check_type(mem_type, AmdSmiMemoryType)
    gpu = _call("amdsmi_get_gpu_memory_total", handle, "memory")
    return int(_value(gpu, "vram_total", lambda n, i: 192 * _GIB))


def amdsmi_get_gpu_memory_usage(handle: Any, mem_type: AmdSmiMemoryType) -> int:
    _check_type(mem_type, AmdSmiMemoryType)
    gpu = _call("amdsmi_get_gpu_memory_usage", handle, "memory")
    return int(_value(gpu, "vram_used", lambda n, i: 192 * _GIB * ((20 + 5 * i + n) % 90) // 100))


def amdsmi_get_gpu_vram_usage(handle: Any) -> dict[str, int]:
    gpu = _call("amdsmi_get_gpu_vram_usage", handle, "memory")
    return {"vram_total": 192 * 1024, "vram_used": 192 * 1024 * (20 + 5 * gpu.index) // 100}  # MB


def amdsmi_get_power_info(handle: Any) -> dict[str, Any]:
    gpu = _call("amdsmi_get_power_info", handle, "power")
    watts = int(_value(gpu, "socket_power", lambda n, i: 300 + 10 * i + 5 * (n % 10)))
    limit = int(_value(gpu, "power_limit", lambda n, i: 750))
    return {
        "socket_power": watts,
        "current_socket_power": watts,
        "average_socket_power": _NA,
        "gfx_voltage": _NA,
        "soc_voltage": _NA,
        "mem_voltage": _NA,
        "ubb_power": _NA,
        "power_limit": limit * 1_000_000 if _state.scenario.get("power_limit_uw") else limit,
    }


def amdsmi_get_energy_count(handle: Any) -> dict[str, Any]:
    gpu = _call("amdsmi_get_energy_count", handle, "energy")
    resolution_uj = 15.3
    joules = _value(gpu, "energy", lambda n, i: 20_000 + n * (300 + 10 * i))
    key = "power" if _state.scenario.get("legacy_energy_key") else "energy_accumulator"
    return {
        key: int(round(joules * 1_000_000 / resolution_uj)),
        "counter_resolution": resolution_uj,
        "timestamp": 1_700_000_000_000_000_000,
    }


def amdsmi_get_temp_metric(handle: Any, sensor_type: AmdSmiTemperatureType, metric: AmdSmiTemperatureMetric) -> int:
    _check_type(sensor_type, AmdSmiTemperatureType)
    _check_type(metric, AmdSmiTemperatureMetric)
    sensor = sensor_type.name.lower()
    gpu = _call("amdsmi_get_temp_metric", handle, "temperature", f"temperature_{sensor}")
    base = 45 if sensor_type == AmdSmiTemperatureType.EDGE else 55
    return int(_value(gpu, f"temperature_{sensor}", lambda n, i: base + i + n % 5))


def amdsmi_get_clock_info(handle: Any, clock_type: AmdSmiClkType) -> dict[str, Any]:
    _check_type(clock_type, AmdSmiClkType)
    name = "mem" if clock_type == AmdSmiClkType.MEM else "gfx"
    gpu = _call("amdsmi_get_clock_info", handle, "clock", f"clock_{name}")
    default = (lambda n, i: 1300) if name == "mem" else (lambda n, i: 2100 - 20 * ((n + i) % 4))
    return {
        "clk": int(_value(gpu, f"{name}_clock", default)),
        "min_clk": 500,
        "max_clk": 2100,
        "clk_locked": _NA,
        "clk_deep_sleep": _NA,
    }


def amdsmi_get_gpu_total_ecc_count(handle: Any) -> dict[str, int]:
    gpu = _call("amdsmi_get_gpu_total_ecc_count", handle, "ecc")
    return {
        "correctable_count": int(_value(gpu, "ecc_correctable", lambda n, i: n // 2)),
        "uncorrectable_count": int(_value(gpu, "ecc_uncorrectable", lambda n, i: 0)),
        "deferred_count": 0,
    }


_XGMI_LINKS = 8
_MAX_UINT64 = 0xFFFFFFFFFFFFFFFF


def amdsmi_get_gpu_metrics_info(handle: Any) -> dict[str, Any]:
    """The firmware metrics table, as amdsmi returns it: a subset of its keys, "N/A" where unsupported."""
    gpu = _call("amdsmi_get_gpu_metrics_info", handle, "gpu_metrics")
    read = int(_value(gpu, "xgmi_read", lambda n, i: n * (30_000 + 1000 * i)))
    write = int(_value(gpu, "xgmi_write", lambda n, i: n * (20_000 + 1000 * i)))
    no_xgmi = _state.scenario.get("no_xgmi")
    return {
        "temperature_edge": _NA,
        "temperature_hotspot": 60,
        "temperature_mem": 50,
        "average_gfx_activity": _NA,
        "average_umc_activity": _NA,
        "current_socket_power": 300,
        "energy_accumulator": _NA,
        "pcie_replay_count_acc": int(_value(gpu, "pcie_replays", lambda n, i: 0)),
        "pcie_replay_rover_count_acc": 0,
        "pcie_nak_sent_count_acc": 0,
        "pcie_nak_rcvd_count_acc": 0,
        "xgmi_link_width": 16,
        "xgmi_link_speed": 32,
        "xgmi_read_data_acc": _NA if no_xgmi else [read] + [0] * (_XGMI_LINKS - 2) + [_MAX_UINT64],
        "xgmi_write_data_acc": _NA if no_xgmi else [write] + [0] * (_XGMI_LINKS - 2) + [_MAX_UINT64],
        "throttle_status": _NA,
        "indep_throttle_status": _NA,
    }


def amdsmi_get_violation_status(handle: Any) -> dict[str, Any]:
    gpu = _call("amdsmi_get_violation_status", handle, "violation")
    active = set(_state.scenario.get("violations", {}).get(str(gpu.index), ()))
    if _state.scenario.get("hot"):
        active |= {"socket_thrm", "hbm_thrm"}
    names = ("prochot_thrm", "ppt_pwr", "socket_thrm", "vr_thrm", "hbm_thrm", "gfx_clk_below_host_limit")
    status: dict[str, Any] = {"reference_timestamp": 1_700_000_000_000_000, "violation_timestamp": 0, "acc_counter": 0}
    for name in names:
        status[f"acc_{name}"] = 0
        status[f"per_{name}"] = 100 if name in active else 0
        status[f"active_{name}"] = name in active
    return status


def amdsmi_get_gpu_bad_page_info(handle: Any) -> list[dict[str, Any]]:
    gpu = _call("amdsmi_get_gpu_bad_page_info", handle, "bad_pages")
    counts = _state.scenario.get("bad_pages", {}).get(str(gpu.index), {})
    statuses = [status.upper() for status, count in counts.items() for _ in range(int(count))]
    return [
        {"value": index, "page_address": 0x1000 * (index + 1), "page_size": 4096, "status": status}
        for index, status in enumerate(statuses)
    ]


def amdsmi_get_gpu_pci_replay_counter(handle: Any) -> int:
    gpu = _call("amdsmi_get_gpu_pci_replay_counter", handle, "pcie_replays")
    return int(_value(gpu, "pcie_replays", lambda n, i: 0))


def amdsmi_get_gpu_process_list(handle: Any) -> list[dict[str, Any]]:
    gpu = _call("amdsmi_get_gpu_process_list", handle, "processes")
    pids = {"self": os.getpid(), "parent": os.getppid()}
    return [
        {
            "name": "python",
            "pid": pids.get(pid, pid),
            "mem": vram,
            "engine_usage": {"gfx": 0, "enc": 0},
            "memory_usage": {"gtt_mem": 0, "cpu_mem": 0, "vram_mem": vram},
            "cu_occupancy": _NA,
            "sdma_usage": _NA,
            "evicted_time": _NA,
        }
        for pid, vram in _state.scenario.get("processes", {}).get(str(gpu.index), ())
    ]


def _require_init() -> None:
    if not _state.initialized:
        raise AmdSmiLibraryException(AmdSmiStatus.NOT_INIT)


def _check_type(value: Any, expected: type) -> None:
    if not isinstance(value, expected):
        raise AmdSmiParameterException(value, expected)


def _call(function: str, handle: Any, *fields: str) -> _Gpu:
    """Count a per-GPU call and raise what the scenario says this call raises.

    ``fields`` name what the call reads (for ``not_supported``/``errors``); the last one also
    tells apart the calls of one function in one read, so ``lost_after_reads`` counts reads.
    """
    with _state.lock:
        _require_init()
        if not isinstance(handle, amdsmi_wrapper.amdsmi_processor_handle):
            raise AmdSmiParameterException(handle, amdsmi_wrapper.amdsmi_processor_handle)
        gpu = next((gpu for gpu in _state.gpus if ctypes.addressof(gpu.memory) == handle.value), None)
        if gpu is None:
            raise AmdSmiLibraryException(AmdSmiStatus.INVAL)
        _state.calls[(function, gpu.index)] += 1
        variant = (function, fields[-1] if fields else None, gpu.index)
        previous_calls = _state.variant_calls[variant]
        _state.variant_calls[variant] += 1
        if gpu.lost_after is not None and previous_calls >= int(gpu.lost_after):
            gpu.lost = True
        if gpu.lost:
            raise AmdSmiLibraryException(AmdSmiStatus[_state.scenario.get("lost_error", "NOT_FOUND")])
        names = {function, *fields}
        gpu_key = str(gpu.index)
        if names & set(_state.scenario.get("not_supported", {}).get(gpu_key, ())):
            raise AmdSmiLibraryException(AmdSmiStatus.NOT_SUPPORTED)
        errors = _state.scenario.get("errors", {}).get(gpu_key, {})
        error = next((errors[name] for name in (function, *fields) if name in errors), None)
        if error:
            raise AmdSmiLibraryException(AmdSmiStatus[error])
        return gpu
