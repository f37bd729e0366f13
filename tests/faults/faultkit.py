"""Helpers of the fault-injection tests: what each export() returned, a watch on the call threads, and
the check a user would make: every window is in the run, in order, once."""

from __future__ import annotations

import threading
from typing import Any

NODE = "node_0"
PREFIX = f"system/{NODE}/"
CALL_THREAD = "mlflow-system-metrics-call"
# MLflow's client, in the test process: one attempt per request and a short timeout, so a dead or
# hung server fails fast and the exporter's own worker does the retrying.
HTTP_TIMEOUT_S = 3

WIDTH = 100  # values a log() call of the journal's fault tests' training loops


def steps_logged(lines: list[str]) -> dict[int, int]:
    """step -> values dropped so far, from a training loop's "step N DROPPED" lines."""
    return {int(parts[1]): int(parts[2]) for parts in (line.split() for line in lines) if parts[0] == "step"}


def the_run(client: Any, experiment: str, timeout_s: float = 90.0, said: str = "") -> Any:
    """The one run of ``experiment``, once it has ended; ``said``: the job's stderr, shown on a timeout."""
    from testkit.servers import wait_for

    def found() -> Any:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        return runs[0] if len(runs) == 1 and runs[0].info.status != "RUNNING" else None

    return wait_for(
        found, timeout_s, 0.5, message=f"one ended run in {experiment}" + (f"; it said: {said[-2000:]}" if said else "")
    )


def create_run(tracking_uri: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri).create_run("0").info.run_id


class ExportRecorder:
    """Every ``MLflowMetricExporter.export`` call of this test and what it returned; the socket I/O
    the calls made on the reader's thread is in the ``socket_io`` fixture (it must be none)."""

    def __init__(self) -> None:
        self.calls = 0
        self.successes = 0  # exports that returned SUCCESS
        self._lock = threading.Lock()

    @property
    def windows(self) -> int:
        """The windows the successful exports made with samples_per_window=1: one each, but the first
        window is the agent's baseline and its first sample, two exports."""
        return max(self.successes - 1, 0)

    def record(self, success: bool) -> None:
        with self._lock:
            self.calls += 1
            self.successes += success


class ThreadWatch:
    """Samples the live threads every few ms; ``peak`` = most call threads alive at once."""

    def __init__(self, name_part: str = CALL_THREAD, interval_s: float = 0.005) -> None:
        self.name_part = name_part
        self.peak = 0
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-thread-watch", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            alive = sum(1 for t in threading.enumerate() if self.name_part in t.name and t.is_alive())
            self.peak = max(self.peak, alive)
            self._stop.wait(self._interval_s)

    def start(self) -> ThreadWatch:
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def system_histories(tracking_uri: str, run_id: str, prefix: str = PREFIX) -> dict[str, list[Any]]:
    """Each ``system/<node>/`` metric of the run: its history as MLflow returns it (by timestamp)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    keys = [key for key in client.get_run(run_id).data.metrics if key.startswith(prefix)]
    return {key: client.get_metric_history(run_id, key) for key in keys}


def anchor_key(histories: dict[str, list[Any]]) -> str:
    """The key every window holds (the smallest): the other values are sent when they change."""
    return min(histories)


def assert_every_window(
    tracking_uri: str, run_id: str, windows: int, prefix: str = PREFIX, first_step: int = 0
) -> dict[str, list[Any]]:
    """What the user sees: steps first_step.. in order, no gap, no repeat, in the anchor key (sent
    every window); every other key without a repeated or unordered step, at least every tenth window
    (a value is sent again when it changed, or after 10 windows); timestamps rise with the steps."""
    assert windows > 0
    histories = system_histories(tracking_uri, run_id, prefix)
    expected = list(range(first_step, first_step + windows))
    key = anchor_key(histories)
    steps = [m.step for m in histories[key]]
    missing = sorted(set(expected) - set(steps))
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    assert steps == expected, (
        f"{key}: {len(steps)} points for {windows} windows; missing steps {missing}, "
        f"repeated {repeated}, extra {sorted(set(steps) - set(expected))}; steps {steps}"
    )
    for key, history in histories.items():
        steps = [m.step for m in history]
        assert steps == sorted(set(steps)), f"{key}: steps out of order or repeated: {steps}"
        assert set(steps) <= set(expected), f"{key}: steps outside 0..{windows - 1}: {steps}"
        gaps = [
            later - earlier
            for earlier, later in zip([first_step - 1, *steps], [*steps, expected[-1] + 1], strict=False)
        ]
        assert max(gaps) <= 10 + 1, f"{key}: more than 10 windows without it: {steps}"
        stamps = [m.timestamp for m in history]
        assert stamps == sorted(set(stamps)), f"{key}: timestamps do not rise with the steps: {stamps}"
    return histories
