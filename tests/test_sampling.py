"""One hardware read per interval however many readers collect; failures isolated."""

import logging

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from otel_forge.collectors.base import Collector, Readings
from otel_forge.pipeline.instruments import InstrumentSet
from otel_forge.pipeline.sampling import CachedCollector


class CountingCollector(Collector):
    name = "memory"  # the table's owner of the metrics it reads

    def __init__(self, fail=False):
        self.reads = 0
        self.fail = fail

    @classmethod
    def create(cls, config):
        return cls()

    def read(self, readings: Readings) -> None:
        self.reads += 1
        if self.fail:
            raise OSError("sensor on fire")
        readings.add("system.memory.limit", 100 + self.reads)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def metric_points(reader):
    data = reader.get_metrics_data()
    return (
        {m.name: m.data.data_points for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        if data
        else {}
    )


def test_snapshot_is_reused_until_max_age():
    clock = FakeClock()
    collector = CountingCollector()
    cache = CachedCollector(collector, max_age_s=0.9, clock=clock)
    first = cache.snapshot()
    clock.now = 0.5
    assert cache.snapshot() is first and collector.reads == 1
    clock.now = 0.9
    assert cache.snapshot() is not first and collector.reads == 2


def test_three_readers_cost_one_hardware_read_per_interval():
    clock = FakeClock()
    readers = [InMemoryMetricReader() for _ in range(3)]
    provider = MeterProvider(metric_readers=readers)
    collector = CountingCollector()
    instruments = InstrumentSet(provider.get_meter("t"), [collector], max_age_s=0.9, clock=clock)
    for interval in range(5):
        clock.now = float(interval)
        # Three readers at unrelated moments inside one interval, as Prometheus, OTLP and MLflow do.
        for offset, reader in zip((0.0, 0.3, 0.6), readers, strict=False):
            clock.now = interval + offset
            points = metric_points(reader)
            assert points["system.memory.limit"][0].value == 100 + interval + 1
    assert collector.reads == 5
    assert instruments.caches["memory"].stats.reads == 5
    provider.shutdown()


def test_a_failing_collector_costs_only_its_own_values_and_warns_once(caplog, monkeypatch):
    clock = FakeClock()
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])

    class Broken(CountingCollector):
        name = "broken"

    class Good(CountingCollector):
        name = "cpu"

        def read(self, readings):
            readings.add("system.cpu.utilization", 0.5, {"cpu.mode": "user"})

    broken = Broken(fail=True)
    from otel_forge import names

    monkeypatch.setattr(
        names, "METRICS", names.METRICS + (names.MetricSpec("x.broken", names.Kind.GAUGE, "1", "broken", (), "broken"),)
    )
    monkeypatch.setattr("otel_forge.pipeline.instruments.METRICS", names.METRICS)
    instruments = InstrumentSet(provider.get_meter("t"), [broken, Good()], max_age_s=0.9, clock=clock)
    with caplog.at_level(logging.WARNING):
        for interval in range(3):
            clock.now = float(interval)
            points = metric_points(reader)
            assert "system.cpu.utilization" in points
            assert "x.broken" not in points
    assert [r.getMessage() for r in caplog.records].count("collector broken failed to read: sensor on fire") == 1
    stats = instruments.caches["broken"].stats
    assert stats.reads == 3 and stats.errors == 3
    self_points = metric_points(reader)
    errors = {p.attributes["otel_forge.collector"]: p.value for p in self_points["otel_forge.collector.errors"]}
    # Self-telemetry is itself a cached read: within one interval it may be read before "broken".
    assert errors["broken"] in (2, 3) and errors["cpu"] == 0
    provider.shutdown()


def test_unregistered_instruments_stop_reporting():
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    instruments = InstrumentSet(provider.get_meter("t"), [CountingCollector()], max_age_s=0.0)
    assert "system.memory.limit" in metric_points(reader)
    instruments.unregister()
    assert metric_points(reader) == {}
    provider.shutdown()
