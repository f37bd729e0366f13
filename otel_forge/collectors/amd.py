"""AMD GPUs through amdsmi (ROCm's AMD SMI Python interface): every selected GPU, every field, one pass.

The read loop and the failure rules are ``GpuCollector``'s (``gpu.py``); amdsmi's status codes
map onto them as: unsupported (the field is switched off for that GPU) for
``AMDSMI_STATUS_NOT_SUPPORTED``, ``_NOT_YET_IMPLEMENTED`` and ``_NO_PERM``; lost (the GPU reports
``hw.status`` failed from then on) for ``_NOT_FOUND``, ``_DRIVER_NOT_LOADED`` and
``_AMDGPU_RESTART_ERR``; any other error skips the field for this read.

Beyond what NVIDIA also gives through its own calls: memory (VRAM/HBM) temperature, XGMI traffic
and the PCIe replay count from one ``amdsmi_get_gpu_metrics_info`` (the firmware's metrics table:
XGMI as KB read and written since the driver loaded, summed over the links), the violation flags
(``amdsmi_get_violation_status``, MI300 and later) as throttle reasons, deferred ECC errors and
the bad (retired) pages. NVLink-only readings (row remapping, violation time) have no amdsmi
counterpart and are absent.

amdsmi reports a member it cannot read as "N/A" (or as the maximum of its integer type); such a
value is simply not reported. ``import amdsmi`` without libamd_smi.so prints to stdout and raises
``KeyError``: the import runs with stdout silenced, at the Python and the file-descriptor level.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

from otel_forge.collectors.base import CollectorUnavailable
from otel_forge.collectors.gpu import Failure, Gpu, GpuCollector, Row
from otel_forge.collectors.gpu_selection import AMD_VISIBLE_ENV

_logger = logging.getLogger(__name__)

# amdsmi_status_t codes (amdsmi.h); numbers, since the Python enum's name changed across releases.
_UNSUPPORTED_CODES = frozenset({2, 3, 10})  # NOT_SUPPORTED, NOT_YET_IMPLEMENTED, NO_PERM
_LOST_CODES = frozenset({31, 34, 54})  # NOT_FOUND, DRIVER_NOT_LOADED, AMDGPU_RESTART_ERR
_NOT_AVAILABLE = frozenset({0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF})  # what a 32/64-bit member holds when unsupported
_POWER_LIMIT_MICROWATTS_ABOVE = 100_000  # no GPU has a 100 kW limit: a larger number is in uW
_KB = 1024  # the metrics table's XGMI counters are in KB
# otel_forge.gpu.throttle.reason -> amdsmi_get_violation_status's flag.
_VIOLATION_FLAGS = (
    ("ppt_power", "active_ppt_pwr"),
    ("socket_thermal", "active_socket_thrm"),
    ("prochot_thermal", "active_prochot_thrm"),
    ("vr_thermal", "active_vr_thrm"),
    ("hbm_thermal", "active_hbm_thrm"),
)


class AmdCollector(GpuCollector):
    """All selected AMD GPUs."""

    name = "amd"
    logger = _logger
    visible_env = AMD_VISIBLE_ENV
    FIELDS = (
        "activity",
        "memory",
        "power",
        "energy",
        "temperature_edge",
        "temperature_hotspot",
        "temperature_memory",
        "clock_sm",
        "clock_memory",
        "ecc",
        "gpu_metrics",
        "violation",
        "bad_pages",
        "process_memory",
    )

    @property
    def _amdsmi(self) -> Any:
        return self._library

    # --- vendor hooks ------------------------------------------------------------------------

    @staticmethod
    def _start_library() -> Any:
        """Import amdsmi (silencing what it prints) and initialise it for GPUs, or say why not."""
        reason: str | None
        with _stdout_silenced() as printed:
            try:
                import amdsmi
            except ModuleNotFoundError as error:
                amdsmi, reason = None, f"amdsmi is not installed ({error})"
            except Exception as error:  # noqa: BLE001 - KeyError, OSError, ImportError...: all mean "absent"
                amdsmi, reason = (
                    None,
                    (f"amdsmi cannot be loaded ({type(error).__name__}: {error}); is ROCm's libamd_smi.so installed?"),
                )
            if amdsmi is not None:
                reason = _init(amdsmi)
        if printed.getvalue().strip():
            _logger.debug("amdsmi printed while loading: %s", printed.getvalue().strip())
        if reason:
            raise CollectorUnavailable(reason)
        return amdsmi

    @staticmethod
    def _open_gpus(amdsmi: Any) -> list[Gpu]:
        try:
            handles = amdsmi.amdsmi_get_processor_handles()
        except Exception as error:  # noqa: BLE001 - an unusable library is an absent source
            raise CollectorUnavailable(f"amdsmi cannot list GPUs: {_one_line(error)}") from None
        present = [
            gpu for gpu in (_open_gpu(amdsmi, index, handle) for index, handle in enumerate(handles)) if gpu is not None
        ]
        if not present:
            raise CollectorUnavailable("amdsmi found no GPUs" if not handles else "no GPU could be opened")
        return present

    @staticmethod
    def _shutdown_library(amdsmi: Any) -> None:
        try:
            amdsmi.amdsmi_shut_down()
        except Exception as error:  # noqa: BLE001 - nothing left to do about it
            _logger.debug("amdsmi_shut_down failed: %s", _one_line(error))

    def _failure(self, error: Exception) -> Failure:
        code = _error_code(error)
        if code in _UNSUPPORTED_CODES:
            return Failure.UNSUPPORTED
        return Failure.LOST if code in _LOST_CODES else Failure.OTHER

    def _error_text(self, error: Exception) -> str:
        return _one_line(error)

    # --- inventory ----------------------------------------------------------------------------------

    def _driver_version(self) -> str | None:
        gpu = next((gpu for gpu in self._gpus if not gpu.lost), None)
        version = None if gpu is None else self._amdsmi.amdsmi_get_gpu_driver_info(gpu.handle).get("driver_version")
        return str(version) if version and version != "N/A" else None

    def _memory_bytes(self, gpu: Gpu) -> int | None:
        total = _number(self._amdsmi.amdsmi_get_gpu_memory_total(gpu.handle, self._amdsmi.AmdSmiMemoryType.VRAM))
        return None if total is None else int(total)

    # --- field readers: handle -> rows --------------------------------------------------------

    def _read_activity(self, handle: Any) -> list[Row]:
        activity = self._amdsmi.amdsmi_get_gpu_activity(handle)
        return [
            ("hw.gpu.utilization", _ratio(activity.get("gfx_activity")), {"hw.gpu.task": "general"}),
            ("otel_forge.gpu.memory.activity", _ratio(activity.get("umc_activity")), {}),
        ]

    def _read_memory(self, handle: Any) -> list[Row]:
        amdsmi = self._amdsmi
        vram = amdsmi.AmdSmiMemoryType.VRAM
        used = _number(amdsmi.amdsmi_get_gpu_memory_usage(handle, vram))
        total = _number(amdsmi.amdsmi_get_gpu_memory_total(handle, vram))
        utilization = used / total if used is not None and total else None
        return [
            ("hw.gpu.memory.usage", used, {}),
            ("hw.gpu.memory.limit", total, {}),
            ("hw.gpu.memory.utilization", utilization, {}),
        ]

    def _read_power(self, handle: Any) -> list[Row]:
        info = self._amdsmi.amdsmi_get_power_info(handle)
        # socket_power (ROCm 6.4+), else current (MI300+) or average (MI200 and older, Navi).
        watts = next(
            (
                value
                for value in (
                    _number(info.get(key)) for key in ("socket_power", "current_socket_power", "average_socket_power")
                )
                if value is not None
            ),
            None,
        )
        limit = _number(info.get("power_limit"))
        if limit is not None and limit > _POWER_LIMIT_MICROWATTS_ABOVE:
            limit /= 1_000_000
        return [("hw.power", watts, {}), ("otel_forge.gpu.power.limit", limit, {})]

    def _read_energy(self, handle: Any) -> list[Row]:
        count = self._amdsmi.amdsmi_get_energy_count(handle)
        ticks = _number(count.get("energy_accumulator", count.get("power")))  # "power" before ROCm 6.4
        resolution_uj = _number(count.get("counter_resolution"))
        joules = ticks * resolution_uj / 1_000_000 if ticks is not None and resolution_uj is not None else None
        return [("hw.energy", joules, {})]

    def _read_temperature_edge(self, handle: Any) -> list[Row]:
        return self._temperature(handle, "EDGE", "edge")

    def _read_temperature_hotspot(self, handle: Any) -> list[Row]:
        return self._temperature(handle, "HOTSPOT", "hotspot")

    def _read_temperature_memory(self, handle: Any) -> list[Row]:
        return self._temperature(handle, "VRAM", "memory")

    def _temperature(self, handle: Any, sensor: str, location: str) -> list[Row]:
        amdsmi = self._amdsmi
        celsius = _number(
            amdsmi.amdsmi_get_temp_metric(
                handle, getattr(amdsmi.AmdSmiTemperatureType, sensor), amdsmi.AmdSmiTemperatureMetric.CURRENT
            )
        )
        return [("hw.temperature", celsius, {"hw.sensor_location": location})]

    def _read_clock_sm(self, handle: Any) -> list[Row]:
        return self._clock(handle, "GFX", "sm")

    def _read_clock_memory(self, handle: Any) -> list[Row]:
        return self._clock(handle, "MEM", "memory")

    def _clock(self, handle: Any, clock_type: str, label: str) -> list[Row]:
        amdsmi = self._amdsmi
        mhz = _number(amdsmi.amdsmi_get_clock_info(handle, getattr(amdsmi.AmdSmiClkType, clock_type)).get("clk"))
        return [
            (
                "otel_forge.gpu.clock.frequency",
                mhz * 1_000_000 if mhz is not None else None,
                {"otel_forge.gpu.clock": label},
            )
        ]

    def _read_ecc(self, handle: Any) -> list[Row]:
        counts = self._amdsmi.amdsmi_get_gpu_total_ecc_count(handle)
        return [
            ("hw.errors", _number(counts.get("correctable_count")), {"error.type": "corrected"}),
            ("hw.errors", _number(counts.get("uncorrectable_count")), {"error.type": "uncorrected"}),
            ("hw.errors", _number(counts.get("deferred_count")), {"error.type": "deferred"}),
        ]

    def _read_gpu_metrics(self, handle: Any) -> list[Row]:
        metrics = self._amdsmi.amdsmi_get_gpu_metrics_info(handle)
        rows: list[Row] = [("otel_forge.gpu.pcie.replays", _number(metrics.get("pcie_replay_count_acc")), {})]
        for key, direction in (("xgmi_write_data_acc", "transmit"), ("xgmi_read_data_acc", "receive")):
            kilobytes = _sum(metrics.get(key))
            bytes_total = kilobytes * _KB if kilobytes is not None else None
            rows.append(("hw.gpu.io", bytes_total, {"otel_forge.gpu.link": "xgmi", "network.io.direction": direction}))
        return rows

    def _read_violation(self, handle: Any) -> list[Row]:
        status = self._amdsmi.amdsmi_get_violation_status(handle)
        return [
            ("otel_forge.gpu.throttle", _flag(status.get(flag)), {"otel_forge.gpu.throttle.reason": reason})
            for reason, flag in _VIOLATION_FLAGS
        ]

    def _read_bad_pages(self, handle: Any) -> list[Row]:
        # Retired ("reserved") pages, and those waiting for a reset to be ("pending").
        statuses = [str(page.get("status", "")).upper() for page in self._amdsmi.amdsmi_get_gpu_bad_page_info(handle)]
        return [
            ("otel_forge.gpu.memory.retired_pages", statuses.count("RESERVED"), {}),
            ("otel_forge.gpu.memory.retirement.pending", 1 if "PENDING" in statuses else 0, {}),
        ]

    def _read_process_memory(self, handle: Any) -> list[Row]:
        used: dict[int, float] = {}
        for process in self._amdsmi.amdsmi_get_gpu_process_list(handle):
            if isinstance(process, dict) and isinstance(pid := process.get("pid"), int):
                usage = process.get("memory_usage")
                vram = usage.get("vram_mem") if isinstance(usage, dict) else process.get("mem")
                used[pid] = used.get(pid, 0) + (_number(vram) or 0)
        return self._process_memory(used)


# --- opening ---------------------------------------------------------------------------------


def _init(amdsmi: Any) -> str | None:
    flags = getattr(amdsmi, "AmdSmiInitFlags", None)
    gpus_only = getattr(flags, "INIT_AMD_GPUS", None) or getattr(flags, "AMD_GPUS", None)
    try:
        if gpus_only is None:
            amdsmi.amdsmi_init()
        else:
            amdsmi.amdsmi_init(gpus_only)
    except Exception as error:  # noqa: BLE001 - AmdSmiLibraryException, OSError: the library is unusable
        return f"amdsmi failed to initialise: {_one_line(error)}"
    return None


def _open_gpu(amdsmi: Any, index: int, handle: Any) -> Gpu | None:
    """The GPU at ``index`` (amdsmi's enumeration order); a lost one is kept, an unreadable one skipped."""
    try:
        uuid = str(amdsmi.amdsmi_get_gpu_device_uuid(handle))
        bus_id = str(amdsmi.amdsmi_get_gpu_device_bdf(handle))
        name = str(amdsmi.amdsmi_get_gpu_asic_info(handle).get("market_name") or "")
    except Exception as error:  # noqa: BLE001 - classified below
        if _error_code(error) in _LOST_CODES:
            _logger.warning("GPU %d is lost (%s); it reports hw.status failed", index, _one_line(error))
            return Gpu("AMD", index, None, "unknown", "", "", lost=True)
        _logger.warning("GPU %d cannot be opened (%s); it is not monitored", index, _one_line(error))
        return None
    identity = {
        "hw.model": name if name != "N/A" else "",
        "hw.serial_number": _info(amdsmi.amdsmi_get_gpu_board_info, handle, "product_serial"),
        "hw.driver_version": _info(amdsmi.amdsmi_get_gpu_driver_info, handle, "driver_version"),
        "hw.firmware_version": _info(amdsmi.amdsmi_get_gpu_vbios_info, handle, "version"),
    }
    return Gpu("AMD", index, handle, name if name and name != "N/A" else "AMD GPU", uuid, bus_id, identity=identity)


def _info(function: Callable[[Any], dict[str, Any]], handle: Any, key: str) -> str:
    """One text of an amdsmi info dict, "" when the call fails or says "N/A"."""
    try:
        value = str(function(handle).get(key) or "")
    except Exception as error:  # noqa: BLE001 - identity is optional: any failure leaves it out
        _logger.debug("%s failed: %s", function.__name__, _one_line(error))
        return ""
    return "" if value == "N/A" else value


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[io.StringIO]:
    """Route what is printed to stdout, by Python or by C through file descriptor 1, into a buffer.

    The descriptor is swapped for the whole process while this runs (the import and init only),
    so another thread's output in that window lands in the buffer too.
    """
    printed = io.StringIO()
    saved_fd = _redirect_fd1()
    try:
        with contextlib.redirect_stdout(printed):
            yield printed
    finally:
        if saved_fd is not None:
            printed.write(_restore_fd1(*saved_fd))


def _redirect_fd1() -> tuple[int, Any] | None:
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):
        return None  # no usable fd 1 (closed, or a stdout without one): Python-level only
    capture = tempfile.TemporaryFile()  # noqa: SIM115 - open until _restore_fd1 reads and closes it
    os.dup2(capture.fileno(), 1)
    return saved, capture


def _restore_fd1(saved: int, capture: Any) -> str:
    _flush_c_stdio()
    os.dup2(saved, 1)
    os.close(saved)
    with capture:
        capture.seek(0)
        return capture.read().decode(errors="replace")


def _flush_c_stdio() -> None:
    """Flush C's stdout buffer into the capture before the descriptor is restored."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).fflush(None)


# --- small helpers ---------------------------------------------------------------------------


def _error_code(error: BaseException) -> int | None:
    get_code = getattr(error, "get_error_code", None)
    try:
        return abs(int(get_code())) if callable(get_code) else None
    except (TypeError, ValueError):
        return None


def _number(value: Any) -> float | None:
    """A reported number, or None for "N/A", a non-number or a 32/64-bit maximum (unsupported)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and value in _NOT_AVAILABLE:
        return None
    return value


def _sum(values: Any) -> float | None:
    """The sum of a per-link list, its unreadable members left out; None when none is readable."""
    numbers = [number for number in map(_number, values) if number is not None] if isinstance(values, list) else []
    return sum(numbers) if numbers else None


def _flag(value: Any) -> int | None:
    """A bool amdsmi gives as True/False (or 0/1) as 1/0; None for "N/A"."""
    if isinstance(value, bool) or value in (0, 1):
        return int(value)
    return None


def _ratio(percent: Any) -> float | None:
    """A percentage as a fraction; past 100 it is a 16-bit "not available" (0xFFFF), not a value."""
    value = _number(percent)
    return value / 100 if value is not None and 0 <= value <= 100 else None


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__
