"""Where the node agent's memory goes: ``otel-forge monitor`` by the sinks that are on, beside Debian's
``prometheus-node-exporter``.

Run:  python -m bench.agent_memory [--seconds 8] [--json]   (~1 min)

Each configuration runs ``otel-forge monitor`` (collectors cpu, memory, disk, network, process; a 1 s
interval; OTEL_* and MLFLOW_* variables removed) twice, each a child Python of its own that runs the
CLI's ``main`` (on its main thread) and, after ``--seconds``, reads itself from a timer thread and exits:

- plain: RSS and USS (psutil: the memory only it holds), and the modules imported (``sys.modules``);
- traced (``-X tracemalloc=30``, its own run: tracing costs memory of its own): the Python heap still
  allocated, by package: the innermost frame of each allocation's traceback that is a package's own
  file (a module's code and objects go to the package whose import made them).

Configurations: Prometheus only; OTLP only (``http/protobuf`` to a port nothing listens on: the
exporter retries, its imports are what count); both. node_exporter's RSS and USS are read after
``--seconds`` too, where it is installed (skipped with a note otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import psutil

from bench._common import REPO_ROOT
from testkit.hermetic import hermetic_environ
from testkit.servers import free_port

NODE_EXPORTER = "/usr/bin/prometheus-node-exporter"
MB = 1024 * 1024
COLLECTORS = "cpu,memory,disk,network,process"
CONFIGURATIONS = {
    "Prometheus": ["--prometheus-port", "0"],
    "OTLP": ["--no-prometheus", "--otlp-endpoint", "http://127.0.0.1:{port}", "--otlp-protocol", "http/protobuf"],
    "Prometheus + OTLP": [
        "--prometheus-port", "0", "--otlp-endpoint", "http://127.0.0.1:{port}", "--otlp-protocol", "http/protobuf",
    ],
}  # fmt: skip

CHILD = r"""
import json, os, sys, threading, time, tracemalloc
import psutil
from otel_forge.cli import main

seconds, argv = float(sys.argv[1]), sys.argv[2:]

def package_of(frames):
    # The innermost frame in a package's own file: site-packages/<package>/..., or otel_forge's
    for frame in reversed(frames):  # (oldest first)
        path = frame.filename
        if "site-packages/" in path:
            return path.split("site-packages/", 1)[1].split("/")[0].removesuffix(".py")
        if "/otel_forge/" in path:
            return "otel_forge"
    return "the standard library"

def report():
    result = {"modules": len(sys.modules)}
    if tracemalloc.is_tracing():
        by_package = {}
        for stat in tracemalloc.take_snapshot().statistics("traceback"):
            package = package_of(stat.traceback)
            by_package[package] = by_package.get(package, 0) + stat.size
        result["heap"] = dict(sorted(by_package.items(), key=lambda item: -item[1]))
    else:
        info = psutil.Process().memory_full_info()
        result.update(rss=info.rss, uss=info.uss)
    print(json.dumps(result), flush=True)
    os._exit(0)

threading.Timer(seconds, report).start()
main(["monitor", *argv])  # on the main thread, as the CLI runs it (its signal handlers)
"""


def agent(argv: list[str], seconds: float, traced: bool) -> dict[str, Any]:
    env = hermetic_environ(prefixes=("OTEL_", "MLFLOW_"), PYTHONPATH=str(REPO_ROOT))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    python = [sys.executable, *(["-X", "tracemalloc=30"] if traced else [])]
    done = subprocess.run(
        [*python, "-c", CHILD, str(seconds), "--interval", "1", "--collectors", COLLECTORS, *argv],
        env=env, capture_output=True, text=True, timeout=seconds + 120, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"monitor {argv} gave no report: {done.stderr[-2000:]}")
    return dict(json.loads(lines[-1]))


def node_exporter(seconds: float) -> dict[str, Any] | None:
    if not os.path.exists(NODE_EXPORTER):
        return None
    process = subprocess.Popen(
        [NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{free_port()}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        time.sleep(seconds)
        info = psutil.Process(process.pid).memory_full_info()
        return {"rss": info.rss, "uss": info.uss}
    finally:
        process.terminate()
        process.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="how long each agent runs before it is read")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    port = free_port()  # nothing listens there: the OTLP exporter's imports and retries are what count
    results = {}
    for name, args in CONFIGURATIONS.items():
        filled = [arg.format(port=port) for arg in args]
        results[name] = {**agent(filled, options.seconds, False), "heap": agent(filled, options.seconds, True)["heap"]}
    reference = node_exporter(options.seconds)
    if options.json:
        print(json.dumps({"agents": results, "node_exporter": reference}, indent=2))
        return 0
    print(f"`python -m bench.agent_memory --seconds {options.seconds:g}`\n")
    print("| agent | RSS MB | USS MB | modules | Python heap MB (tracemalloc) | the largest parts of it (MB) |")
    print("|---|---:|---:|---:|---:|---|")
    for name, result in results.items():
        heap = result["heap"]
        largest = ", ".join(f"{package} {size / MB:.1f}" for package, size in list(heap.items())[:5])
        print(
            f"| `otel-forge monitor`, {name} | {result['rss'] / MB:.1f} | {result['uss'] / MB:.1f} | "
            f"{result['modules']} | {sum(heap.values()) / MB:.1f} | {largest} |"
        )
    if reference is None:
        print(f"\n{NODE_EXPORTER} is not installed: no reference row.")
    else:
        print(f"| prometheus-node-exporter | {reference['rss'] / MB:.1f} | {reference['uss'] / MB:.1f} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
