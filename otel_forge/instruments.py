"""Readings -> OpenTelemetry observable instruments, one per row of the metric table.

Callbacks read the cached snapshot of the collector that owns the metric, so every reader
(Prometheus, OTLP, MLflow) shares one hardware read per interval.
"""

from __future__ import annotations

import time

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from otel_forge.collectors.base import Collector, Readings
from otel_forge.names import METRICS, Kind, MetricSpec
from otel_forge.sampling import CachedCollector

if TYPE_CHECKING:
    from opentelemetry.metrics import CallbackOptions, Meter, Observation

INSTRUMENTATION_SCOPE = "otel_forge"


class SelfTelemetryCollector(Collector):
    """Reads the agent's own read statistics (time, reads, errors per collector) and when it was
    read, i.e. collected: what a scrape serves is that old (``time() - otel_forge_collect_time_seconds``)."""

    name = "self"

    def __init__(self, caches: Sequence[CachedCollector]) -> None:
        self._caches = caches


    def read(self, readings: Readings) -> None:
        readings.add("otel_forge.collect.time", time.time())
        for cache in self._caches:
            attributes = {"otel_forge.collector": cache.name}
            readings.add("otel_forge.collector.reads", cache.stats.reads, attributes)
            readings.add("otel_forge.collector.errors", cache.stats.errors, attributes)
            readings.add("otel_forge.collector.read.time", cache.stats.read_time_s, attributes)


def _specs_by_name(sources: set[str]) -> dict[str, list[MetricSpec]]:
    grouped: dict[str, list[MetricSpec]] = {}
    for spec in METRICS:
        if spec.source in sources:
            grouped.setdefault(spec.name, []).append(spec)
    return grouped


class InstrumentSet:
    """The observable instruments of a set of collectors on one meter.

    The OTel API cannot remove an instrument from a meter, so ``unregister`` silences the
    callbacks: an observable that observes nothing is not exported.
    """

    def __init__(self, meter: Meter, collectors: Iterable[Collector], max_age_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        caches = [CachedCollector(c, max_age_s, clock) for c in collectors]
        self.caches: dict[str, CachedCollector] = {c.name: c for c in caches}
        self.caches["self"] = CachedCollector(SelfTelemetryCollector(caches), max_age_s, clock)
        self._active = True
        self.instruments = [self._create(meter, name, specs)
                            for name, specs in _specs_by_name(set(self.caches)).items()]

    def unregister(self) -> None:
        self._active = False

    @property
    def active(self) -> bool:
        return self._active

    def _create(self, meter: Meter, name: str, specs: list[MetricSpec]) -> object:
        first = specs[0]
        callback = self._callback(name, [self.caches[s.source] for s in specs])
        create = {
            Kind.GAUGE: meter.create_observable_gauge,
            Kind.COUNTER: meter.create_observable_counter,
            Kind.UP_DOWN_COUNTER: meter.create_observable_up_down_counter,
        }[first.kind]
        return create(name, callbacks=[callback], unit=first.unit, description=first.description)

    def _callback(self, name: str, caches: list[CachedCollector]) -> Callable[[CallbackOptions], list[Observation]]:
        from opentelemetry.metrics import Observation

        def observe(options: CallbackOptions) -> list[Observation]:
            if not self._active:
                return []
            return [Observation(value, dict(attributes))
                    for cache in caches for attributes, value in cache.snapshot().readings.get(name)]

        return observe
