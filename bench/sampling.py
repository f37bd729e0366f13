"""CPU cost of one hardware sample: otel_forge vs MLflow's monitors vs OTel system-metrics vs raw psutil.

Run:  python -m bench.sampling [--seconds 40] [--json] [--profile SUBJECT]

What one "sample" is, per subject (CPU time of the calling thread, ``time.thread_time``: sleeping and
other threads never count; every reader below collects synchronously in the calling thread):

- ``ours-1`` / ``ours-3``: otel_forge's cpu, memory, disk, network and process collectors registered
  through ``otel_forge.instrument(provider, collectors=..., max_age_s=10)`` on an SDK
  ``MeterProvider`` with 1 or 3 ``InMemoryMetricReader``. One sample = one sampling interval: the
  hardware is read once and every reader collects once. That is modelled with a fake clock: the
  ``CachedCollector`` objects that ``instrument`` built get their clock (the constructor's own
  ``clock`` seam) replaced by a counter that the bench advances by one interval (10 s, larger than
  ``max_age_s``) before each sample, then the readers collect back to back at that same instant.
  So the first reader's callbacks re-read the hardware and the other readers are served from the
  snapshot, exactly as in production where the readers fire within ``max_age`` of each other; no
  sleeping, no private invalidation. The bench checks it: the "psutil calls" column is counted in
  a separate pass with psutil's functions wrapped, and the hardware reads per sample of every
  collector (``CachedCollector.stats.reads``) must come out at exactly 1, or the bench fails.
  The CPU and process collectors compute rates from real ``time.monotonic`` deltas as usual.
- ``ours-read``: the same five collectors' ``read()`` into a ``Readings``, no OTel at all: the share
  of ``ours-1`` spent on the hardware, the rest is callbacks + SDK aggregation.
- ``mlflow``: MLflow's ``CPUMonitor``, ``DiskMonitor`` and ``NetworkMonitor``: one sample =
  ``collect_metrics()`` on each (what its monitor thread does every interval). ``mlflow+agg``
  also runs ``aggregate_metrics()`` and ``clear_metrics()`` (its per-step cost with
  samples_before_logging=1). The REST calls MLflow's monitor makes each sample are NOT included.
- ``otel-sm-1`` / ``otel-sm-3``: ``opentelemetry-instrumentation-system-metrics``'s
  ``SystemMetricsInstrumentor(config=...)`` on its own provider with 3 ``InMemoryMetricReader``;
  one sample = collecting 1 reader, or all 3. (The instrumentor is a singleton, so both rows share
  one provider; the SDK feeds an asynchronous instrument's measurements only to the reader that
  collects, so collecting one of three readers costs what a 1-reader provider costs.) Config:
  the metrics comparable to ours (cpu utilization by mode, memory and swap usage/utilization, disk
  io/operations, network io/packets/errors/drops, process cpu/memory/threads/fds). It has no
  filesystem usage and no load average; its cpu utilization is per logical CPU; it does not
  filter loop/virtual devices.
- ``floor``: the raw psutil reads of the same sources ours reads, nothing else: cpu_times(percpu),
  getloadavg, virtual_memory, swap_memory, disk_partitions + disk_usage of the real filesystems,
  disk_io_counters(perdisk), net_io_counters(pernic), and this process's memory_info, cpu_times,
  num_threads, num_fds under oneshot (no child-process scan).

Values per sample: data points of one reader's collect for OTel subjects (for 3 readers the same
values are exported 3 times; the column counts them once), metric keys for MLflow, readings for
``ours-read``; ``floor`` borrows ``ours-1``'s count (same sources). ``ours`` includes otel_forge's
self-telemetry (``otel_forge.collector.*``, 3 per collector).

Method: every subject is warmed up first (primes cpu_percent & co.), then the subjects run in
interleaved rounds, one block per subject per round, each block sized to ~``--block-ms`` of CPU;
a subject's result is the median of its block means (p25-p75 shown), so drift and noise from other
tenants of a shared machine hit every subject alike.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from bench._common import percentile

HOST_COLLECTORS = ("cpu", "memory", "disk", "network", "process")
INTERVAL_S = 10.0  # the fake clock's step: one sampling interval
MAX_AGE_S = 9.0  # otel_forge's default for a 10 s interval (0.9 x interval)
SELF_TELEMETRY_PREFIX = "otel_forge.collector."

OTEL_SM_CONFIG: dict[str, list[str] | None] = {
    "system.cpu.utilization": ["user", "nice", "system", "idle", "iowait", "interrupt", "steal"],
    "system.memory.usage": ["used", "free", "cached", "buffers"],
    "system.memory.utilization": ["used", "free", "cached", "buffers"],
    "system.swap.usage": ["used", "free"],
    "system.swap.utilization": ["used", "free"],
    "system.disk.io": ["read", "write"],
    "system.disk.operations": ["read", "write"],
    "system.network.io": ["transmit", "receive"],
    "system.network.packets": ["transmit", "receive"],
    "system.network.errors": ["transmit", "receive"],
    "system.network.dropped.packets": ["transmit", "receive"],
    "process.cpu.time": ["user", "system"],
    "process.cpu.utilization": None,
    "process.memory.usage": None,
    "process.memory.virtual": None,
    "process.thread.count": None,
    "process.open_file_descriptor.count": None,
}


@dataclass
class Subject:
    key: str
    label: str
    sample: Callable[[], None]
    values: int = 0
    values_note: str = ""
    after_block: Callable[[], None] | None = None  # untimed housekeeping (MLflow's growing lists)
    block: int = 1
    samples: int = 0
    block_means_us: list[float] = field(default_factory=list)
    psutil_calls: int | None = None
    hardware_reads: float | None = None

    def run_block(self) -> float:
        sample, n = self.sample, self.block
        started = time.thread_time()
        for _ in range(n):
            sample()
        spent = time.thread_time() - started
        self.samples += n
        if self.after_block is not None:
            self.after_block()
        return spent / n


class FakeClock:
    """A monotonic clock that moves only when the bench says one interval has passed."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += INTERVAL_S


def count_points(metrics_data: Any, skip_prefix: str | None = None) -> int:
    if metrics_data is None:
        return 0
    return sum(
        len(metric.data.data_points)
        for resource_metrics in metrics_data.resource_metrics
        for scope_metrics in resource_metrics.scope_metrics
        for metric in scope_metrics.metrics
        if skip_prefix is None or not metric.name.startswith(skip_prefix)
    )


# --- subjects ---------------------------------------------------------------------------------


def make_ours(readers: int, clock: FakeClock, closers: list[Callable[[], None]]) -> Subject:
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    import otel_forge
    from otel_forge.pipeline import build_meter_provider

    reader_list = [InMemoryMetricReader() for _ in range(readers)]
    provider = build_meter_provider(reader_list)  # the agent's own provider settings
    instrumentation = otel_forge.instrument(provider, collectors=list(HOST_COLLECTORS), max_age_s=MAX_AGE_S)
    if instrumentation.collectors.absent:
        raise SystemExit(f"otel_forge collectors absent: {instrumentation.collectors.absent}")
    caches = instrumentation.instruments.caches
    for cache in caches.values():
        if not hasattr(cache, "_clock"):
            raise SystemExit("otel_forge.pipeline.sampling.CachedCollector has no _clock any more: update the bench")
        cache._clock = clock
    collects = [reader.get_metrics_data for reader in reader_list]

    def sample() -> None:
        clock.tick()
        for collect in collects:
            collect()

    def close() -> None:
        instrumentation.unregister()
        provider.shutdown()

    closers.append(close)
    subject = Subject(f"ours-{readers}", f"otel_forge, {readers} reader{'s' * (readers > 1)}", sample)
    subject.caches = caches  # type: ignore[attr-defined]
    subject.reader0 = reader_list[0]  # type: ignore[attr-defined]
    return subject


def make_ours_read_only() -> Subject:
    from otel_forge.collectors import Readings, open_collectors
    from otel_forge.config import ForgeConfig

    opened = open_collectors(ForgeConfig.resolve(collectors=list(HOST_COLLECTORS)))
    collectors = opened.present

    def sample() -> None:
        for collector in collectors:
            collector.read(Readings())

    def values() -> int:
        total = 0
        for collector in collectors:
            readings = Readings()
            collector.read(readings)
            total += sum(len(readings.get(name)) for name in readings.metrics())
        return total

    subject = Subject("ours-read", "otel_forge collectors' read() only, no OTel", sample)
    subject.count_values = values  # type: ignore[attr-defined]
    return subject


def make_cgroup_read() -> Subject:
    """The cgroup collector's read() alone: the job's cgroup files (v1 here: eleven), beside ``ours-read``."""
    from otel_forge.collectors import Readings
    from otel_forge.collectors.cgroup import CgroupCollector
    from otel_forge.config import ForgeConfig

    collector = CgroupCollector.create(ForgeConfig.resolve())

    def values() -> int:
        readings = Readings()
        collector.read(readings)
        return sum(len(readings.get(name)) for name in readings.metrics())

    subject = Subject(
        "cgroup-read", "otel_forge's cgroup collector read() only (not in ours-*)", lambda: collector.read(Readings())
    )
    subject.count_values = values  # type: ignore[attr-defined]
    return subject


def make_mlflow(aggregate: bool) -> Subject:
    from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
    from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
    from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

    monitors = (CPUMonitor(), DiskMonitor(), NetworkMonitor())
    collect_fns = [m.collect_metrics for m in monitors]

    def clear() -> None:
        for monitor in monitors:
            monitor.clear_metrics()

    if aggregate:

        def sample() -> None:
            for monitor in monitors:
                monitor.collect_metrics()
            for monitor in monitors:
                monitor.aggregate_metrics()
                monitor.clear_metrics()

        label = "MLflow monitors, collect + aggregate + clear"
    else:

        def sample() -> None:
            for collect in collect_fns:
                collect()

        label = "MLflow monitors (cpu, disk, network), collect"

    def values() -> int:
        for collect in collect_fns:
            collect()
        count = sum(len(m.aggregate_metrics()) for m in monitors)
        clear()
        return count

    subject = Subject("mlflow+agg" if aggregate else "mlflow", label, sample, after_block=clear)
    subject.count_values = values  # type: ignore[attr-defined]
    return subject


def make_otel_sm(closers: list[Callable[[], None]]) -> tuple[Subject, Subject]:
    from opentelemetry.instrumentation.system_metrics import SystemMetricsInstrumentor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    readers = [InMemoryMetricReader() for _ in range(3)]
    provider = MeterProvider(metric_readers=readers)
    instrumentor = SystemMetricsInstrumentor(config=OTEL_SM_CONFIG)
    instrumentor.instrument(meter_provider=provider)
    collects = [reader.get_metrics_data for reader in readers]
    first = collects[0]

    def sample_one() -> None:
        first()

    def sample_three() -> None:
        for collect in collects:
            collect()

    def close() -> None:
        instrumentor.uninstrument()
        provider.shutdown()

    closers.append(close)
    one = Subject("otel-sm-1", "opentelemetry-instrumentation-system-metrics, 1 reader", sample_one)
    three = Subject("otel-sm-3", "opentelemetry-instrumentation-system-metrics, 3 readers", sample_three)
    one.reader0 = three.reader0 = readers[0]  # type: ignore[attr-defined]
    return one, three


def make_floor() -> Subject:
    from otel_forge.collectors.disk import is_real_filesystem

    process = psutil.Process()

    def sample() -> None:
        psutil.cpu_times(percpu=True)
        os.getloadavg()
        psutil.virtual_memory()
        psutil.swap_memory()
        for partition in psutil.disk_partitions(all=False):
            if is_real_filesystem(partition.fstype, partition.mountpoint):
                psutil.disk_usage(partition.mountpoint)
        psutil.disk_io_counters(perdisk=True, nowrap=True)
        psutil.net_io_counters(pernic=True, nowrap=True)
        with process.oneshot():
            process.memory_info()
            process.cpu_times()
            process.num_threads()
            process.num_fds()

    return Subject("floor", "floor: raw psutil reads of the same sources", sample)


# --- psutil call counting (a separate, untimed pass) -----------------------------------------

PSUTIL_FUNCTIONS = (
    "cpu_times",
    "cpu_percent",
    "cpu_times_percent",
    "cpu_count",
    "virtual_memory",
    "swap_memory",
    "disk_partitions",
    "disk_usage",
    "disk_io_counters",
    "net_io_counters",
    "pids",
)
PROCESS_METHODS = (
    "memory_info",
    "cpu_times",
    "cpu_percent",
    "num_threads",
    "num_fds",
    "children",
    "io_counters",
    "num_ctx_switches",
)


def count_psutil_calls(sample: Callable[[], None], samples: int = 5) -> float:
    """Outermost psutil calls per sample (psutil's own nested calls are not counted)."""
    state = {"depth": 0, "calls": 0}

    def wrap(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if state["depth"] == 0:
                state["calls"] += 1
            state["depth"] += 1
            try:
                return function(*args, **kwargs)
            finally:
                state["depth"] -= 1

        return counted

    saved: list[tuple[Any, str, Any]] = []
    for name in PSUTIL_FUNCTIONS:
        saved.append((psutil, name, getattr(psutil, name)))
    for name in PROCESS_METHODS:
        saved.append((psutil.Process, name, psutil.Process.__dict__[name]))
    try:
        for owner, name, original in saved:
            setattr(owner, name, wrap(original))
        for _ in range(samples):
            sample()
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    return state["calls"] / samples


# --- run --------------------------------------------------------------------------------------


def warm_up(subject: Subject, seconds: float) -> float:
    """Run the subject for ``seconds`` of wall time; return its CPU seconds per sample."""
    deadline = time.monotonic() + seconds
    n, cpu = 0, 0.0
    while time.monotonic() < deadline or n < 10:
        started = time.thread_time()
        subject.sample()
        cpu += time.thread_time() - started
        n += 1
    if subject.after_block is not None:
        subject.after_block()
    return cpu / n


def build_subjects(closers: list[Callable[[], None]]) -> list[Subject]:
    clock = FakeClock()
    ours1 = make_ours(1, clock, closers)
    ours3 = make_ours(3, clock, closers)
    sm1, sm3 = make_otel_sm(closers)
    return [
        ours1,
        ours3,
        make_ours_read_only(),
        make_cgroup_read(),
        make_mlflow(False),
        make_mlflow(True),
        sm1,
        sm3,
        make_floor(),
    ]


def measure(subjects: list[Subject], seconds: float, block_ms: float) -> None:
    for subject in subjects:
        per_sample = warm_up(subject, 0.3)
        subject.block = max(1, round(block_ms / 1000 / max(per_sample, 1e-7)))
    gc.collect()
    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline or rounds < 5:
        for subject in subjects:
            subject.block_means_us.append(subject.run_block() * 1e6)
        rounds += 1


def count_values_and_reads(subjects: list[Subject]) -> None:
    by_key = {s.key: s for s in subjects}
    for subject in subjects:
        if hasattr(subject, "reader0"):
            subject.sample()
            # One more collect of reader 0 at the same instant: the values it holds now.
            data = subject.reader0.get_metrics_data()  # type: ignore[attr-defined]
            subject.values = count_points(data)
            if subject.key.startswith("ours"):
                own = subject.values - count_points(data, SELF_TELEMETRY_PREFIX)
                subject.values_note = f"incl. {own} self-telemetry"
        elif hasattr(subject, "count_values"):
            subject.values = subject.count_values()  # type: ignore[attr-defined]
    by_key["floor"].values = by_key["ours-1"].values
    by_key["floor"].values_note = "ours-1's count"
    for subject in subjects:
        subject.psutil_calls = count_psutil_calls(subject.sample)
        if subject.after_block is not None:
            subject.after_block()
    for key in ("ours-1", "ours-3"):
        subject = by_key[key]
        caches = subject.caches  # type: ignore[attr-defined]
        before = {name: cache.stats.reads for name, cache in caches.items()}
        for _ in range(10):
            subject.sample()
        reads = {name: (caches[name].stats.reads - before[name]) / 10 for name in HOST_COLLECTORS}
        if any(value != 1 for value in reads.values()):
            raise SystemExit(f"{key}: hardware reads per sample are not 1: {reads}")
        subject.hardware_reads = 1.0


def summarize(subjects: list[Subject], command: str, seconds: float) -> dict[str, Any]:
    import mlflow.version
    import opentelemetry.sdk.version
    from opentelemetry.instrumentation.system_metrics.version import __version__ as sm_version

    rows = []
    for s in subjects:
        median = statistics.median(s.block_means_us)
        rows.append(
            {
                "key": s.key,
                "label": s.label,
                "values": s.values,
                "values_note": s.values_note,
                "us_per_sample": median,
                "p25": percentile(s.block_means_us, 0.25),
                "p75": percentile(s.block_means_us, 0.75),
                "us_per_value": median / s.values if s.values else None,
                "psutil_calls_per_sample": s.psutil_calls,
                "hardware_reads_per_sample": s.hardware_reads,
                "blocks": len(s.block_means_us),
                "samples": s.samples,
            }
        )
    r = {row["key"]: row for row in rows}
    ratios = {
        "ours1_vs_mlflow_per_value": r["ours-1"]["us_per_value"] / r["mlflow"]["us_per_value"],
        "ours1_vs_mlflow_agg_per_value": r["ours-1"]["us_per_value"] / r["mlflow+agg"]["us_per_value"],
        "ours3_vs_ours1": r["ours-3"]["us_per_sample"] / r["ours-1"]["us_per_sample"],
        "ours1_vs_floor": r["ours-1"]["us_per_sample"] / r["floor"]["us_per_sample"],
        "ours1_vs_otel_sm1_per_value": r["ours-1"]["us_per_value"] / r["otel-sm-1"]["us_per_value"],
        "ours3_vs_otel_sm3_per_value": r["ours-3"]["us_per_value"] / r["otel-sm-3"]["us_per_value"],
        "otel_sm3_vs_otel_sm1": r["otel-sm-3"]["us_per_sample"] / r["otel-sm-1"]["us_per_sample"],
        "hardware_share_of_ours1": r["ours-read"]["us_per_sample"] / r["ours-1"]["us_per_sample"],
    }
    targets = {
        "ours_per_value_at_or_below_mlflow": ratios["ours1_vs_mlflow_per_value"] <= 1.0,
        "ours_3_readers_within_1.2x_of_1": ratios["ours3_vs_ours1"] <= 1.2,
    }
    return {
        "command": command,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "logical_cpus": psutil.cpu_count(),
            "processes": len(psutil.pids()),
            "psutil": psutil.__version__,
            "opentelemetry_sdk": opentelemetry.sdk.version.__version__,
            "otel_system_metrics": sm_version,
            "mlflow": mlflow.version.VERSION,
        },
        "clock": "time.thread_time",
        "seconds": seconds,
        "rows": rows,
        "ratios": ratios,
        "targets": targets,
    }


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        f"`{result['command']}`",
        "",
        f"CPU time per sample ({result['clock']}, median of block means, p25-p75), {m['logical_cpus']} logical "
        f"CPUs, {m['processes']} processes, Python {m['python']}, psutil {m['psutil']}, "
        f"opentelemetry-sdk {m['opentelemetry_sdk']}, system-metrics {m['otel_system_metrics']}, "
        f"mlflow {m['mlflow']}.",
        "",
        "| subject | values/sample | µs CPU/sample (p25-p75) | µs CPU/value | psutil calls/sample |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in result["rows"]:
        values = f"{row['values']}" + (f" ({row['values_note']})" if row["values_note"] else "")
        per_value = f"{row['us_per_value']:.2f}" if row["us_per_value"] is not None else "-"
        calls = row["psutil_calls_per_sample"]
        calls_text = "-" if calls is None else f"{calls:g}"
        if row["hardware_reads_per_sample"] is not None:
            calls_text += " (1 read/collector)"
        lines.append(
            f"| `{row['key']}` {row['label']} | {values} | {row['us_per_sample']:.0f} "
            f"({row['p25']:.0f}-{row['p75']:.0f}) | {per_value} | {calls_text} |"
        )
    ra, ta = result["ratios"], result["targets"]
    verdict = {True: "met", False: "NOT met"}
    lines += [
        "",
        "| ratio | value | target |",
        "|---|---:|---|",
        f"| ours (1 reader) / MLflow collect, per value | {ra['ours1_vs_mlflow_per_value']:.2f} | <= 1: "
        f"{verdict[ta['ours_per_value_at_or_below_mlflow']]} |",
        f"| ours (1 reader) / MLflow collect+aggregate, per value | {ra['ours1_vs_mlflow_agg_per_value']:.2f} | |",
        f"| ours 3 readers / ours 1 reader, per sample | {ra['ours3_vs_ours1']:.2f} | <= 1.2: "
        f"{verdict[ta['ours_3_readers_within_1.2x_of_1']]} |",
        f"| ours (1 reader) / floor, per sample | {ra['ours1_vs_floor']:.2f} | |",
        f"| ours / OTel system-metrics, per value, 1 reader | {ra['ours1_vs_otel_sm1_per_value']:.2f} | |",
        f"| ours / OTel system-metrics, per value, 3 readers | {ra['ours3_vs_otel_sm3_per_value']:.2f} | |",
        f"| OTel system-metrics 3 readers / 1 reader, per sample | {ra['otel_sm3_vs_otel_sm1']:.2f} | |",
        f"| collectors' read() / ours (1 reader), per sample | {ra['hardware_share_of_ours1']:.2f} | |",
    ]
    return "\n".join(lines)


def profile(subjects: list[Subject], key: str, seconds: float) -> None:
    import cProfile
    import pstats

    subject = next((s for s in subjects if s.key == key), None)
    if subject is None:
        raise SystemExit(f"unknown subject {key!r}; one of {', '.join(s.key for s in subjects)}")
    warm_up(subject, 0.3)
    profiler = cProfile.Profile(time.thread_time)
    deadline = time.monotonic() + seconds
    profiler.enable()
    n = 0
    while time.monotonic() < deadline:
        subject.sample()
        n += 1
    profiler.disable()
    print(f"profile of {key}: {n} samples", file=sys.stderr)
    stats = pstats.Stats(profiler, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="wall seconds of measured rounds (default 40)")
    parser.add_argument("--block-ms", type=float, default=20.0, help="CPU ms per timed block (default 20)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    parser.add_argument("--profile", metavar="SUBJECT", help="cProfile one subject for --seconds instead")
    args = parser.parse_args(argv)
    command = "python " + " ".join(shlex.quote(a) for a in ["-m", "bench.sampling", *sys.argv[1:]])

    closers: list[Callable[[], None]] = []
    subjects = build_subjects(closers)
    try:
        if args.profile:
            profile(subjects, args.profile, args.seconds)
            return 0
        measure(subjects, args.seconds, args.block_ms)
        count_values_and_reads(subjects)
        result = summarize(subjects, command, args.seconds)
    finally:
        for close in closers:
            close()
    print(json.dumps(result, indent=2) if args.json else render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
