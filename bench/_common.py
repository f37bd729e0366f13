"""What the benches share: percentiles and waiting. The real servers they start are the tests' own
(``testkit``: ``mlflow_server``, ``proxy``, ``servers``, ``hermetic``, ``gpu_fakes``); run a bench from
the repository root as a module (``python -m bench.fleet``), and both import as they do in the tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

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
