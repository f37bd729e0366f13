"""What every GPU collector shares: every selected GPU, every field, one pass, one set of failure rules.

``GpuCollector`` reads each GPU through a table of field readers (field name -> ``reader(handle)
-> rows``); a vendor collector (``nvidia``, ``amd``) subclasses it and supplies only what is its
own: starting and shutting down its library, opening the GPUs present, the field readers, and
``_failure``, which sorts the library's errors into the three failure rules:

- ``Failure.UNSUPPORTED``: a field the device does not support is switched off for that device
  for good, logged once at DEBUG;
- ``Failure.LOST``: a GPU that is lost is warned once and from then on only reports
  ``hw.status`` failed; its library is not called for it again (a GPU already lost when it is
  opened starts that way);
- ``Failure.OTHER``: any other error skips the field for this read, warned at most once a minute
  per field.

A reader that reads several fields in one library call (NVML's ``nvmlDeviceGetFieldValues``)
returns a ``FieldBatch``: rows and errors per field, so that each field of the batch falls under
the rules above on its own (NotSupported for memory temperature switches off only that).

A MIG instance is a device of its own (``Gpu.parent`` is its GPU): ``hw.id`` ``<gpu>_mig<instance>``,
``hw.parent`` the GPU's index; only the vendor's ``MIG_FIELDS`` are read for it.

Besides its fields' rows, every GPU reports ``hw.status`` (``ok`` / ``failed``) on every read and,
when a read has both its power draw and its enforced limit, ``otel_forge.gpu.power.utilization``.

``inventory`` describes the GPUs once, when asked (model, UUID, memory, MIG instances, driver):
not a metric, nothing read per interval.
"""

from __future__ import annotations

import abc
import enum
import logging
import threading
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from otel_forge.collectors.base import AttributeValue, CollectorUnavailable, HardwareCollector, Readings
from otel_forge.collectors.gpu_selection import DeviceKey, select_gpus
from otel_forge.collectors.process import MonitoredProcesses
from otel_forge.config import ForgeConfig
from otel_forge.names import PROCESS_PID
from otel_forge.ratelimit import RateLimitedLogger

# One reading of a field: (metric name, value, attributes beyond the GPU's own).
Row = tuple[str, float | None, dict[str, AttributeValue]]


@dataclass
class FieldBatch:
    """What one library call that reads several fields gives: each field's rows, or its error."""

    rows: dict[str, list[Row]] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)


FieldReader = Callable[[Any], "list[Row] | FieldBatch"]

_Collector = TypeVar("_Collector", bound="GpuCollector")
_Value = TypeVar("_Value")


class Failure(enum.Enum):
    """What an error of a field reader means; the module docstring gives the rule for each."""

    UNSUPPORTED = "unsupported"
    LOST = "lost"
    OTHER = "other"


@dataclass
class Gpu:
    """One selected GPU: its library handle, identity attributes and what is switched off for it."""

    vendor: str  # hw.vendor: "NVIDIA", "AMD"
    index: int
    handle: Any
    name: str
    uuid: str
    pci_bus_id: str
    lost: bool = False
    # semconv's hw.model, hw.serial_number, hw.driver_version, hw.firmware_version: those the library gave.
    identity: dict[str, str] = field(default_factory=dict)
    unsupported: set[str] = field(default_factory=set)
    # A MIG instance: the GPU it is carved from, and its GPU instance id there.
    parent: Gpu | None = None
    instance: int | None = None
    attributes: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        mig = (
            {}
            if self.parent is None
            else {"hw.parent": str(self.parent.index), "otel_forge.gpu.mig.instance": str(self.instance)}
        )
        self.attributes = {
            "hw.id": str(self.key),
            "hw.name": self.name,
            "hw.vendor": self.vendor,
            "hw.type": "gpu",
            **{key: value for key, value in self.identity.items() if value},
            "otel_forge.gpu.uuid": self.uuid,
            "otel_forge.gpu.pci_bus_id": self.pci_bus_id,
            **mig,
        }

    @property
    def key(self) -> DeviceKey:
        """The index of a whole GPU; ``<gpu>_mig<instance>`` for a MIG instance (its ``hw.id``)."""
        return self.index if self.parent is None else f"{self.parent.index}_mig{self.instance}"

    def describe(self, apart: Collection[str] = ()) -> str:
        """One line for ``otel-forge doctor``: identity, then failed and switched-off fields (but those
        in ``apart``, which the collector describes on a line of their own)."""
        line = " ".join(filter(None, (f"gpu {self.key}:", self.name, self.uuid, self.pci_bus_id)))
        if self.lost:
            line += " (failed)"
        if unsupported := sorted(self.unsupported.difference(apart)):
            line += f" (not supported: {', '.join(unsupported)})"
        return line


class GpuCollector(HardwareCollector):
    """All selected GPUs of one vendor; the failure rules are in the module docstring.

    A subclass sets ``name``, ``logger`` (its module's: every message of the collector goes
    there), ``visible_env`` (the vendor's visibility variables, for ``gpus=visible``) and
    ``FIELDS`` (and ``MIG_FIELDS``, those read for a MIG instance), defines
    ``_read_<field>(handle) -> list[Row] | FieldBatch`` for each field (called in ``FIELDS`` order,
    under the collector's lock), and implements the hooks ``_start_library``,
    ``_open_gpus``, ``_shutdown_library`` and ``_failure``.

    ``create`` starts the library, opens the GPUs, keeps those the ``gpus`` setting selects and
    shuts the library down again if any of that fails. ``read``, ``sample_field`` and
    ``inventory`` hold the lock; ``close`` takes it before releasing what the vendor holds
    (``_release``) and shutting the library down, so a read in progress finishes first, and shuts
    it down once. ``process_memory`` is switched off on every GPU when the monitored process tree
    cannot be walked. ``_driver_version``, ``_cuda_version`` and ``_memory_bytes`` give
    ``inventory`` what only the vendor's library knows.
    """

    FIELDS: ClassVar[tuple[str, ...]]
    MIG_FIELDS: ClassVar[tuple[str, ...]] = ()
    visible_env: ClassVar[tuple[str, ...]]
    logger: ClassVar[logging.Logger]

    def __init__(self, library: Any, gpus: list[Gpu], processes: MonitoredProcesses | None) -> None:
        self._library = library
        self._gpus = gpus
        self._processes = processes
        self._pids: dict[int, set[int]] | None = None  # the monitored trees, walked once per read when needed
        self._warnings = RateLimitedLogger(self.logger)
        self._lock = threading.Lock()
        self._closed = False
        self._readers: dict[str, FieldReader] = {name: getattr(self, f"_read_{name}") for name in self.FIELDS}
        if processes is None:
            for gpu in gpus:
                gpu.unsupported.add("process_memory")

    def follow_process(self, pid: int) -> None:
        if self._processes is not None:
            self._processes.follow(pid)

    def add_process(self, pid: int) -> None:
        if self._processes is not None:
            self._processes.add(pid)

    def remove_process(self, pid: int) -> None:
        if self._processes is not None:
            self._processes.remove(pid)

    # --- vendor hooks --------------------------------------------------------------------------

    @staticmethod
    @abc.abstractmethod
    def _start_library() -> Any:
        """Import and initialise the vendor library, or raise ``CollectorUnavailable`` saying why not."""

    @staticmethod
    @abc.abstractmethod
    def _open_gpus(library: Any) -> list[Gpu]:
        """Every GPU present, in the library's order: a lost one kept (``lost=True``), an unreadable one
        left out. Raises ``CollectorUnavailable`` when there is none."""

    @staticmethod
    @abc.abstractmethod
    def _shutdown_library(library: Any) -> None:
        """Shut the library down; never raises."""

    @abc.abstractmethod
    def _failure(self, error: Exception) -> Failure:
        """Which failure rule ``error``, raised by a field reader, falls under."""

    def _error_text(self, error: Exception) -> str:
        """``error`` as the log messages show it."""
        return str(error)

    def _release(self) -> None:
        """Free what the collector holds in the library, before it shuts down (under the lock); never raises."""

    def _driver_version(self) -> str | None:
        """The driver's version (for ``inventory``); may raise."""
        return None

    def _cuda_version(self) -> str | None:
        """The CUDA version the driver supports, "12.4" (for ``inventory``); may raise."""
        return None

    def _memory_bytes(self, gpu: Gpu) -> int | None:
        """The memory size of ``gpu`` (a whole GPU or a MIG instance), for ``inventory``; may raise."""
        return None

    # --- the collector -------------------------------------------------------------------------

    @classmethod
    def create(cls: type[_Collector], config: ForgeConfig) -> _Collector:
        library = cls._start_library()
        try:
            return cls(library, cls._select(cls._open_gpus(library), config), cls._process_tree(config))
        except BaseException:
            cls._shutdown_library(library)
            raise

    @property
    def gpus(self) -> tuple[Gpu, ...]:
        return tuple(self._gpus)

    def read(self, readings: Readings) -> None:
        with self._lock:
            self._pids = None
            for gpu in self._gpus:
                if not gpu.lost:
                    self._read_gpu(gpu, readings)
                _add_status(gpu, readings)

    def sample_field(self, index: int, field_name: str) -> list[Row] | FieldBatch:
        """One raw read of one field of one GPU, errors raised as the library raises them (for diagnostics)."""
        gpu = next(gpu for gpu in self._gpus if gpu.index == index and gpu.parent is None)
        with self._lock:
            self._pids = None
            return self._readers[field_name](gpu.handle)

    def describe(self) -> list[str]:
        return [gpu.describe() for gpu in self._gpus]

    def inventory(self) -> dict[str, Any]:
        """The selected GPUs as the node's inventory, read now (once per call, never per interval)::

            {"vendor": "nvidia", "driver_version": str | None, "cuda_version": str | None,
             "gpus": [{"index": int, "name": str | None, "uuid": str | None, "memory_bytes": int | None,
                       "mig": [{"gpu_instance_id": int, "name": str | None, "memory_bytes": int | None}, ...]}]}

        A field the library cannot give (a lost GPU, an unsupported call, a closed collector) is
        None; ``mig`` is [] for a GPU without MIG instances. A selected MIG instance brings its GPU's entry.
        """
        with self._lock:
            gpus: dict[int, dict[str, Any]] = {}  # id(whole GPU) -> its entry, in selection order
            for gpu in self._gpus:
                whole = gpu.parent or gpu
                if id(whole) not in gpus:
                    gpus[id(whole)] = {
                        "index": whole.index,
                        "name": None if whole.lost else whole.name or None,
                        "uuid": whole.uuid or None,
                        "memory_bytes": self._inventory_field(whole, self._memory_bytes, whole),
                        "mig": [],
                    }
                if gpu.parent is not None:
                    gpus[id(whole)]["mig"].append(
                        {
                            "gpu_instance_id": gpu.instance,
                            "name": gpu.name or None,
                            "memory_bytes": self._inventory_field(gpu, self._memory_bytes, gpu),
                        }
                    )
            return {
                "vendor": self.name,
                "driver_version": self._inventory_field(None, self._driver_version),
                "cuda_version": self._inventory_field(None, self._cuda_version),
                "gpus": list(gpus.values()),
            }

    def _inventory_field(self, gpu: Gpu | None, reader: Callable[..., _Value], *args: Any) -> _Value | None:
        """``reader(*args)``, or None when it fails, the collector is closed or ``gpu`` is lost."""
        if self._closed or (gpu is not None and (gpu.lost or gpu.handle is None)):
            return None
        try:
            return reader(*args)
        except Exception as error:  # noqa: BLE001 - an inventory field that cannot be read is None
            self.logger.debug("inventory: %s failed: %s", reader.__name__, self._error_text(error))
            return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:  # a read in progress finishes before the library goes away
            self._release()
            self._shutdown_library(self._library)

    # --- one GPU -------------------------------------------------------------------------------

    def _read_gpu(self, gpu: Gpu, readings: Readings) -> None:
        rows: list[Row] = []
        for name, reader in self._readers.items():
            if name not in gpu.unsupported and (gpu.parent is None or name in self.MIG_FIELDS):
                rows += self._read_field(gpu, name, reader)
                if gpu.lost:
                    return  # lost during this read: only hw.status from now on
        for metric, value, extra in rows + _power_utilization(rows):
            readings.add(metric, value, {**gpu.attributes, **extra})

    def _read_field(self, gpu: Gpu, name: str, reader: FieldReader) -> list[Row]:
        try:
            result = reader(gpu.handle)
        except Exception as error:  # noqa: BLE001 - classified; at worst it costs that field, this read
            self._field_failed(gpu, name, error)
            return []
        if isinstance(result, list):
            return result
        # A batch: each of its fields fails alone; one already switched off stays off, silently.
        for field_name, field_error in result.errors.items():
            if field_name not in gpu.unsupported:
                self._field_failed(gpu, field_name, field_error)
        return [row for field_name, rows in result.rows.items() if field_name not in gpu.unsupported for row in rows]

    def _field_failed(self, gpu: Gpu, name: str, error: Exception) -> None:
        failure = self._failure(error)
        if failure is Failure.UNSUPPORTED:
            gpu.unsupported.add(name)
            self.logger.debug("GPU %s: %s not supported (%s); no longer read", gpu.key, name, self._error_text(error))
        elif failure is Failure.LOST:
            gpu.lost = True
            self.logger.warning(
                "GPU %s (%s) is lost: %s; it reports hw.status failed from now on",
                gpu.key,
                gpu.uuid,
                self._error_text(error),
            )
        else:
            self._warnings.warning(name, "GPU %s: reading %s failed: %s", gpu.key, name, self._error_text(error))

    def _process_memory(self, used: Mapping[int, float]) -> list[Row]:
        """One row per monitored tree (by its root): what its processes use of the GPU (``used``, by
        pid). The trees are walked at most once per read."""
        if self._pids is None:
            self._pids = self._processes.pids() if self._processes is not None else {}
        return [
            ("otel_forge.gpu.process.memory.usage", sum(used.get(pid, 0) for pid in pids), {PROCESS_PID: root})
            for root, pids in self._pids.items()
        ]

    # --- opening -------------------------------------------------------------------------------

    @classmethod
    def _select(cls, present: list[Gpu], config: ForgeConfig) -> list[Gpu]:
        """The GPUs of ``present`` that ``config.gpus`` selects, in the order it names them.

        A selected GPU brings its MIG instances (right after it); a MIG UUID selects only that instance.
        """
        try:
            wanted = select_gpus(config.gpus, [(gpu.key, gpu.uuid) for gpu in present], cls.visible_env)
        except ValueError as error:
            raise CollectorUnavailable(f"GPU selection: {error}") from None
        if not wanted:
            raise CollectorUnavailable(f"no GPU selected (gpus={config.gpus!r})")
        by_key = {gpu.key: gpu for gpu in present}
        selected: list[Gpu] = []
        for key in wanted:
            gpu = by_key[key]
            children = [child for child in present if child.parent is gpu] if gpu.parent is None else []
            selected += [device for device in (gpu, *children) if all(device is not kept for kept in selected)]
        return selected

    @classmethod
    def _process_tree(cls, config: ForgeConfig) -> MonitoredProcesses | None:
        try:
            return MonitoredProcesses.for_config(config)
        except CollectorUnavailable as error:
            cls.logger.warning("GPU memory of the monitored processes is not reported: %s", error)
            return None


def _add_status(gpu: Gpu, readings: Readings) -> None:
    for state, current in (("ok", not gpu.lost), ("failed", gpu.lost)):
        readings.add("hw.status", 1 if current else 0, {**gpu.attributes, "hw.state": state})


def _power_utilization(rows: list[Row]) -> list[Row]:
    """Power draw / enforced limit, when this read has both."""
    values = {metric: value for metric, value, _ in rows if metric in ("hw.power", "otel_forge.gpu.power.limit")}
    power, limit = values.get("hw.power"), values.get("otel_forge.gpu.power.limit")
    return [("otel_forge.gpu.power.utilization", power / limit, {})] if power is not None and limit else []
