"""Windows into one run: ``log_batch`` per window, steps continuing the node's own after a resume."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from otel_forge.mlflow.client import (
    MAX_METRICS_PER_BATCH,
    RunInfo,
    RunPending,
    import_mlflow,
    live_run,
    make_client,
)
from otel_forge.mlflow.system_metrics.windows import Window


def next_system_step(run: Any, prefix: str) -> int:
    """The step after the last one this node logged (``prefix`` = ``system/[<node>/]``), else 0.

    The run's latest metrics carry their steps: no history is read.
    """
    last = -1
    for metric in run.data._metric_objs:  # noqa: SLF001 - the latest Metric objects, with steps
        rest = metric.key[len(prefix) :]
        # Without a node id, system/node_0/... belongs to another node, not to us.
        if metric.key.startswith(prefix) and "/" not in rest:
            last = max(last, metric.step)
    return last + 1


class WindowLogger:
    """Logs windows to one run: ``log_batch`` chunks of at most 1000, step = first step + index.

    The first step is found on the first delivery (on the delivery thread, never the reader's):
    after a resume it continues the node's own steps. Where the run's opener said what it knows of
    the run (``attach(run_id, known)``), only the anchor key's history is read (every window holds
    the anchor): a job of many nodes never has each read the whole run. Else the run is read once,
    which also tells ``experiment_id`` and ``run_name``. Without a run id yet,
    deliveries wait (``RunPending``) until ``attach``.
    """

    def __init__(
        self,
        run_id: str | None,
        tracking_uri: str | None,
        prefix: str,
        first_step: int | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> None:
        self.run_id = run_id
        self._tags = dict(tags or {})  # sent with the first window of each run
        self._tagged_run: str | None = None
        self.tracking_uri = tracking_uri
        self.prefix = prefix
        self.first_step = first_step
        self.experiment_id: str | None = None
        self.run_name: str | None = None
        self._client: Any = None
        self._read_run = True
        self._lock = threading.Lock()
        self.on_first_step: list[Any] = []

    def attach(self, run_id: str, known: RunInfo | None = None) -> None:
        """Log to ``run_id`` from now on; ``known``: what the run's opener knows of it, so the run
        is never read here (None: read it once)."""
        if known is not None:
            self.experiment_id, self.run_name, self._read_run = known.experiment_id, known.run_name, False
        self.run_id = run_id

    def _ensure_ready(self, window: Window) -> tuple[Any, int]:
        if self.run_id is None:
            raise RunPending("the run is not open yet")
        with self._lock:
            if self._client is None:
                self._client = make_client(self.tracking_uri)
            if self.first_step is None:
                self.first_step = self._resume_step(window)
                for callback in self.on_first_step:
                    callback(self.first_step)
            return self._client, self.first_step

    def _resume_step(self, window: Window) -> int:
        if self._read_run:
            run = live_run(self._client, self.run_id)  # type: ignore[arg-type]
            self.experiment_id, self.run_name = run.info.experiment_id, run.info.run_name
            return next_system_step(run, self.prefix)
        if not window.values:
            return 0
        anchor = min(key for key, _ in window.values)
        return max((m.step for m in self._client.get_metric_history(self.run_id, anchor)), default=-1) + 1

    def __call__(self, window: Window) -> None:
        client, first_step = self._ensure_ready(window)
        metric = import_mlflow().entities.Metric
        if not window.values:
            return
        step = first_step + window.index
        metrics = [metric(key, value, window.timestamp_ms, step) for key, value in window.values]
        run_tag = import_mlflow().entities.RunTag
        tags = [run_tag(k, v) for k, v in self._tags.items()] if self._tagged_run != self.run_id else []
        # The tags ride in the first call, in room its metrics leave: a call carries 1000 entries.
        first = MAX_METRICS_PER_BATCH - len(tags)
        client.log_batch(self.run_id, metrics=metrics[:first], tags=tags, synchronous=True)
        for start in range(first, len(metrics), MAX_METRICS_PER_BATCH):
            chunk = metrics[start : start + MAX_METRICS_PER_BATCH]
            client.log_batch(self.run_id, metrics=chunk, synchronous=True)
        self._tagged_run = self.run_id
