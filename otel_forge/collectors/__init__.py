"""Hardware sources. One module per source; ``open_collectors`` opens those the config names."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from otel_forge.collectors.base import Collector, CollectorUnavailable, HardwareCollector, Readings, Snapshot
from otel_forge.config import ForgeConfig

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpenedCollectors:
    """The collectors that opened, and for each one that did not, the reason."""

    present: tuple[Collector, ...]
    absent: dict[str, str]

    def close(self) -> None:
        for collector in self.present:
            try:
                collector.close()
            except Exception as error:  # noqa: BLE001 - closing one must not stop the others
                _logger.warning("closing collector %s failed: %s", collector.name, error)


def collector_class(name: str) -> type[HardwareCollector]:
    """The collector of ``name`` (one of ``config.COLLECTOR_NAMES``): ``<name>.py``'s
    ``<Name>Collector``, imported only when asked for (NVML and amdsmi are heavy or noisy)."""
    module = importlib.import_module(f"{__name__}.{name}")
    return getattr(module, f"{name.capitalize()}Collector")


def open_collectors(config: ForgeConfig) -> OpenedCollectors:
    """Open every collector of ``config.collectors``; an absent source is recorded, not raised."""
    present: list[Collector] = []
    absent: dict[str, str] = {}
    for name in config.collectors:
        try:
            present.append(collector_class(name).create(config))
        except CollectorUnavailable as reason:
            absent[name] = str(reason)
            _logger.info("collector %s absent: %s", name, reason)
        except Exception as error:  # noqa: BLE001 - a broken source must not stop the agent
            absent[name] = f"failed to open: {error!r}"
            _logger.warning("collector %s failed to open: %s", name, error)
    return OpenedCollectors(tuple(present), absent)


__all__ = [
    "Collector",
    "CollectorUnavailable",
    "HardwareCollector",
    "OpenedCollectors",
    "Readings",
    "Snapshot",
    "open_collectors",
]
