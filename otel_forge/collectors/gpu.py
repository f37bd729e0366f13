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

Besides its fields' rows, every GPU reports ``hw.status`` (``ok`` / ``failed``) on every read and,
when a read has both its power draw and its enforced limit, ``otel_forge.gpu.power.utilization``.
"""

from __future__ import annotations

import abc
import enum
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from otel_forge.collectors.base import CollectorUnavailable, HardwareCollector, Readings
from otel_forge.collectors.gpu_selection import select_gpus
from otel_forge.collectors.process import ProcessTree
from otel_forge.config import ForgeConfig
from otel_forge.ratelimit import RateLimitedLogger

# One reading of a field: (metric name, value, attributes beyond the GPU's own).
Row = tuple[str, float | None, dict[str, str]]
FieldReader = Callable[[Any], list[Row]]

_Collector = TypeVar("_Collector", bound="GpuCollector")


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
    attributes: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.attributes = {
            "hw.id": str(self.index),
            "hw.name": self.name,
            "hw.vendor": self.vendor,
            "hw.type": "gpu",
            **{key: value for key, value in self.identity.items() if value},
            "otel_forge.gpu.uuid": self.uuid,
            "otel_forge.gpu.pci_bus_id": self.pci_bus_id,
        }

    def describe(self) -> str:
        """One line for ``otel-forge doctor``: identity, then failed and switched-off fields."""
        line = " ".join(filter(None, (f"gpu {self.index}:", self.name, self.uuid, self.pci_bus_id)))
        if self.lost:
            line += " (failed)"
        if self.unsupported:
            line += f" (not supported: {', '.join(sorted(self.unsupported))})"
        return line


class GpuCollector(HardwareCollector):
    """All selected GPUs of one vendor; the failure rules are in the module docstring.

    A subclass sets ``name``, ``logger`` (its module's: every message of the collector goes
    there), ``visible_env`` (the vendor's visibility variables, for ``gpus=visible``) and
    ``FIELDS``, defines ``_read_<field>(handle) -> list[Row]`` for each field (called in
    ``FIELDS`` order, under the collector's lock), and implements the hooks ``_start_library``,
    ``_open_gpus``, ``_shutdown_library`` and ``_failure``.

    ``create`` starts the library, opens the GPUs, keeps those the ``gpus`` setting selects and
    shuts the library down again if any of that fails. ``read`` and ``sample_field`` hold the
    lock; ``close`` takes it before shutting the library down, so a read in progress finishes
    first, and shuts it down once. ``process_memory`` is switched off on every GPU when the
    monitored process tree cannot be walked.
    """

    FIELDS: ClassVar[tuple[str, ...]]
    visible_env: ClassVar[tuple[str, ...]]
    logger: ClassVar[logging.Logger]

    def __init__(self, library: Any, gpus: list[Gpu], tree: ProcessTree | None) -> None:
        self._library = library
        self._gpus = gpus
        self._tree = tree
        self._pids: set[int] | None = None  # the monitored tree, found once per read when needed
        self._warnings = RateLimitedLogger(self.logger)
        self._lock = threading.Lock()
        self._closed = False
        self._readers: dict[str, FieldReader] = {name: getattr(self, f"_read_{name}") for name in self.FIELDS}
        if tree is None:
            for gpu in gpus:
                gpu.unsupported.add("process_memory")

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

    def sample_field(self, index: int, field_name: str) -> list[Row]:
        """One raw read of one field of one GPU, errors raised as the library raises them (for diagnostics)."""
        gpu = next(gpu for gpu in self._gpus if gpu.index == index)
        with self._lock:
            self._pids = None
            return self._readers[field_name](gpu.handle)

    def describe(self) -> list[str]:
        return [gpu.describe() for gpu in self._gpus]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:  # a read in progress finishes before the library goes away
            self._shutdown_library(self._library)

    # --- one GPU -------------------------------------------------------------------------------

    def _read_gpu(self, gpu: Gpu, readings: Readings) -> None:
        rows: list[Row] = []
        for name, reader in self._readers.items():
            if name not in gpu.unsupported:
                rows += self._read_field(gpu, name, reader)
                if gpu.lost:
                    return  # lost during this read: only hw.status from now on
        for metric, value, extra in rows + _power_utilization(rows):
            readings.add(metric, value, {**gpu.attributes, **extra})

    def _read_field(self, gpu: Gpu, name: str, reader: FieldReader) -> list[Row]:
        try:
            return reader(gpu.handle)
        except Exception as error:  # noqa: BLE001 - classified; at worst it costs that field, this read
            failure = self._failure(error)
            if failure is Failure.UNSUPPORTED:
                gpu.unsupported.add(name)
                self.logger.debug(
                    "GPU %d: %s not supported (%s); no longer read", gpu.index, name, self._error_text(error)
                )
            elif failure is Failure.LOST:
                gpu.lost = True
                self.logger.warning(
                    "GPU %d (%s) is lost: %s; it reports hw.status failed from now on",
                    gpu.index,
                    gpu.uuid,
                    self._error_text(error),
                )
            else:
                self._warnings.warning(name, "GPU %d: reading %s failed: %s", gpu.index, name, self._error_text(error))
        return []

    def _monitored_pids(self) -> set[int]:
        """The pids of the monitored process tree, walked at most once per read."""
        if self._pids is None:
            self._pids = self._tree.pids() if self._tree is not None else set()
        return self._pids

    # --- opening -------------------------------------------------------------------------------

    @classmethod
    def _select(cls, present: list[Gpu], config: ForgeConfig) -> list[Gpu]:
        """The GPUs of ``present`` that ``config.gpus`` selects, in the order it names them."""
        try:
            wanted = select_gpus(config.gpus, [(gpu.index, gpu.uuid) for gpu in present], cls.visible_env)
        except ValueError as error:
            raise CollectorUnavailable(f"GPU selection: {error}") from None
        if not wanted:
            raise CollectorUnavailable(f"no GPU selected (gpus={config.gpus!r})")
        by_index = {gpu.index: gpu for gpu in present}
        return [by_index[index] for index in wanted]

    @classmethod
    def _process_tree(cls, config: ForgeConfig) -> ProcessTree | None:
        try:
            return ProcessTree(config.pid or os.getpid())
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
