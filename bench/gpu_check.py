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
states 14; GPM adds 2), and the MIG instances found.

GPM (Hopper and newer): for each GPU (and MIG instance) the raw NVML sequence the collector uses,
shown on its own: ``nvmlGpmQueryDeviceSupport``, two samples ``--gpm-interval`` apart, ONE
``nvmlGpmMetricsGet``, and each metric's value and status, or the reason GPM is not there (that
is not a failure: GPM is Hopper's); then the collector's own GPM line and values, which must be
fractions in [0, 1] and rates >= 0.

It exits 1 listing every field the collector claims that is missing or unsupported on a GPU and
every failed check, 2 when the collector cannot open at all, 0 otherwise.
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
    parser.add_argument("--gpm-interval", type=float, default=0.5, help="seconds between the two GPM samples")
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
        problems += _check_gpm(collector, args.gpm_interval)
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
        if field == "gpm":
            continue  # a pair of samples, not one read: _check_gpm
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


# The GPM metrics the collector asks for (pynvml constant -> what it becomes), as the raw check shows them.
_GPM_METRICS = (
    ("NVML_GPM_METRIC_SM_UTIL", "sm activity %"),
    ("NVML_GPM_METRIC_SM_OCCUPANCY", "sm occupancy %"),
    ("NVML_GPM_METRIC_ANY_TENSOR_UTIL", "tensor %"),
    ("NVML_GPM_METRIC_FP64_UTIL", "fp64 %"),
    ("NVML_GPM_METRIC_FP32_UTIL", "fp32 %"),
    ("NVML_GPM_METRIC_FP16_UTIL", "fp16 %"),
    ("NVML_GPM_METRIC_DRAM_BW_UTIL", "dram bandwidth %"),
    ("NVML_GPM_METRIC_PCIE_TX_PER_SEC", "pcie tx MiB/s"),
    ("NVML_GPM_METRIC_PCIE_RX_PER_SEC", "pcie rx MiB/s"),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", "nvlink tx MiB/s"),
    ("NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", "nvlink rx MiB/s"),
)


def _check_gpm(collector: NvidiaCollector, interval_s: float) -> list[str]:
    """GPM as NVML answers it, raw, per device; then the collector's GPM line and values."""
    import pynvml

    print("\nGPM (raw NVML: support query, two samples, one nvmlGpmMetricsGet)")
    if not hasattr(pynvml, "nvmlGpmMetricsGet"):
        print("  nvidia-ml-py has no GPM: upgrade it (nvidia-ml-py >= 12.535)")
        return []
    problems = []
    support: dict[int, Any] = {}
    for gpu in collector.gpus:
        if gpu.lost:
            continue
        whole = gpu.parent or gpu
        if whole.index not in support:
            try:
                support[whole.index] = bool(pynvml.nvmlGpmQueryDeviceSupport(whole.handle).isSupportedDevice)
            except pynvml.NVMLError as error:
                support[whole.index] = f"{type(error).__name__}: {error}"
        supported = support[whole.index]
        if supported is not True:
            print(f"  gpu {gpu.key}: not supported ({'isSupportedDevice 0' if supported is False else supported})")
            continue
        problems += _gpm_pair(pynvml, gpu, interval_s)
    return problems + _gpm_through_the_collector(collector, interval_s)


def _gpm_pair(pynvml: Any, gpu: Any, interval_s: float) -> list[str]:
    samples: list[Any] = []
    try:
        samples = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
        for sample in samples:
            if gpu.parent is None:
                pynvml.nvmlGpmSampleGet(gpu.handle, sample)
            else:
                pynvml.nvmlGpmMigSampleGet(gpu.parent.handle, gpu.instance, sample)
            if sample is samples[0]:
                time.sleep(interval_s)
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.sample1, request.sample2 = samples
        known = [(name, label) for name, label in _GPM_METRICS if hasattr(pynvml, name)]
        request.numMetrics = len(known)
        for position, (name, _) in enumerate(known):
            request.metrics[position].metricId = getattr(pynvml, name)
        started = time.perf_counter()
        pynvml.nvmlGpmMetricsGet(request)
        took_ms = (time.perf_counter() - started) * 1000
    except pynvml.NVMLError as error:
        print(f"  gpu {gpu.key}: GPM FAILED: {type(error).__name__}: {error}")
        return [f"gpu {gpu.key}: GPM: {type(error).__name__}: {error}"]
    finally:
        for sample in samples:
            pynvml.nvmlGpmSampleFree(sample)
    shown = []
    for position, (_, label) in enumerate(known):
        metric = request.metrics[position]
        ok = metric.nvmlReturn == pynvml.NVML_SUCCESS
        shown.append(f"{label}={metric.value:.4g}" if ok else f"{label}=({pynvml.nvmlErrorString(metric.nvmlReturn)})")
    print(f"  gpu {gpu.key}: metrics get {took_ms:.3f} ms over {interval_s:g} s: {'  '.join(shown)}")
    return []


def _gpm_through_the_collector(collector: NvidiaCollector, interval_s: float) -> list[str]:
    """The collector's GPM line; two reads ``interval_s`` apart: its values (fractions in [0, 1], rates >= 0)."""
    print(f"  collector: {collector.describe()[-1]}")
    collector.read(Readings())
    time.sleep(interval_s)
    readings = Readings()
    collector.read(readings)
    problems = []
    gpm = ("otel_forge.gpu.sm.activity", "otel_forge.gpu.sm.occupancy", "otel_forge.gpu.pipe.activity")
    for metric in (*gpm, "otel_forge.gpu.dram.activity", "otel_forge.gpu.io.rate"):
        for attributes, value in readings.get(metric):
            extra = ",".join(
                v
                for k, v in attributes.items()
                if k in ("otel_forge.gpu.pipe", "otel_forge.gpu.link", "network.io.direction")
            )
            print(f"  gpu {attributes['hw.id']}: {metric}{'{' + extra + '}' if extra else ''} = {_format(value)}")
            fraction = metric != "otel_forge.gpu.io.rate"
            if (fraction and not 0 <= value <= 1) or value < 0:
                problems.append(
                    f"gpu {attributes['hw.id']}: {metric} = {value} (want {'[0, 1]' if fraction else '>= 0'})"
                )
    return problems


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
            if grown and function.startswith(("nvmlDevice", "nvmlGpm")):
                by_function[function] = by_function.get(function, 0) + grown
    else:
        resolve = pynvml._nvmlGetFunctionPointer  # the one door to every C call

        def counting(name: str) -> Any:
            if name.startswith(("nvmlDevice", "nvmlGpm")):
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
    print(
        f"\nNVML calls in one full read: {per_gpu:g} per GPU (README: 14 for a whole GPU, 16 with GPM); {by_function}"
    )
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
