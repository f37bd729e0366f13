"""``RunSinks``: the runs sharing the node's agent, as its one sink: each collect to every run, a
leaving run's last collect to it alone, and delivery counters that never go down as runs leave."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from otel_forge.mlflow.system_metrics.sampled_node import RunSinks


class _Run:
    """An exporter's narrow view as RunSinks uses it: what it was given, what it delivered."""

    def __init__(self, name: str) -> None:
        self.run_id = name
        self.window_logger = SimpleNamespace(run_id=name)
        self.collects: list[object] = []
        self.delivered = 0

    def export(self, data: object) -> None:
        self.collects.append(data)

    def delivery_counts(self) -> dict[str, int]:
        return {"delivered": self.delivered, "pending": 0}


def test_each_collect_goes_to_every_run_and_a_leaving_runs_last_to_it_alone() -> None:
    sinks, first, second = RunSinks(), _Run("a"), _Run("b")
    sinks.add(first)
    sinks.add(second)
    sinks.export("collect 1")
    with sinks.alone(first):
        sinks.export("last of a")
        beside = threading.Thread(target=sinks.export, args=("collect 2",))  # the agent's own, meanwhile
        beside.start()
        beside.join()
    assert first.collects == ["collect 1", "last of a", "collect 2"]
    assert second.collects == ["collect 1", "collect 2"]


def test_the_delivery_counters_keep_what_runs_that_left_delivered() -> None:
    sinks, first, second = RunSinks(), _Run("a"), _Run("b")
    sinks.add(first)
    sinks.add(second)
    first.delivered, second.delivered = 5, 3
    sinks.remove(first)
    first.delivered = 6  # its last window, drained after it left
    assert sinks.delivery_counts()["delivered"] == 9
    assert [run.run_id for run in sinks.runs()] == ["b", "a"]  # served until drained
    sinks.retire(first)
    assert sinks.delivery_counts()["delivered"] == 9
    assert [run.run_id for run in sinks.runs()] == ["b"]
    sinks.export("collect")
    assert first.collects == [] and second.collects == ["collect"]
