"""What the benches share: percentiles, waiting, and the test suite's helpers.

The benches start the same real servers as the tests (``mlflow_server``, ``proxy``, ``servers``,
``hermetic``, ``gpu_fakes``): importing this module puts tests/ on ``sys.path`` (as pytest's
``pythonpath`` does for the tests), so a bench imports them as the tests do.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


TESTS = str(REPO_ROOT / "tests")
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


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
