"""The Agent with several readers at once: one hardware read per interval, clean stop and restart."""

import threading
import time
import urllib.request

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader

from otel_forge import Agent, ForgeConfig


class CountingExporter(MetricExporter):
    def __init__(self):
        super().__init__()
        self.exports = 0

    def export(self, metrics_data, timeout_millis=10_000, **kwargs):
        self.exports += 1
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis=10_000):
        return True

    def shutdown(self, timeout_millis=30_000, **kwargs):
        pass


def test_three_readers_share_one_read_per_interval():
    interval_s = 0.5
    exporters = [CountingExporter(), CountingExporter()]
    config = ForgeConfig.resolve(environ={}, prometheus_host="127.0.0.1", prometheus_port=0,
                                 sampling_interval_s=interval_s, collectors="cpu,memory")
    agent = Agent(config, extra_readers=[
        lambda e=e: PeriodicExportingMetricReader(e, export_interval_millis=interval_s * 1000) for e in exporters])
    agent.start()
    url = agent.endpoints[0].split()[-1]
    scrapes = 0
    started = time.monotonic()
    while time.monotonic() - started < 3.0:  # Prometheus scraping 4x per interval, on its own thread
        urllib.request.urlopen(url).read()
        scrapes += 1
        time.sleep(interval_s / 4)
    elapsed = time.monotonic() - started
    reads = {name: cache.stats.reads for name, cache in agent.instruments.caches.items()}
    collects = scrapes + sum(e.exports for e in exporters)
    agent.shutdown()
    # Every reader collected many times, but each collector read its hardware at most once per
    # max_age (0.9 x interval), i.e. about once an interval, whatever the number of readers.
    assert collects >= 3 * elapsed / interval_s
    bound = elapsed / config.snapshot_max_age_s + 2
    assert 1 <= reads["cpu"] <= bound and 1 <= reads["memory"] <= bound, (reads, collects)


def test_stop_frees_threads_and_port_and_a_second_start_works():
    config = ForgeConfig.resolve(environ={}, prometheus_host="127.0.0.1", prometheus_port=0,
                                 sampling_interval_s=0.2, collectors="cpu", otlp_endpoint="http://127.0.0.1:9")
    before = {t.ident for t in threading.enumerate()}
    for _ in range(2):
        agent = Agent(config).start()
        url = agent.endpoints[0].split()[-1]
        assert b"system_cpu_logical_count" in urllib.request.urlopen(url).read()
        agent.shutdown(timeout_s=2)
        left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        assert left == [], left
        try:
            urllib.request.urlopen(url, timeout=1)
            served = True
        except OSError:
            served = False
        assert not served


def test_two_agents_in_one_process_have_their_own_registries():
    config = ForgeConfig.resolve(environ={}, prometheus_host="127.0.0.1", prometheus_port=0, collectors="memory")
    with Agent(config) as first, Agent(config) as second:
        for agent in (first, second):
            body = urllib.request.urlopen(agent.endpoints[0].split()[-1]).read().decode()
            assert body.count("# TYPE system_memory_limit_bytes gauge") == 1


def test_only_local_rank_zero_runs_an_agent():
    from otel_forge.node import NodeIdentity

    node = NodeIdentity.detect(environ={"LOCAL_RANK": "3", "RANK": "3"})
    agent = Agent(ForgeConfig.resolve(environ={}, prometheus_port=0), node=node).start()
    assert not agent.running and agent.endpoints == []
    agent.shutdown()
