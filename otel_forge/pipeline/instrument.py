"""``instrument``: otel_forge's collectors on a MeterProvider the application already has."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from otel_forge.collectors import OpenedCollectors, open_collectors
from otel_forge.config import ForgeConfig
from otel_forge.pipeline.instruments import INSTRUMENTATION_SCOPE, InstrumentSet

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider as ApiMeterProvider


class Instrumentation:
    """What ``instrument`` registered on an application's provider; ``unregister()`` removes it."""

    def __init__(self, collectors: OpenedCollectors, instruments: InstrumentSet) -> None:
        self.collectors = collectors
        self.instruments = instruments
        self._lock = threading.Lock()

    def unregister(self) -> None:
        with self._lock:
            if self.instruments.active:
                self.instruments.unregister()
                self.collectors.close()


def instrument(
    meter_provider: ApiMeterProvider | None = None, config: ForgeConfig | None = None, **settings: Any
) -> Instrumentation:
    """Register the collectors on ``meter_provider`` (default: the global one).

    ``settings`` are ``ForgeConfig`` fields (e.g. ``collectors=["cpu", "nvidia"]``). The
    provider's readers and resource are the application's; only the instruments are ours. After
    ``unregister()`` the same provider can be instrumented again; while a registration is active, a
    second one raises ``RuntimeError`` (the provider would hand back the first one's instruments).
    """
    from opentelemetry import metrics

    config = config or ForgeConfig.resolve()
    if settings:
        config = config.replace(**settings)
    provider = meter_provider or metrics.get_meter_provider()
    collectors = open_collectors(config)
    try:
        instruments = InstrumentSet(
            provider.get_meter(INSTRUMENTATION_SCOPE), collectors.present, config.snapshot_max_age_s
        )
    except BaseException:
        collectors.close()
        raise
    return Instrumentation(collectors, instruments)
