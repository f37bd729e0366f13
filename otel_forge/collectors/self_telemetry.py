"""The agent's own readings: its reads of each source, and what it serves (MLflow delivery, the run).

Built by their owners around what they report on, never from the settings; each takes only the
narrow view it reads (a ``Protocol``), so this module imports neither the pipeline nor MLflow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from otel_forge.collectors.base import Collector, Readings


class _ReadStats(Protocol):
    @property
    def reads(self) -> int: ...
    @property
    def errors(self) -> int: ...
    @property
    def read_time_s(self) -> float: ...


class ReadCounted(Protocol):
    """A source whose reads are counted (the snapshot cache of a collector)."""

    @property
    def name(self) -> str: ...
    @property
    def stats(self) -> _ReadStats: ...


class RunIdentity(Protocol):
    """What is known of the run the windows go to (None until the server said)."""

    @property
    def run_id(self) -> str | None: ...
    @property
    def experiment_id(self) -> str | None: ...
    @property
    def run_name(self) -> str | None: ...


class SelfTelemetryCollector(Collector):
    """The agent's read statistics (time, reads, errors per collector) and when it was read, i.e.
    collected: what a scrape serves is that old (``time() - otel_forge_collect_time_seconds``)."""

    name = "self"

    def __init__(self, sources: Sequence[ReadCounted]) -> None:
        self._sources = sources

    def read(self, readings: Readings) -> None:
        readings.add("otel_forge.collect.time", time.time())
        for source in self._sources:
            attributes = {"otel_forge.collector": source.name}
            readings.add("otel_forge.collector.reads", source.stats.reads, attributes)
            readings.add("otel_forge.collector.errors", source.stats.errors, attributes)
            readings.add("otel_forge.collector.read.time", source.stats.read_time_s, attributes)


class DeliveryStatsCollector(Collector):
    """Self-telemetry of the MLflow delivery: windows delivered, retried, spooled, dropped."""

    name = "delivery"

    def __init__(self, counts: Callable[[], Mapping[str, int]]) -> None:
        self._counts = counts

    def read(self, readings: Readings) -> None:
        for outcome, count in self._counts().items():
            if outcome != "pending":
                readings.add("otel_forge.delivery.windows", count, {"otel_forge.delivery.outcome": outcome})


class RunInfoCollector(Collector):
    """The runs this agent serves, each as an info metric (value 1) that Grafana can join on;
    ``where``: more of what names the node (on Kubernetes its pod, namespace, node and owning job:
    ``k8s.*``)."""

    name = "run"

    def __init__(
        self, runs: Callable[[], Iterable[RunIdentity]], node_id: str | None, where: Mapping[str, str] | None = None
    ) -> None:
        self._runs = runs
        self._node_id = node_id
        self._where = dict(where or {})

    def read(self, readings: Readings) -> None:
        for run in self._runs():
            if run.experiment_id is None or run.run_id is None:
                continue  # not read from the server yet: one series per run, never a relabelled one
            readings.add(
                "otel_forge.run.info",
                1,
                {
                    "mlflow.run.id": run.run_id,
                    "mlflow.experiment.id": run.experiment_id,
                    "mlflow.run.name": run.run_name or "",
                    "otel_forge.node.id": self._node_id or "",
                    **self._where,
                },
            )


class ReceivedCollector(Collector):
    """The MLflow keys received OTLP metrics feed, their latest values by run, as Prometheus sees
    them (``received``: ``ReceivedRuns.latest``)."""

    name = "received"

    def __init__(self, latest: Callable[[], Iterable[tuple[str, str, float]]]) -> None:
        self._latest = latest

    def read(self, readings: Readings) -> None:
        for run_id, key, value in self._latest():
            readings.add("otel_forge.otlp.received", value, {"mlflow.run.id": run_id, "otel_forge.mlflow.key": key})
