"""Check the NVIDIA collector on a real GPU machine: every field on every GPU, its values, its cost.

Run:  python bench/gpu_check.py [--reads 20]          (real pynvml; well under 2 minutes on 8 GPUs)
      PYTHONPATH=tests/fakes python bench/gpu_check.py  (the fake pynvml, to check the script itself)

For each selected GPU (``OTEL_FORGE_GPUS`` applies) and each field the collector reads, it prints
the values of the last read and the median latency of ``--reads`` reads of that field alone; then
the time of the collector's full pass (all GPUs, all fields) and sanity checks: utilization and
memory activity in [0, 1], memory used <= size, power > 0, energy not decreasing over 1 s, a
plausible temperature, hw.status ok, XID events registered. It exits 1 listing every field the
collector claims that is missing or unsupported on a GPU and every failed check, 2 when the
collector cannot open at all, 0 otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, uninstalled

from otel_forge.collectors.base import CollectorUnavailable, Readings
from otel_forge.collectors.nvidia import NvidiaCollector
from otel_forge.config import ForgeConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=20, help="reads per field for the latency median")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        collector = NvidiaCollector.create(ForgeConfig.resolve())
    except CollectorUnavailable as error:
        print(f"NVIDIA collector unavailable: {error}")
        return 2
    problems: list[str] = []
    try:
        _print_library()
        for gpu in collector.gpus:
            problems += _check_fields(collector, gpu, args.reads)
        problems += _check_full_pass(collector)
        problems += _check_energy(collector)
        problems += [
            f"gpu {gpu.index}: XID events not registered"
            for gpu in collector.gpus
            if gpu.index not in collector.xid_watched
        ]
    finally:
        collector.close()
    print(f"\ntotal {time.monotonic() - started:.1f} s")
    if problems:
        print(f"\nFAILED ({len(problems)}):")
        for problem in problems:
            print(f"  - {problem}")
        return 1
    print("\nOK: every field present on every GPU, every check passed")
    return 0


def _print_library() -> None:
    import pynvml

    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as error:
        driver = f"? ({error})"
    print(f"pynvml: {pynvml.__file__}\ndriver: {driver}")


def _check_fields(collector: NvidiaCollector, gpu: Any, reads: int) -> list[str]:
    print(f"\ngpu {gpu.index}: {gpu.name} {gpu.uuid} {gpu.pci_bus_id}")
    print(f"  {'field':<15} {'median ms':>9}  values (last read)")
    problems = []
    for field in collector.FIELDS:
        rows, latencies_ms, error = _sample(collector, gpu.index, field, reads)
        if error is not None:
            print(f"  {field:<15} {'-':>9}  MISSING: {error}")
            problems.append(f"gpu {gpu.index}: {field}: {error}")
            continue
        shown = _show(rows)
        print(f"  {field:<15} {statistics.median(latencies_ms):>9.3f}  {shown}")
        if not rows or any(value is None for _, value, _ in rows):
            problems.append(f"gpu {gpu.index}: {field}: no value")
    return problems


def _sample(collector: NvidiaCollector, index: int, field: str, reads: int) -> tuple[list, list[float], str | None]:
    rows: list = []
    latencies_ms = []
    for _ in range(max(1, reads)):
        started = time.perf_counter()
        try:
            rows = collector.sample_field(index, field)
        except Exception as error:  # noqa: BLE001 - reported, that is the point
            return [], [], f"{type(error).__name__}: {error}"
        latencies_ms.append((time.perf_counter() - started) * 1000)
    return rows, latencies_ms, None


def _check_full_pass(collector: NvidiaCollector) -> list[str]:
    times_ms = []
    for _ in range(5):
        readings = Readings()
        started = time.perf_counter()
        collector.read(readings)
        times_ms.append((time.perf_counter() - started) * 1000)
    values = sum(len(readings.get(metric)) for metric in readings.metrics())
    print(
        f"\nfull pass ({len(collector.gpus)} GPUs, {values} values): median {statistics.median(times_ms):.1f} ms,"
        f" max {max(times_ms):.1f} ms over {len(times_ms)} reads"
    )
    return _sanity(readings)


def _sanity(readings: Readings) -> list[str]:
    def per_gpu(metric: str, **attributes: str) -> dict[str, float]:
        return {a["hw.id"]: v for a, v in readings.get(metric) if all(a.get(k) == w for k, w in attributes.items())}

    problems = []
    checks = [
        ("hw.gpu.utilization", {}, lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("otel_forge.gpu.memory.activity", {}, lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("hw.gpu.memory.utilization", {}, lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("hw.power", {}, lambda v: v > 0, "> 0 W"),
        ("otel_forge.gpu.power.limit", {}, lambda v: v > 0, "> 0 W"),
        ("hw.temperature", {}, lambda v: 0 < v < 120, "in (0, 120) C"),
        ("otel_forge.gpu.clock.frequency", {"otel_forge.gpu.clock": "sm"}, lambda v: v > 0, "> 0 Hz"),
        ("hw.status", {"hw.state": "ok"}, lambda v: v == 1, "== 1"),
    ]
    for metric, attributes, passes, wanted in checks:
        for gpu, value in per_gpu(metric, **attributes).items():
            if not passes(value):
                problems.append(f"gpu {gpu}: {metric} = {value} (want {wanted})")
    used, size = per_gpu("hw.gpu.memory.usage"), per_gpu("hw.gpu.memory.limit")
    problems += [
        f"gpu {gpu}: memory used {used[gpu]} > size {size[gpu]}"
        for gpu in used
        if gpu in size and used[gpu] > size[gpu]
    ]
    return problems


def _check_energy(collector: NvidiaCollector) -> list[str]:
    problems = []
    try:
        first = {gpu.index: collector.sample_field(gpu.index, "energy")[0][1] for gpu in collector.gpus}
        time.sleep(1.0)
        second = {gpu.index: collector.sample_field(gpu.index, "energy")[0][1] for gpu in collector.gpus}
    except Exception as error:  # noqa: BLE001 - already listed per field
        return [f"energy: {type(error).__name__}: {error}"]
    for index, joules in first.items():
        print(
            f"gpu {index}: energy {joules:.3f} J -> {second[index]:.3f} J over 1 s"
            f" (~{second[index] - joules:.1f} W average)"
        )
        if second[index] < joules:
            problems.append(f"gpu {index}: energy went down ({joules} J -> {second[index]} J)")
    return problems


def _show(rows: list) -> str:
    """``metric=value``, or ``metric{attribute value=value ...}`` for rows told apart by an attribute."""
    shown: dict[str, list[str]] = {}
    for metric, value, extra in rows:
        label = ",".join(extra.values())
        shown.setdefault(metric, []).append(f"{label}={_format(value)}" if label else _format(value))
    return "  ".join(
        f"{metric}={parts[0]}" if "=" not in parts[0] else f"{metric}{{{' '.join(parts)}}}"
        for metric, parts in shown.items()
    )


def _format(value: float | None) -> str:
    if value is None:
        return "None"
    return f"{value:.4g}" if isinstance(value, float) and not value.is_integer() else f"{value:.0f}"


if __name__ == "__main__":
    sys.exit(main())
