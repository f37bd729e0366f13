"""One SDK collect per interval, whatever the sinks and scrapers: the agent's CPU, and a scrape's CPU per series.

Run:  python -m bench.collect_once [--rounds 5] [--seconds 10] [--interval 0.5] [--scrapes 200] [--json]

Part 1, agent CPU per interval. An ``otel_forge.Agent`` runs in THIS process (collectors cpu, memory,
disk, network, process; ``--interval`` s, default 0.5) once per configuration, each for ``--seconds``
of reader ticks (default 10 s = 20 intervals); the configurations run in turn, ``--rounds`` times
(default 5), and each row gives the median of its rounds; its ratio is that median over OTLP alone's,
beside the lowest and highest of its rounds' ratios to their own OTLP alone. Rounds spread a drift of
the machine's speed over every configuration, where one long run per configuration let it reach one
alone; here one run of the same configuration differs from the next by up to 10%. Measured:
this process's CPU time (``time.process_time``: every thread, the reader's, the sinks', the
``/metrics`` server's) over a window that starts and ends on a tick of the agent's periodic reader (the
bench wraps ``agent.fan_out.export`` to be woken by each tick; its main thread sleeps otherwise),
divided by the ticks in the window. The reader's timer waits one interval after each collect, so the
"period" column is the interval plus the collect time. The process collector watches a sleeping child
of the bench (``pid``), as a node agent watches a training process: watching the bench itself, it read
the scrapers too (its children), and charged the scraped configurations ~0.5 ms an interval for them.
Everything else the bench starts runs in other processes, so it is not measured:

- sink 1, OTLP: ``http/protobuf`` to a receiver subprocess on 127.0.0.1 that answers every POST with 200,
  an empty body and ``application/x-protobuf`` (an empty ``ExportMetricsServiceResponse``; the OTLP HTTP
  exporter checks only the status code). "OTLP exports OK / interval" counts the exporter's SUCCESS
  results (the bench wraps its ``export``); the receiver's POST count is checked against them.
- sink 2, "MLflow-like": a ``NonBlockingExporter`` that only counts, called inline by the fan-out as the
  real ``MLflowMetricExporter`` is (that exporter's own conversion and REST calls are NOT included;
  bench/mlflow_export.py measures them).
- sink 3, "user's": a plain ``MetricExporter`` that only counts; the fan-out gives it a thread of its own.
- scrapers: ``sys.executable -c`` subprocesses scraping ``/metrics`` with Prometheus's own ``Accept``
  (OpenMetrics preferred) and ``Accept-Encoding: gzip``, each over one kept-alive connection as
  Prometheus does. Default period ``--scrape-period`` = 1.5 x the
  interval: Prometheus's typical 15 s ``scrape_interval`` against the agent's default 10 s sampling
  interval, compressed the same way; the stress row scrapes every ``--stress-period`` s (default 0.1 s).

"SDK collects / interval" counts every ``SynchronousMeasurementConsumer.collect`` of the SDK (the bench
wraps it), i.e. every collect of every reader, including any a scrape would trigger: 1.00 is the goal.
It also checks that over each agent's whole life every SDK collect went through the fan-out
(``agent.fan_out.exports``), that every counting sink got every collect, and that every OTLP export
succeeded and reached the receiver, in every round. Rounds run one after the other, after an unreported warm-up
run (Prometheus + 3 sinks + 1 scraper, ``--warmup-seconds``, default 5): without it the process's first
agent measured ~10% more CPU than the same configuration run later, which inflated the OTLP-alone
baseline. "x OTLP alone" divides by the first configuration.

Part 2, scrape CPU per series: otel_forge's ``/metrics`` vs Debian's ``prometheus-node-exporter``
(default collectors, ``--web.listen-address=127.0.0.1:PORT``; skipped with a note when absent). Each
server runs as its own process; the bench scrapes it ``--scrapes`` times back to back (after 5 warm-up
scrapes, one new connection each, no gzip) and takes the SERVER process's CPU time over the scrapes
minus its idle CPU rate (measured over 2 s just before) x their duration. CPU time of another process is
read with its ``CLOCK_PROCESS_CPUTIME`` clock (``clock_gettime`` on ``(~pid << 3) | 2``: nanoseconds,
every thread including exited ones), else psutil (10 ms ticks). Series = sample lines (non-comment,
non-empty) in one text-format body; the same count is used for the OpenMetrics row.
Ours is ``python -m otel_forge.cli monitor --prometheus-host 127.0.0.1 --prometheus-port 0 --interval
{--agent-interval, default 60} --collectors cpu,memory,disk,network,process`` (OTEL_* and MLFLOW_*
variables removed from its environment, so it has no other sink): the long interval keeps
periodic collects out of the measurement (the first scrape triggers the one collect, during warm-up;
the bench checks the body did not change across the scrapes), so the row is the cached scrape path:
HTTP + bytes encoded once per collect and format. Two derived rows add what a scrape costs when it is
the first after a new collect (Prometheus's typical case: scrape interval >= sampling interval), from
an in-process agent (Prometheus only, ``max_age_s`` 0.001 so each collect re-reads the hardware),
``--fresh-rounds`` rounds timed with ``time.process_time``: "+ translation + encoding" adds the first
text body of a collect (the translation of its data to Prometheus families and their encoding, which
happen at the first scrape after it); "+ the whole SDK collect" adds the collect itself too (hardware
read, callbacks, aggregation): what the per-reader design did on every scrape, and what node_exporter
does on every scrape.

The "previous design" figures are from issue 11, measured before this change (constants).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from bench._common import REPO_ROOT, wait_until
from otel_forge.config import ForgeConfig
from otel_forge.pipeline import Agent
from otel_forge.pipeline.fanout import NonBlockingExporter
from testkit.servers import PROMETHEUS_ACCEPT, free_port

COLLECTORS = "cpu,memory,disk,network,process"
NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
WARMUP_TICKS = 2
IDLE_S = 2.0
WARMUP_SCRAPES = 5
TEXT_ACCEPT = "text/plain;version=0.0.4"
OPENMETRICS_ACCEPT = "application/openmetrics-text;version=1.0.0"

# Previous design (one reader per sink, one SDK collect per scrape), from issue 11.
PREVIOUS = {
    "cpu_ratio_prom_otlp_mlflow_vs_otlp": 3.68,
    "scrape_us_per_series": 29.7,
    "node_exporter_us_per_series": 6.7,
    "scrape_ratio_vs_node_exporter": 4.5,
}
GOALS = {"cpu_ratio": 1.3, "scrape_ratio": 0.5}

RECEIVER = r"""
import sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
posts = 0
lock = threading.Lock()
class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_POST(self):
        global posts
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        with lock:
            posts += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()
    def do_GET(self):
        body = str(posts).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

SCRAPER = r"""
import http.client, signal, sys, time, urllib.parse
url, period, accept = urllib.parse.urlsplit(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
headers = {"Accept": accept, "Accept-Encoding": "gzip"}
connection = None
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
scrapes = errors = 0
started = next_at = time.monotonic()
while not stop:
    try:
        # One kept-alive connection, as Prometheus scrapes; a new one after an error.
        connection = connection or http.client.HTTPConnection(url.hostname, url.port, timeout=5)
        connection.request("GET", url.path, headers=headers)
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        scrapes += 1
    except Exception as error:
        errors += 1
        connection = None
        print(repr(error), file=sys.stderr, flush=True)
    next_at += period
    delay = next_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    else:
        next_at = time.monotonic()
print(scrapes, errors, time.monotonic() - started, flush=True)
"""


# --- helpers -------------------------------------------------------------------------------------


class CountingExporter(MetricExporter):
    """A user's exporter that only counts: not a NonBlockingExporter, so the fan-out gives it a thread."""

    def __init__(self) -> None:
        super().__init__(preferred_temporality={}, preferred_aggregation={})
        self.exports = 0

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        self.exports += 1
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        pass


class InlineCountingExporter(CountingExporter, NonBlockingExporter):
    """MLflow-like: called inline by the fan-out, as ``MLflowMetricExporter`` is; only counts."""


class LogCapture(logging.Handler):
    """Every WARNING+ record logged in this process while the bench runs."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


class SdkCollects:
    """Counts every collect the SDK makes (any reader), by wrapping its measurement consumer."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[SdkCollects]:
        from opentelemetry.sdk.metrics._internal.measurement_consumer import SynchronousMeasurementConsumer

        original = SynchronousMeasurementConsumer.collect

        def collect(consumer: Any, *args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(consumer, *args, **kwargs)

        SynchronousMeasurementConsumer.collect = collect  # type: ignore[method-assign]
        try:
            yield self
        finally:
            SynchronousMeasurementConsumer.collect = original  # type: ignore[method-assign]


class Ticks:
    """Counts the fan-out's exports (the periodic reader's ticks) and wakes whoever waits for one."""

    def __init__(self, fan_out: Any) -> None:
        self.count = 0
        self._cond = threading.Condition()
        export = fan_out.export

        def counted(*args: Any, **kwargs: Any) -> Any:
            try:
                return export(*args, **kwargs)
            finally:
                with self._cond:
                    self.count += 1
                    self._cond.notify_all()

        fan_out.export = counted

    def wait_for(self, count: int, timeout_s: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self.count >= count, timeout_s):
                raise SystemExit(f"the agent's reader ticked {self.count} times, expected {count}: is it stuck?")


@dataclass
class Spawned:
    name: str
    process: subprocess.Popen
    stderr_path: Path

    def stop(self, timeout_s: float = 5.0) -> str:
        """Stop it (SIGTERM, then SIGKILL); return its stdout (when piped) and keep stderr for notes."""
        out = ""
        if self.process.poll() is None:
            self.process.terminate()
        try:
            out, _ = self.process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, _ = self.process.communicate()
        return out or ""

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace").strip() if self.stderr_path.exists() else ""


class Processes:
    """Every process the bench starts; ``stop_all`` in a ``finally`` stops those still running."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.spawned: list[Spawned] = []

    def start(
        self,
        name: str,
        args: list[str],
        stdout: Any = subprocess.PIPE,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> Spawned:
        stderr_path = self.workdir / f"{name}-{len(self.spawned)}.stderr"
        with open(stderr_path, "w") as stderr:
            process = subprocess.Popen(args, stdout=stdout, stderr=stderr, text=True, env=env, cwd=cwd)
        spawned = Spawned(name, process, stderr_path)
        self.spawned.append(spawned)
        return spawned

    def stop_all(self) -> None:
        for spawned in self.spawned:
            if spawned.process.poll() is None:
                spawned.stop()


def process_cpu_clock(pid: int) -> tuple[Callable[[], float], str]:
    """A function giving ``pid``'s CPU seconds, and which clock it reads."""
    clock_id = ((~pid) << 3) | 2  # Linux: CPUCLOCK_SCHED of the whole process
    try:
        time.clock_gettime(clock_id)
        return (lambda: time.clock_gettime(clock_id)), "CLOCK_PROCESS_CPUTIME of the pid (ns)"
    except (OSError, OverflowError):
        process = psutil.Process(pid)

        def psutil_cpu() -> float:
            times = process.cpu_times()
            return times.user + times.system

        return psutil_cpu, "psutil cpu_times (10 ms ticks)"


def fetch(url: str, accept: str) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.read()


def count_series(body: bytes) -> int:
    return sum(1 for line in body.decode(errors="replace").splitlines() if line.strip() and not line.startswith("#"))


def clean_env() -> dict[str, str]:
    """This environment without OTEL_* / MLFLOW_* settings, so a subprocess agent adds no sink of its own."""
    return {name: value for name, value in os.environ.items() if not name.startswith(("OTEL_", "MLFLOW_"))}


# --- part 1: agent CPU per interval ------------------------------------------------------------------


@dataclass(frozen=True)
class AgentCase:
    key: str
    label: str
    push_sinks: int  # 1: OTLP; 2: + MLflow-like; 3: + user's
    prometheus: bool
    scrapers: int = 0
    scrape_period_s: float = 0.0


def agent_cases(scrape_period_s: float, stress_period_s: float) -> list[AgentCase]:
    cases = [
        AgentCase("otlp", "OTLP", 1, False),
        AgentCase("otlp+mlflow", "OTLP + MLflow-like", 2, False),
        AgentCase("otlp+mlflow+user", "OTLP + MLflow-like + user's", 3, False),
        AgentCase("prom-0", "Prometheus + 3 sinks, 0 scrapers", 3, True),
        AgentCase("prom-1", "Prometheus + 3 sinks, 1 scraper", 3, True, 1, scrape_period_s),
        AgentCase("prom-2", "Prometheus + 3 sinks, 2 scrapers", 3, True, 2, scrape_period_s),
    ]
    if stress_period_s > 0:
        cases.append(
            AgentCase("prom-2-stress", "Prometheus + 3 sinks, 2 scrapers (stress)", 3, True, 2, stress_period_s)
        )
    return cases


class Receiver:
    """The OTLP receiver subprocess: 200 + empty protobuf body to every POST; GET answers its POST count.
    Beside it, the process the agent's process collector watches (``pid``), as a node agent watches a
    training process: a sleeper with no children. Not this process, whose children (the receiver, the
    scrapers) the collector would read too, more of them in the scraped configurations."""

    def __init__(self, processes: Processes) -> None:
        self.monitored = processes.start("monitored", [sys.executable, "-c", "import time; time.sleep(86400)"])
        self.monitored_pid = self.monitored.process.pid
        self.spawned = processes.start("otlp-receiver", [sys.executable, "-c", RECEIVER])
        line = self.spawned.process.stdout.readline()  # type: ignore[union-attr]
        if not line.strip().isdigit():
            raise SystemExit(f"the OTLP receiver did not start: {self.spawned.stderr()}")
        self.url = f"http://127.0.0.1:{int(line)}"

    def posts(self) -> int:
        return int(fetch(self.url + "/count", "text/plain"))


def start_scrapers(processes: Processes, url: str, case: AgentCase) -> list[Spawned]:
    args = [sys.executable, "-c", SCRAPER, url, str(case.scrape_period_s), PROMETHEUS_ACCEPT]
    return [processes.start(f"scraper-{case.key}", args) for _ in range(case.scrapers)]


def stop_scrapers(scrapers: list[Spawned], interval_s: float) -> dict[str, Any]:
    scrapes = errors = 0
    rate = 0.0
    problems = []
    for scraper in scrapers:
        fields = scraper.stop().split()
        if len(fields) == 3:
            scrapes += int(fields[0])
            errors += int(fields[1])
            rate += int(fields[0]) / max(float(fields[2]), 1e-9)
        if scraper.stderr():
            problems.append(scraper.stderr().splitlines()[-1])
    return {"scrapes": scrapes, "errors": errors, "scrapes_per_interval": rate * interval_s, "problems": problems}


def sink_factories(push_sinks: int, made: list[CountingExporter]) -> list[Callable[[], MetricExporter]]:
    def factory(cls: type[CountingExporter]) -> Callable[[], MetricExporter]:
        def make() -> MetricExporter:
            exporter = cls()
            made.append(exporter)
            return exporter

        return make

    return [factory(InlineCountingExporter), factory(CountingExporter)][: push_sinks - 1]


def agent_config(case: AgentCase, interval_s: float, otlp_url: str, monitored_pid: int) -> ForgeConfig:
    return ForgeConfig.resolve(
        environ={},
        pid=monitored_pid,
        prometheus=case.prometheus,
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        sampling_interval_s=interval_s,
        collectors=COLLECTORS,
        otlp_endpoint=otlp_url,
        otlp_protocol="http/protobuf",
    )


def prometheus_url(agent: Agent) -> str:
    return next(e.split(" ", 1)[1] for e in agent.endpoints if e.startswith("prometheus "))


class OtlpResults:
    """Counts the agent's OTLP exporter's results (on its sink thread): SUCCESS proves the receiver's
    empty 200 answer is accepted."""

    def __init__(self, agent: Agent) -> None:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        self.ok = self.failed = 0
        exporter = next(sink for sink in agent.fan_out.sinks if isinstance(sink, OTLPMetricExporter))  # type: ignore
        export = exporter.export

        def counted(*args: Any, **kwargs: Any) -> MetricExportResult:
            result = export(*args, **kwargs)
            if result is MetricExportResult.SUCCESS:
                self.ok += 1
            else:
                self.failed += 1
            return result

        exporter.export = counted


def measure_window(
    agent: Agent, ticks: Ticks, intervals: int, interval_s: float, sdk: SdkCollects, otlp: OtlpResults
) -> dict[str, Any]:
    """CPU, SDK collects and OTLP exports over ``intervals`` reader ticks, from one tick to another."""
    timeout_s = intervals * interval_s * 3 + 10
    rendering = agent.fan_out.sinks[0] if agent.config.prometheus else None  # type: ignore[union-attr]
    start = ticks.count + 1
    ticks.wait_for(start, timeout_s)
    wall0, cpu0, sdk0, otlp0 = time.monotonic(), time.process_time(), sdk.count, otlp.ok
    encodings0 = rendering.encodings if rendering else 0
    ticks.wait_for(start + intervals, timeout_s)
    wall1, cpu1, sdk1, otlp1 = time.monotonic(), time.process_time(), sdk.count, otlp.ok
    encodings1 = rendering.encodings if rendering else 0
    return {
        "intervals": intervals,
        "cpu_ms_per_interval": (cpu1 - cpu0) * 1e3 / intervals,
        "period_ms": (wall1 - wall0) * 1e3 / intervals,
        "sdk_collects_per_interval": (sdk1 - sdk0) / intervals,
        "otlp_ok_per_interval": (otlp1 - otlp0) / intervals,
        "encodings_per_interval": (encodings1 - encodings0) / intervals,
    }


def start_agent(
    case: AgentCase, args: argparse.Namespace, receiver: Receiver, made: list[CountingExporter]
) -> tuple[Agent, Ticks, OtlpResults]:
    config = agent_config(case, args.interval, receiver.url, receiver.monitored_pid)
    agent = Agent(config, extra_exporters=sink_factories(case.push_sinks, made))
    agent.start()
    if not agent.running or agent.fan_out is None:
        agent.shutdown()
        raise SystemExit("the agent did not start (LOCAL_RANK set to a non-zero rank?)")
    return agent, Ticks(agent.fan_out), OtlpResults(agent)


def run_case(
    case: AgentCase,
    args: argparse.Namespace,
    receiver: Receiver,
    processes: Processes,
    sdk: SdkCollects,
    seconds: float,
) -> dict[str, Any]:
    made: list[CountingExporter] = []
    sdk_before, posts_before = sdk.count, receiver.posts()
    agent, ticks, otlp = start_agent(case, args, receiver, made)
    scrapers: list[Spawned] = []
    try:
        if case.scrapers:
            scrapers = start_scrapers(processes, prometheus_url(agent), case)
        ticks.wait_for(WARMUP_TICKS, 30)
        if case.scrapers and not wait_until(lambda: agent.fan_out.sinks[0].encodings > 0, 15):  # type: ignore
            raise SystemExit(f"{case.key}: no scrape reached the agent")
        intervals = max(2, round(seconds / args.interval))
        row = {**asdict(case), **measure_window(agent, ticks, intervals, args.interval, sdk, otlp)}
        row["skipped"] = dict(agent.fan_out.skipped)  # type: ignore[union-attr]
    finally:
        scraped = stop_scrapers(scrapers, args.interval)
        fan_out, absent = agent.fan_out, agent.absent_collectors
        agent.shutdown()
    row.update(scraped)
    row.update(
        {
            "absent_collectors": absent,
            "fan_out_exports": fan_out.exports,
            "sdk_collects": sdk.count - sdk_before,
            "sink_exports": [exporter.exports for exporter in made],
            "otlp_ok": otlp.ok,
            "otlp_failed": otlp.failed,
            "otlp_posts_received": receiver.posts() - posts_before,
            "skipped_total": dict(fan_out.skipped),
        }
    )  # a shutdown's final collect may replace a waiting one
    return row


def agent_part(args: argparse.Namespace, processes: Processes, sdk: SdkCollects) -> list[dict[str, Any]]:
    receiver = Receiver(processes)
    cases = agent_cases(args.scrape_period or 1.5 * args.interval, args.stress_period)
    if args.warmup_seconds > 0:  # the process's first agent costs ~10% more: warm every path, unreported
        print(f"part 1: warm-up, {cases[4].label} ({args.warmup_seconds:g} s)", file=sys.stderr, flush=True)
        run_case(cases[4], args, receiver, processes, sdk, args.warmup_seconds)
    rounds = []
    for index in range(args.rounds):
        rows = []
        for case in cases:
            print(f"part 1, round {index + 1}: {case.label} ({args.seconds:g} s)", file=sys.stderr, flush=True)
            rows.append(run_case(case, args, receiver, processes, sdk, args.seconds))
        for row in rows:
            row["ratio_vs_otlp"] = row["cpu_ms_per_interval"] / rows[0]["cpu_ms_per_interval"]
        rounds.append(rows)
    receiver.spawned.stop()
    receiver.monitored.stop()
    merged = [median_round(list(case_rounds)) for case_rounds in zip(*rounds, strict=True)]
    for row in merged:  # the median configuration against the median OTLP alone: one noisy baseline weighs less
        row["ratio_vs_otlp"] = row["cpu_ms_per_interval"] / merged[0]["cpu_ms_per_interval"]
    return merged


# Per-interval figures of a configuration: its row gives their median over the rounds.
MEDIAN_FIELDS = (
    "cpu_ms_per_interval",
    "period_ms",
    "sdk_collects_per_interval",
    "otlp_ok_per_interval",
    "scrapes_per_interval",
    "encodings_per_interval",
)


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's row: the medians of its rounds, the range of its rounds' ratios, and every round."""
    row = {**rounds[0], **{name: statistics.median(r[name] for r in rounds) for name in MEDIAN_FIELDS}}
    ratios = [r["ratio_vs_otlp"] for r in rounds]
    row.update(ratio_min=min(ratios), ratio_max=max(ratios), rounds=rounds)
    return row


# --- part 2: scrape CPU per series -------------------------------------------------------------------


def server_scrape_cost(cpu: Callable[[], float], url: str, accept: str, scrapes: int) -> dict[str, Any]:
    """The server's CPU per scrape over ``scrapes`` back-to-back scrapes, less its idle rate."""
    for _ in range(WARMUP_SCRAPES):
        fetch(url, accept)
    cpu0, wall0 = cpu(), time.monotonic()
    time.sleep(IDLE_S)
    idle_rate = (cpu() - cpu0) / (time.monotonic() - wall0)
    body = fetch(url, accept)
    cpu0, wall0 = cpu(), time.monotonic()
    for _ in range(scrapes):
        fetch(url, accept)
    elapsed = time.monotonic() - wall0
    spent = cpu() - cpu0 - idle_rate * elapsed
    return {
        "scrapes": scrapes,
        "sample_lines": count_series(body),
        "bytes": len(body),
        "us_per_scrape": spent * 1e6 / scrapes,
        "wall_ms_per_scrape": elapsed * 1e3 / scrapes,
        "idle_ms_per_s": idle_rate * 1e3,
        "body": body,
    }


def wait_for_line(path: Path, prefix: str, spawned: Spawned, timeout_s: float) -> str:
    found: list[str] = []

    def seen() -> bool:
        if spawned.process.poll() is not None:
            raise SystemExit(f"{spawned.name} exited: {spawned.stderr()}")
        found.extend(line for line in path.read_text().splitlines() if line.startswith(prefix))
        return bool(found)

    if not wait_until(seen, timeout_s):
        raise SystemExit(f"{spawned.name} did not print {prefix!r} within {timeout_s:g} s: {spawned.stderr()}")
    return found[0]


def ours_scrapes(args: argparse.Namespace, processes: Processes) -> dict[str, Any]:
    stdout_path = processes.workdir / "agent.stdout"
    command = [
        sys.executable,
        "-m",
        "otel_forge.cli",
        "monitor",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "0",
        "--interval",
        f"{args.agent_interval:g}",
        "--collectors",
        COLLECTORS,
    ]
    with open(stdout_path, "w") as stdout:
        agent = processes.start("agent", command, stdout=stdout, env=clean_env(), cwd=REPO_ROOT)
    line = wait_for_line(stdout_path, "otel-forge: serving prometheus ", agent, 60)
    url = line.split()[-1]
    cpu, clock = process_cpu_clock(agent.process.pid)
    before = fetch(url, TEXT_ACCEPT)
    text = server_scrape_cost(cpu, url, TEXT_ACCEPT, args.scrapes)
    openmetrics = server_scrape_cost(cpu, url, OPENMETRICS_ACCEPT, args.scrapes)
    after = fetch(url, TEXT_ACCEPT)
    agent.stop()
    return {
        "command": shlex.join(["python", *command[1:]]),
        "clock": clock,
        "text": text,
        "openmetrics": openmetrics,
        "collect_during_scrapes": before != after,
        "stderr": agent.stderr(),
    }


def node_exporter_scrapes(args: argparse.Namespace, processes: Processes) -> dict[str, Any] | None:
    if not os.access(NODE_EXPORTER, os.X_OK):
        return None
    version = subprocess.run([NODE_EXPORTER, "--version"], check=False, capture_output=True, text=True, timeout=30)
    port = free_port()
    exporter = processes.start(
        "node-exporter", [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}/metrics"

    def up() -> bool:
        if exporter.process.poll() is not None:
            raise SystemExit(f"prometheus-node-exporter exited: {exporter.stderr()[-2000:]}")
        with contextlib.suppress(OSError):
            return bool(fetch(url, TEXT_ACCEPT))
        return False

    if not wait_until(up, 20):
        raise SystemExit("prometheus-node-exporter did not answer within 20 s")
    cpu, clock = process_cpu_clock(exporter.process.pid)
    text = server_scrape_cost(cpu, url, TEXT_ACCEPT, args.scrapes)
    exporter.stop()
    errors = [
        re.sub(r"(ts|duration_seconds)=\S+ ?", "", line)
        for line in exporter.stderr().splitlines()
        if ("level=error" in line or "level=warn" in line) and "running as root" not in line
    ]
    commonest = max(set(errors), key=errors.count) if errors else ""
    return {
        "version": (version.stdout or version.stderr).splitlines()[0],
        "clock": clock,
        "text": text,
        "log_problems": len(errors),
        "log_example": commonest,
        "log_example_count": errors.count(commonest),
    }


def fresh_collect_cost(rounds: int) -> dict[str, Any]:
    """In this process, per round: one whole agent collect, then the first text body of it (its
    translation to Prometheus families and their encoding)."""
    config = ForgeConfig.resolve(
        environ={},
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        sampling_interval_s=3600,
        max_age_s=0.001,
        collectors=COLLECTORS,
    )
    agent = Agent(config).start()
    try:
        rendering = agent.fan_out.sinks[0]  # type: ignore[union-attr]
        for _ in range(3):
            rendering.collect_now()
            rendering.body(TEXT_ACCEPT, None)
        collect_s = render_s = 0.0
        encodings0 = rendering.encodings
        for _ in range(rounds):
            started = time.process_time()
            rendering.collect_now()
            middle = time.process_time()
            rendering.body(TEXT_ACCEPT, None)
            collect_s += middle - started
            render_s += time.process_time() - middle
        encoded = rendering.encodings - encodings0
    finally:
        agent.shutdown()
    return {
        "rounds": rounds,
        "collect_us": collect_s * 1e6 / rounds,
        "render_text_us": render_s * 1e6 / rounds,
        "encodings_per_round": encoded / rounds,
    }


def scrape_part(args: argparse.Namespace, processes: Processes) -> dict[str, Any]:
    print("part 2: otel_forge /metrics", file=sys.stderr, flush=True)
    ours = ours_scrapes(args, processes)
    print("part 2: prometheus-node-exporter", file=sys.stderr, flush=True)
    node = node_exporter_scrapes(args, processes)
    print("part 2: fresh-collect rounds in process", file=sys.stderr, flush=True)
    fresh = fresh_collect_cost(args.fresh_rounds)
    series = ours["text"]["sample_lines"]
    http_us = ours["text"]["us_per_scrape"]
    rows = [
        {"key": "ours-text", "label": "otel_forge, text (cached)", "series": series, "us_per_scrape": http_us},
        {
            "key": "ours-openmetrics",
            "label": "otel_forge, OpenMetrics (cached)",
            "series": series,
            "us_per_scrape": ours["openmetrics"]["us_per_scrape"],
        },
        {
            "key": "ours-text-new-collect",
            "label": "otel_forge, text, first scrape after a collect: cached + translation + encoding (derived)",
            "series": series,
            "us_per_scrape": http_us + fresh["render_text_us"],
        },
        {
            "key": "ours-text-with-collect",
            "label": "otel_forge, text, + the whole SDK collect (derived)",
            "series": series,
            "us_per_scrape": http_us + fresh["collect_us"] + fresh["render_text_us"],
        },
    ]
    if node is not None:
        rows.insert(
            0,
            {
                "key": "node-exporter",
                "label": f"prometheus-node-exporter {node['version'].split()[2]}, text",
                "series": node["text"]["sample_lines"],
                "us_per_scrape": node["text"]["us_per_scrape"],
            },
        )
    node_per_series = node["text"]["us_per_scrape"] / node["text"]["sample_lines"] if node else None
    for row in rows:
        row["us_per_series"] = row["us_per_scrape"] / row["series"]
        row["ratio_vs_node_exporter"] = row["us_per_series"] / node_per_series if node_per_series else None
    for part in (ours["text"], ours["openmetrics"], *([node["text"]] if node else [])):
        part.pop("body")
    return {
        "rows": rows,
        "ours": ours,
        "node_exporter": node,
        "fresh": fresh,
        "openmetrics_sample_lines": ours["openmetrics"]["sample_lines"],
    }


# --- report ------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "absent"

    return {
        "logical_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "opentelemetry_sdk": version("opentelemetry-sdk"),
        "prometheus_client": version("prometheus_client"),
        "opentelemetry_exporter_prometheus": version("opentelemetry-exporter-prometheus"),
        "psutil": psutil.__version__,
        "loadavg_start": os.getloadavg(),
    }


def summarize(
    agent_rows: list[dict[str, Any]],
    scrapes: dict[str, Any],
    args: argparse.Namespace,
    command: str,
    info: dict[str, Any],
    logs: list[str],
) -> dict[str, Any]:
    by_key = {row["key"]: row for row in agent_rows}
    every_round = [r for row in agent_rows for r in row["rounds"]]
    goal_row = by_key["prom-2"]  # the measurement: 2 scrapers, as an HA pair of Prometheus
    ours_text = next(r for r in scrapes["rows"] if r["key"] == "ours-text")
    info["loadavg_end"] = os.getloadavg()
    return {
        "command": command,
        "machine": info,
        "settings": {
            "seconds": args.seconds,
            "rounds": args.rounds,
            "interval_s": args.interval,
            "scrapes": args.scrapes,
            "scrape_period_s": args.scrape_period or 1.5 * args.interval,
            "stress_period_s": args.stress_period,
            "agent_interval_s": args.agent_interval,
            "warmup_seconds": args.warmup_seconds,
            "fresh_rounds": args.fresh_rounds,
        },
        "agent": agent_rows,
        "scrape": scrapes,
        "previous": PREVIOUS,
        "goals": GOALS,
        "verdicts": {
            "cpu_ratio": goal_row["ratio_vs_otlp"],
            "cpu_ratio_met": goal_row["ratio_vs_otlp"] <= GOALS["cpu_ratio"],
            "one_collect_per_interval": all(abs(r["sdk_collects_per_interval"] - 1) < 1e-9 for r in every_round),
            "all_collects_through_fan_out": all(r["sdk_collects"] == r["fan_out_exports"] for r in every_round),
            "scrape_ratio": ours_text["ratio_vs_node_exporter"],
            "scrape_ratio_met": (
                ours_text["ratio_vs_node_exporter"] <= GOALS["scrape_ratio"]
                if ours_text["ratio_vs_node_exporter"] is not None
                else None
            ),
            "prometheus_unscraped_ms_per_interval": (
                by_key["prom-0"]["cpu_ms_per_interval"] - by_key["otlp+mlflow+user"]["cpu_ms_per_interval"]
            ),
        },
        "log_warnings": logs,
    }


def met(value: bool | None) -> str:
    return {True: "met", False: "NOT met", None: "n/a"}[value]


def render_agent(result: dict[str, Any]) -> list[str]:
    s, v = result["settings"], result["verdicts"]
    lines = [
        (
            f"### Agent CPU per interval ({s['interval_s']:g} s interval, {s['seconds']:g} s per configuration "
            f"and round, median of {s['rounds']} rounds)"
        ),
        "",
        (
            "| configuration | push sinks | scrapers (period) | CPU ms/interval | x OTLP alone (rounds' range) "
            "| SDK collects/interval "
            "| OTLP exports OK/interval | scrapes/interval | encodings/interval | period ms |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["agent"]:
        scrapers = f"{r['scrapers']} ({r['scrape_period_s']:g} s)" if r["scrapers"] else "0"
        scrapers += "" if r["prometheus"] else ", Prometheus off"
        lines.append(
            f"| {r['label']} | {r['push_sinks']} | {scrapers} | {r['cpu_ms_per_interval']:.2f} "
            f"| {r['ratio_vs_otlp']:.2f} ({r['ratio_min']:.2f}-{r['ratio_max']:.2f}) "
            f"| {r['sdk_collects_per_interval']:.2f} "
            f"| {r['otlp_ok_per_interval']:.2f} | {r['scrapes_per_interval']:.2f} "
            f"| {r['encodings_per_interval']:.2f} | {r['period_ms']:.0f} |"
        )
    lines += [
        "",
        "| ratio | now | previous design, from issue 11 | goal |",
        "|---|---:|---:|---|",
        (
            f"| Prometheus (2 scrapers) + OTLP + MLflow-like + user's / OTLP alone | {v['cpu_ratio']:.2f} "
            f"| {PREVIOUS['cpu_ratio_prom_otlp_mlflow_vs_otlp']:.2f} (Prometheus + OTLP + MLflow) "
            f"| <= {GOALS['cpu_ratio']:g}: {met(v['cpu_ratio_met'])} |"
        ),
        "",
        (
            f"One SDK collect per interval in every configuration: {'yes' if v['one_collect_per_interval'] else 'NO'}; "
            f"every SDK collect went through the fan-out: {'yes' if v['all_collects_through_fan_out'] else 'NO'} "
            f"(every round). Prometheus on but not scraped (0 scrapers minus the same sinks without it): "
            f"{v['prometheus_unscraped_ms_per_interval']:+.2f} ms/interval; nothing is rendered until a scrape asks."
        ),
    ]
    return lines


def render_scrape(result: dict[str, Any]) -> list[str]:
    sc, v = result["scrape"], result["verdicts"]
    lines = [
        "",
        (
            f"### Scrape CPU per series ({result['settings']['scrapes']} scrapes back to back, server process CPU "
            f"less idle; clock: {sc['ours']['clock']})"
        ),
        "",
        "| endpoint | series | µs CPU/scrape | µs/series | x node_exporter |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in sc["rows"]:
        ratio = f"{r['ratio_vs_node_exporter']:.2f}" if r["ratio_vs_node_exporter"] is not None else "-"
        lines.append(
            f"| {r['label']} | {r['series']} | {r['us_per_scrape']:.0f} | {r['us_per_series']:.2f} | {ratio} |"
        )
    lines.append(
        f"| previous design, from issue 11: otel_forge (a collect per scrape) | | "
        f"| {PREVIOUS['scrape_us_per_series']:g} | {PREVIOUS['scrape_ratio_vs_node_exporter']:g} |"
    )
    lines.append(
        f"| previous design, from issue 11: node_exporter | | | {PREVIOUS['node_exporter_us_per_series']:g} | |"
    )
    scrape_ratio = f"{v['scrape_ratio']:.2f}" if v["scrape_ratio"] is not None else "n/a"
    lines += [
        "",
        (
            f"Goal: otel_forge text (cached) <= {GOALS['scrape_ratio']:g}x node_exporter per series: "
            f"{scrape_ratio}, {met(v['scrape_ratio_met'])}."
        ),
    ]
    return lines


def render_notes(result: dict[str, Any]) -> list[str]:
    sc, m = result["scrape"], result["machine"]
    fresh = sc["fresh"]
    notes = [
        (
            "Scrapers use Prometheus's Accept (OpenMetrics preferred) and gzip; sink 2 and 3 only count "
            "(the real MLflow exporter's conversion and REST calls are not included)."
        ),
        (
            f"Our scrape agent: `{sc['ours']['command']}`; OpenMetrics body has "
            f"{sc['openmetrics_sample_lines']} sample "
            f"lines (text: {sc['ours']['text']['sample_lines']}); a collect during the scrapes: "
            f"{'YES, figures include it' if sc['ours']['collect_during_scrapes'] else 'no'}."
        ),
        (
            f"In-process rounds ({fresh['rounds']}): SDK collect {fresh['collect_us']:.0f} µs, its first "
            f"text body (translation + encoding) {fresh['render_text_us']:.0f} µs "
            f"({fresh['encodings_per_round']:.2f} encodings/round)."
        ),
        (
            f"Load average at start {m['loadavg_start'][0]:.2f}, at end {m['loadavg_end'][0]:.2f} "
            f"on {m['logical_cpus']} CPUs: other work on the machine shows up as noise."
        ),
    ]
    node = sc["node_exporter"]
    if node is None:
        notes.append(f"{NODE_EXPORTER} absent: no node_exporter row, no ratio.")
    else:
        notes.append(
            f"Series: ours {sc['ours']['text']['sample_lines']}, node_exporter "
            f"{node['text']['sample_lines']}: a per-request cost (connection, HTTP parsing) is divided by "
            "fewer series on ours."
        )
        if node["log_problems"]:
            notes.append(
                f"node_exporter (its default collectors) logged {node['log_problems']} warning/error lines, "
                f"{node['log_example_count']} of them `{node['log_example'][:300]}`."
            )
    notes += agent_row_notes(result["agent"])
    if sc["ours"]["stderr"]:
        notes.append(f"our scrape agent's stderr: `{sc['ours']['stderr'].splitlines()[-1]}`.")
    if result["log_warnings"]:
        notes.append(
            f"{len(result['log_warnings'])} warnings logged in the bench process, first: `{result['log_warnings'][0]}`."
        )
    return ["", "Notes:", *[f"- {note}" for note in notes]]


def agent_row_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Anything odd in part 1's configurations: absent collectors, errors, lost or skipped exports."""
    notes = []
    for r in rows:
        if r["absent_collectors"]:
            notes.append(f"{r['key']}: absent collectors {r['absent_collectors']}.")
        if r["errors"] or r["problems"]:
            notes.append(f"{r['key']}: {r['errors']} scrape errors, e.g. {r['problems'][:1]}.")
        if any(r["skipped"].values()):
            notes.append(f"{r['key']}: collects skipped by threaded sinks {r['skipped']}.")
        if r["otlp_failed"] or r["otlp_posts_received"] != r["otlp_ok"] + r["otlp_failed"]:
            notes.append(
                f"{r['key']}: OTLP exports {r['otlp_ok']} OK, {r['otlp_failed']} failed; the receiver got "
                f"{r['otlp_posts_received']} POSTs."
            )
        # sink 2 is inline (gets every collect), sink 3 threaded (gets those not replaced while waiting)
        expected = [r["fan_out_exports"], r["fan_out_exports"] - r["skipped_total"].get("CountingExporter", 0)]
        if r["sink_exports"] != expected[: len(r["sink_exports"])]:
            notes.append(
                f"{r['key']}: counting sinks got {r['sink_exports']} of {r['fan_out_exports']} collects "
                f"(skipped: {r['skipped_total']})."
            )
    return notes


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    head = [
        f"`{result['command']}`",
        "",
        (
            f"{m['logical_cpus']} logical CPUs, {m['platform']}, Python {m['python']}, opentelemetry-sdk "
            f"{m['opentelemetry_sdk']}, opentelemetry-exporter-prometheus {m['opentelemetry_exporter_prometheus']}, "
            f"prometheus_client {m['prometheus_client']}, psutil {m['psutil']}."
        ),
        "",
    ]
    return "\n".join(head + render_agent(result) + render_scrape(result) + render_notes(result))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds", type=float, default=10.0, help="seconds measured per configuration and round (default 10)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every configuration, in turn (default 5)")
    parser.add_argument("--interval", type=float, default=0.5, help="the agent's sampling interval, s (default 0.5)")
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes per endpoint in part 2 (default 200)")
    parser.add_argument(
        "--scrape-period",
        type=float,
        default=None,
        help="scrapers' period in part 1, s (default 1.5 x --interval: 15 s scrapes / 10 s sampling)",
    )
    parser.add_argument(
        "--stress-period",
        type=float,
        default=0.1,
        help="period of the 2-scraper stress row, s (default 0.1; 0: no stress row)",
    )
    parser.add_argument(
        "--agent-interval",
        type=float,
        default=60.0,
        help="interval of the agent scraped in part 2, s (default 60: no collect while scraped)",
    )
    parser.add_argument(
        "--fresh-rounds",
        type=int,
        default=50,
        help="in-process collect + encode rounds for the derived rows (default 50)",
    )
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=5.0,
        help="an unreported Prometheus + 3 sinks + 1 scraper run first, s (default 5; 0: none)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + shlex.join(["-m", "bench.collect_once", *(sys.argv[1:] if argv is None else argv)])
    info = machine()
    capture = LogCapture()
    logging.getLogger().addHandler(capture)
    with tempfile.TemporaryDirectory(prefix="collect_once-") as workdir, SdkCollects().installed() as sdk:
        processes = Processes(Path(workdir))
        try:
            agent_rows = agent_part(args, processes, sdk)
            scrapes = scrape_part(args, processes)
        finally:
            processes.stop_all()
            logging.getLogger().removeHandler(capture)
    result = summarize(agent_rows, scrapes, args, command, info, capture.lines)
    print(json.dumps(result, indent=2) if args.json else render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
