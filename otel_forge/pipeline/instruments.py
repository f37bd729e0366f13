"""Readings -> OpenTelemetry observable instruments, one per row of the metric table.

Callbacks read the cached snapshot of the collector that owns the metric, so every reader
(Prometheus, OTLP, MLflow) shares one hardware read per interval.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from otel_forge.collectors.base import Collector
from otel_forge.collectors.self_telemetry import SelfTelemetryCollector
from otel_forge.names import METRICS, Kind, MetricSpec
from otel_forge.pipeline.sampling import CachedCollector

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, Observation

INSTRUMENTATION_SCOPE = "otel_forge"


def _specs_by_name(sources: set[str]) -> dict[str, list[MetricSpec]]:
    grouped: dict[str, list[MetricSpec]] = {}
    for spec in METRICS:
        if spec.source in sources:
            grouped.setdefault(spec.name, []).append(spec)
    return grouped


class InstrumentSet:
    """The observable instruments of a set of collectors on one meter.

    The OTel API cannot remove an instrument from a meter, so ``unregister`` silences the
    callbacks: an observable that observes nothing is not exported. A meter hands back the
    instrument it already has for a name (with its first callbacks), so each instrument's callback
    is an ``_Observer`` that a later set on the same meter takes over once this one is unregistered.
    """

    def __init__(
        self,
        meter: Meter,
        collectors: Iterable[Collector],
        max_age_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        caches = [CachedCollector(c, max_age_s, clock) for c in collectors]
        self.caches: dict[str, CachedCollector] = {c.name: c for c in caches}
        self.caches["self"] = CachedCollector(SelfTelemetryCollector(caches), max_age_s, clock)
        self._active = True
        specs = _specs_by_name(set(self.caches))
        observers = _OBSERVERS.setdefault(meter, {})
        if busy := sorted(name for name in specs if name in observers and observers[name].observing):
            raise RuntimeError(
                f"otel_forge's instruments ({', '.join(busy[:3])}, ...) are already registered on this "
                "MeterProvider: call unregister() on the first registration before registering again"
            )
        for name, name_specs in specs.items():
            if name not in observers:
                observers[name] = _Observer(name)
                _create(meter, name_specs, observers[name])
            observers[name].observe_through(self, [self.caches[spec.source] for spec in name_specs])

    def unregister(self) -> None:
        self._active = False

    def expire(self) -> None:
        """The next collect reads every collector afresh, however recent its snapshot."""
        for cache in self.caches.values():
            cache.expire()

    @property
    def active(self) -> bool:
        return self._active


class _Observer:
    """The callback of one instrument: observes through the instrument set that registered last."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._owner: InstrumentSet | None = None
        self._caches: list[CachedCollector] = []

    @property
    def observing(self) -> bool:
        return self._owner is not None and self._owner.active

    def observe_through(self, owner: InstrumentSet, caches: list[CachedCollector]) -> None:
        self._owner, self._caches = owner, caches

    def __call__(self, options: CallbackOptions) -> list[Observation]:
        from opentelemetry.metrics import Observation

        if not self.observing:
            return []
        return [
            Observation(value, dict(attributes))
            for cache in self._caches
            for attributes, value in cache.snapshot().readings.get(self._name)
        ]


# Our instruments' callbacks per meter (a provider hands out one meter per scope).
_OBSERVERS: weakref.WeakKeyDictionary[Meter, dict[str, _Observer]] = weakref.WeakKeyDictionary()


def _create(meter: Meter, specs: list[MetricSpec], observer: _Observer) -> None:
    first = specs[0]
    create = {
        Kind.GAUGE: meter.create_observable_gauge,
        Kind.COUNTER: meter.create_observable_counter,
        Kind.UP_DOWN_COUNTER: meter.create_observable_up_down_counter,
    }[first.kind]
    create(first.name, callbacks=[observer], unit=first.unit, description=first.description)
