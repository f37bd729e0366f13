"""The collector contract: read one source in one pass, return plain readings.

A collector knows its hardware and nothing of OpenTelemetry: it adds ``(metric name, value,
attributes)`` readings to a ``Readings`` and the instrument layer turns them into observations.
"""

from __future__ import annotations

import abc
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from otel_forge.config import ForgeConfig

AttributeValue = str | int | float | bool
Attributes = Mapping[str, AttributeValue]


class CollectorUnavailable(Exception):
    """The source cannot be read on this machine (no library, no driver, no device)."""


class Readings:
    """The values of one read of a source, grouped by metric name."""

    def __init__(self) -> None:
        self._values: dict[str, list[tuple[Attributes, float]]] = defaultdict(list)

    def add(self, metric: str, value: float | int | None, attributes: Attributes | None = None) -> None:
        """Add one value; None (a field the source did not give) is skipped."""
        if value is not None:
            self._values[metric].append((attributes or {}, float(value)))

    def get(self, metric: str) -> list[tuple[Attributes, float]]:
        return self._values.get(metric, [])

    def metrics(self) -> list[str]:
        return list(self._values)


@dataclass(frozen=True)
class Snapshot:
    """The readings of one read and when it happened (``time.monotonic`` seconds)."""

    taken_at_s: float
    readings: Readings = field(default_factory=Readings)


class Collector(abc.ABC):
    """One source of readings. Subclasses set ``name`` and implement ``read``.

    ``read`` reads the whole source (all devices, all fields) once and may raise: the cache
    counts and rate-limits the failure, and the other collectors go on.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def read(self, readings: Readings) -> None:
        """Read the source once and add every value to ``readings``."""

    def describe(self) -> list[str]:
        """Lines for ``otel-forge doctor`` (e.g. one per GPU)."""
        return []

    def follow_process(self, pid: int) -> None:  # noqa: B027 - only sources that read processes
        """Read the process tree rooted at ``pid`` from now on (``otel-forge run``'s CMD, once it runs)."""

    def add_process(self, pid: int) -> None:  # noqa: B027 - only sources that read processes
        """Read the process tree rooted at ``pid`` too, reported apart (the node's companion: one per
        training process it samples for)."""

    def remove_process(self, pid: int) -> None:  # noqa: B027 - only sources that read processes
        """Read the process tree rooted at ``pid`` no more."""

    def close(self) -> None:  # noqa: B027 - optional: most sources hold nothing to release
        """Release the source (threads, library handles). Called once."""


class HardwareCollector(Collector):
    """A collector of the machine, opened by name from the settings (``open_collectors``)."""

    @classmethod
    @abc.abstractmethod
    def create(cls, config: ForgeConfig) -> HardwareCollector:
        """Open the source for ``config`` or raise ``CollectorUnavailable`` with the reason it is absent."""
