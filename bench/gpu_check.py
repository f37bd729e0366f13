"""Check the NVIDIA collector on a real GPU machine: every field on every GPU, its values, its cost.

Run:  python -m bench.gpu_check [--reads 20]          (real pynvml; well under 2 minutes on 8 GPUs)
      PYTHONPATH=tests/fakes python -m bench.gpu_check  (the fake pynvml, to check the script itself)

For each selected GPU (``OTEL_FORGE_GPUS`` applies) and each field the collector reads, it prints
the values of the last read and the median latency of ``--reads`` reads of that field alone; then
the time of the collector's full pass (all GPUs, all fields) and sanity checks: utilization and
memory activity in [0, 1], memory used <= size, power > 0, energy not decreasing over 1 s, a
plausible temperature, hw.status ok, XID events registered. The fields of the one
``nvmlDeviceGetFieldValues`` batch (energy, ECC, memory temperature, NVLink traffic and errors, PCIe
replays, row remapping, retired pages, violation time) are listed one by one with NVML's answer for
each: a board may answer NotSupported for some (retired pages on Ampere and later, which remap rows
instead; NVLink on a PCIe-only board). Then the NVML calls of one full read per GPU (the README
states 14), and the MIG instances found. It exits 1 listing every field the collector claims that
is missing or unsupported on a GPU and every failed check, 2 when the collector cannot open at all,
0 otherwise.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

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
        whole_gpus = [gpu for gpu in collector.gpus if gpu.parent is None]
        for gpu in whole_gpus:
            problems += _check_fields(collector, gpu, args.reads)
        _print_mig(collector)
        problems += _check_full_pass(collector)
        problems += _check_energy(collector)
        unwatched = [gpu.index for gpu in whole_gpus if gpu.index not in collector.xid_watched]
        problems += [f"gpu {index}: XID events not registered" for index in unwatched]
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
        result, latencies_ms, error = _sample(collector, gpu.index, field, reads)
        if error is not None:
            print(f"  {field:<15} {'-':>9}  MISSING: {error}")
            problems.append(f"gpu {gpu.index}: {field}: {error}")
            continue
        print(f"  {field:<15} {statistics.median(latencies_ms):>9.3f}  {_show(_rows(result))}")
        for name, rows in _by_field(field, result).items():
            if isinstance(rows, Exception):
                print(f"    {name:<17} NOT ANSWERED: {type(rows).__name__}: {rows}")
                problems.append(f"gpu {gpu.index}: {name}: {type(rows).__name__}: {rows}")
            elif field != name:
                print(f"    {name:<17} {_show(rows)}")
            if not isinstance(rows, Exception) and (not rows or any(value is None for _, value, _ in rows)):
                problems.append(f"gpu {gpu.index}: {name}: no value")
    return problems


def _rows(result: Any) -> list:
    """A field's rows; a batch's rows, all fields together."""
    return result if isinstance(result, list) else [row for rows in result.rows.values() for row in rows]


def _by_field(field: str, result: Any) -> dict[str, Any]:
    """Each field of a reader's result -> its rows, or the error NVML answered for it."""
    if isinstance(result, list):
        return {field: result}
    return {**result.rows, **result.errors}


def _print_mig(collector: NvidiaCollector) -> None:
    instances = [gpu for gpu in collector.gpus if gpu.parent is not None]
    print(f"\nMIG instances: {len(instances) or 'none'}")
    for gpu in instances:
        print(f"  {gpu.key}: {gpu.name} {gpu.uuid} (GPU instance {gpu.instance} of gpu {gpu.index})")


def _nvml_calls_per_gpu(collector: NvidiaCollector) -> tuple[float, dict[str, int]]:
    """NVML calls of one full read: (calls per whole GPU, calls by function).

    The real pynvml resolves the C function on every call (``_nvmlGetFunctionPointer``): counting
    those counts the library calls themselves, whoever holds a reference to the Python wrapper.
    The fake counts its own calls (``call_counts``).
    """
    import pynvml

    gpus = max(1, sum(1 for gpu in collector.gpus if gpu.parent is None))
    by_function: dict[str, int] = {}
    if hasattr(pynvml, "call_counts"):  # the fake
        before = pynvml.call_counts()
        collector.read(Readings())
        for (function, _), count in pynvml.call_counts().items():
            grown = count - before.get((function, _), 0)
            if grown and function.startswith("nvmlDevice"):
                by_function[function] = by_function.get(function, 0) + grown
    else:
        resolve = pynvml._nvmlGetFunctionPointer  # the one door to every C call

        def counting(name: str) -> Any:
            if name.startswith("nvmlDevice"):
                by_function[name] = by_function.get(name, 0) + 1
            return resolve(name)

        pynvml._nvmlGetFunctionPointer = counting
        try:
            collector.read(Readings())
        finally:
            pynvml._nvmlGetFunctionPointer = resolve
    return sum(by_function.values()) / gpus, by_function


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
    per_gpu, by_function = _nvml_calls_per_gpu(collector)
    print(f"\nNVML calls in one full read: {per_gpu:g} per GPU (README: 14 for a whole GPU); {by_function}")
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
        ("otel_forge.gpu.violation.time", {}, lambda v: v >= 0, ">= 0 s"),
        ("otel_forge.gpu.memory.remap.failed", {}, lambda v: v in (0, 1), "0 or 1"),
        ("otel_forge.gpu.memory.remap.pending", {}, lambda v: v in (0, 1), "0 or 1"),
        ("hw.gpu.io", {}, lambda v: v >= 0, ">= 0 B"),
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

    def energy() -> dict[str, float]:
        readings = Readings()
        collector.read(readings)
        return {attributes["hw.id"]: value for attributes, value in readings.get("hw.energy")}

    first = energy()
    time.sleep(1.0)
    second = energy()
    for index, joules in first.items():
        if index not in second:
            continue
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
