"""The Agent: one collect per interval for every sink and scraper, sinks isolated, clean stop and restart."""

import threading
import time
import urllib.request

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult

from otel_forge import Agent, ForgeConfig
from testkit.servers import PROMETHEUS_ACCEPT, wait_for


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


def _scrape(url: str, accept: str, stop: threading.Event, counts: list[int]) -> None:
    while not stop.is_set():
        request = urllib.request.Request(url, headers={"Accept": accept})
        assert b"system_memory" in urllib.request.urlopen(request).read()
        counts.append(1)
        stop.wait(0.05)


def test_one_collect_per_interval_for_every_sink_and_scraper():
    interval_s = 0.5
    exporters = [CountingExporter(), CountingExporter()]
    config = ForgeConfig.resolve(
        environ={},
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        sampling_interval_s=interval_s,
        collectors="cpu,memory",
    )
    started = time.monotonic()
    agent = Agent(config, extra_exporters=[lambda e=e: e for e in exporters]).start()
    url = agent.endpoints[0].split()[-1]
    stop, scrapes = threading.Event(), []
    # Two scrapers, as an HA pair of Prometheus servers would, 10x per interval, text and OpenMetrics.
    scrapers = [
        threading.Thread(target=_scrape, args=(url, accept, stop, scrapes))
        for accept in ("text/plain", "application/openmetrics-text; version=1.0.0")
    ]
    for scraper in scrapers:
        scraper.start()
    time.sleep(3.0)
    stop.set()
    for scraper in scrapers:
        scraper.join()
    fan_out, rendering = agent.fan_out, agent.fan_out.sinks[0]
    readers = agent.meter_provider._metric_readers
    collects, renderings, encodings = fan_out.exports, rendering.renderings, rendering.encodings
    reads = {name: cache.stats.reads for name, cache in agent.instruments.caches.items()}
    intervals = (time.monotonic() - started) / interval_s  # that ran, whatever the machine's load
    agent.shutdown()  # one last collect, which the threaded sinks export before they stop
    # Every sink got every collect, or a newer one in its place while it was busy (counted once all stopped).
    handed = [e.exports + fan_out.skipped_by(e) for e in exporters]

    assert len(readers) == 1  # one reader: every SDK collect is one export to the fan-out
    assert len(scrapes) > 4 * collects  # scrapes far outnumber collects ...
    # ... which come from the interval, not the scrapes: more than one, never more than the intervals
    # that ran (plus the one a scrape before the first collect may trigger).
    assert 2 <= collects <= intervals + 2, (collects, intervals)
    assert handed == [fan_out.exports] * 2, (handed, fan_out.exports)
    assert renderings <= collects  # scrapes translate a collect once at most, and never collect
    assert encodings <= 2 * collects + 2  # one body per format per collect, whatever the scrapes
    assert 1 <= reads["cpu"] <= collects + 1 and 1 <= reads["memory"] <= collects + 1, (reads, collects)


def test_a_hung_sink_delays_no_other_sink():
    release = threading.Event()

    class HungExporter(CountingExporter):
        def export(self, metrics_data, timeout_millis=10_000, **kwargs):
            self.exports += 1
            release.wait()
            return MetricExportResult.SUCCESS

    hung, healthy = HungExporter(), CountingExporter()
    config = ForgeConfig.resolve(
        environ={}, prometheus_host="127.0.0.1", prometheus_port=0, sampling_interval_s=0.2, collectors="memory"
    )
    agent = Agent(config, extra_exporters=[lambda: hung, lambda: healthy]).start()
    url = agent.endpoints[0].split()[-1]
    try:
        # The others go on every interval (a wait, failing after 30 s: a blocked fan-out never gets there).
        wait_for(lambda: healthy.exports >= 5, 30, 0.05, message="5 collects for the healthy sink")
        first = urllib.request.urlopen(url).read()
        seen = healthy.exports
        wait_for(lambda: healthy.exports >= seen + 2, 30, 0.05, message="2 more collects for the healthy sink")
        second = urllib.request.urlopen(url).read()
        assert hung.exports == 1  # stuck in its first export
        assert first != second  # the rendering moves on (otel_forge_collect_time_seconds at least)
        # Newer collects replaced the waiting one: all but the one it holds and the one that waits.
        served = healthy.exports  # read first: a collect after it only adds to what was skipped
        assert agent.fan_out.skipped["HungExporter"] >= served - 2, (agent.fan_out.skipped, served)
    finally:
        release.set()
        agent.shutdown(timeout_s=2)


def test_a_scrape_before_the_first_collect_triggers_it_once():
    config = ForgeConfig.resolve(
        environ={}, prometheus_host="127.0.0.1", prometheus_port=0, sampling_interval_s=3600, collectors="memory"
    )
    with Agent(config) as agent:
        url = agent.endpoints[0].split()[-1]
        bodies = [urllib.request.urlopen(url).read() for _ in range(3)]
        assert b"system_memory_usage_bytes" in bodies[0] and len(set(bodies)) == 1
        assert agent.fan_out.exports == 1 and agent.fan_out.sinks[0].renderings == 1


def test_stop_frees_threads_and_port_and_a_second_start_works():
    config = ForgeConfig.resolve(
        environ={},
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        sampling_interval_s=0.2,
        collectors="cpu",
        otlp_endpoint="http://127.0.0.1:9",
    )
    before = {t.ident for t in threading.enumerate()}
    for _ in range(2):
        agent = Agent(config).start()
        url = agent.endpoints[0].split()[-1]
        assert b"system_cpu_logical_count" in urllib.request.urlopen(url).read()
        agent.shutdown(timeout_s=2)
        # Stopped threads are gone a moment later (an executor's worker ends after its shutdown returns).
        gone_by = time.monotonic() + 5
        while (left := [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]) and (
            time.monotonic() < gone_by
        ):
            time.sleep(0.02)
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


def test_an_otlp_exporter_set_to_delta_keeps_a_reader_of_its_own(monkeypatch):
    # The shared collect is cumulative (Prometheus and MLflow need it); delta needs its own collect.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    config = ForgeConfig.resolve(
        environ={},
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        collectors="memory",
        otlp_endpoint="http://127.0.0.1:9",
        sampling_interval_s=0.2,
    )  # OTLP gives up fast
    with Agent(config) as agent:
        readers = agent.meter_provider._metric_readers
        assert len(readers) == 2 and [type(s).__name__ for s in agent.fan_out.sinks] == ["PrometheusRendering"]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "cumulative")
    with Agent(config) as agent:
        assert len(agent.meter_provider._metric_readers) == 1
        assert [type(s).__name__ for s in agent.fan_out.sinks] == ["PrometheusRendering", "OTLPMetricExporter"]


def test_a_scraper_keeps_its_connection_and_shutdown_closes_it(monkeypatch):
    import http.client
    import socket

    config = ForgeConfig.resolve(
        environ={}, prometheus_host="127.0.0.1", prometheus_port=0, sampling_interval_s=0.2, collectors="memory"
    )
    writes = []
    send = socket.socket.send

    def counted(self, data, *args):
        # Writes to this test's scraper only: an endpoint another test left has the same thread name.
        if self.family == socket.AF_INET and self.getsockname()[1] == port:
            writes.append(len(data))
        return send(self, data, *args)

    before = {t.ident for t in threading.enumerate()}
    agent = Agent(config).start()
    port = int(agent.endpoints[0].split()[-1].rsplit(":", 1)[1].split("/")[0])
    monkeypatch.setattr(socket.socket, "send", counted)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    sockets = []
    for _ in range(3):
        connection.request("GET", "/metrics", headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"})
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Encoding") == "gzip"
        response.read()
        sockets.append(connection.sock)
    assert sockets[0] is not None and len(set(map(id, sockets))) == 1  # one connection for every scrape
    # One write a scrape: headers and body split in two writes wait out the scraper's delayed ACK
    # (Nagle's algorithm holds the second), ~40 ms a scrape.
    assert len(writes) == 3, writes
    agent.shutdown(timeout_s=2)

    def left() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]

    # the kept-alive connection's handler thread ends with the agent (on a loaded machine, a moment later)
    deadline = time.monotonic() + 10
    while left() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left() == []
    try:
        connection.request("GET", "/metrics")
        connection.getresponse()
        served = True
    except (OSError, http.client.HTTPException):
        served = False
    assert not served
    connection.close()


def test_the_agents_reader_follows_otel_metric_export_interval():
    config = ForgeConfig.resolve(environ={"OTEL_METRIC_EXPORT_INTERVAL": "200"}, prometheus=False, collectors="memory")
    exporter = CountingExporter()
    with Agent(config, extra_exporters=[lambda: exporter]):
        time.sleep(1.5)
    assert exporter.exports >= 4  # every 0.2 s, not the 10 s default (the last is the shutdown's collect)
