"""What the benches share: percentiles, waiting and a process tree's CPU. The real servers they start are the tests' own
(``testkit``: ``mlflow_server``, ``proxy``, ``servers``, ``hermetic``, ``gpu_fakes``); run a bench from
the repository root as a module (``python -m bench.fleet``), and both import as they do in the tests.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil

from testkit.mlflow_server import MlflowServer

REPO_ROOT = Path(__file__).resolve().parent.parent


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks, as numpy's default."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def tree_cpu_s(root_pid: int | None) -> float:
    """User + system seconds of a process and its descendants, each with its reaped children."""
    if root_pid is None:
        return 0.0
    try:
        root = psutil.Process(root_pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for process in processes:
        try:
            t = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@contextlib.contextmanager
def private_server() -> Iterator[tuple[Path, MlflowServer]]:
    """A temporary directory and a running ``mlflow server`` of its own in ``server/`` under it (sqlite,
    127.0.0.1, one worker); both gone on the way out."""
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        (tmp / "server").mkdir()
        with MlflowServer(tmp / "server") as server:
            yield tmp, server
