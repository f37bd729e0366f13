"""``MetricFlush``: a delivery-worker call that sends the oldest buffered training metrics."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from otel_forge.mlflow.client import MAX_METRICS_PER_BATCH, classify, import_mlflow
from otel_forge.mlflow.training.metric_buffer import MetricBuffer, MetricRow
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.worker import Outcome
from otel_forge.node import torchrun_attempt
from otel_forge.scrub import error_line


class MetricFlush:
    """Sends the oldest buffered metrics (up to one ``log_batch``) to the run ``live_run`` gives.

    The worker retries the same object after a transient failure, so it keeps the batch it took;
    a batch the server refuses is split to drop only the values it refuses (``on_refused``).
    ``on_done`` follows a delivered batch. Steps a resumed run holds already are skipped, except
    in a later torchrun attempt (``--max-restarts``): it logs its steps again, and they are the job's.
    ``due`` is the wall-clock time the worker sends it at (sooner when nudged or closing).
    """

    def __init__(
        self,
        live_run: Callable[[], OpenRun],
        buffer: MetricBuffer,
        on_refused: Callable[[MetricRow, str], None],
        on_done: Callable[[], None],
        environ: Mapping[str, str] | None = None,
        due: float = 0.0,
    ) -> None:
        self._due = due
        self._live_run = live_run
        self._buffer = buffer
        self._on_refused = on_refused
        self._on_done = on_done
        self._batch: list[MetricRow] | None = None
        attempt = torchrun_attempt(environ)
        self._keeps_logged_steps = attempt is not None and attempt.is_retry

    @property
    def due(self) -> float:
        """When the worker sends it: its due time, or now once a full batch waits."""
        return 0.0 if self._batch is None and len(self._buffer) >= MAX_METRICS_PER_BATCH else self._due

    def __call__(self) -> None:
        run = self._live_run()
        if self._batch is None:
            after_step = -1 if run.last_step is None or self._keeps_logged_steps else run.last_step
            self._batch = self._buffer.take(MAX_METRICS_PER_BATCH, after_step)
        self._send(run, self._batch)
        self._buffer.delivered()
        self._on_done()

    def _send(self, run: OpenRun, rows: list[MetricRow]) -> None:
        """One ``log_batch``; a batch the server refuses is split until the refused values are
        found. Resending what was delivered costs nothing: MLflow drops exact duplicates."""
        if not rows:
            return
        try:
            metric = import_mlflow().entities.Metric
            run.client.log_batch(run.run_id, metrics=[metric(*row) for row in rows], synchronous=True)
        except Exception as error:
            if classify(error) is not Outcome.DROP:
                raise  # retried by the worker with this same batch, or the end of delivery
            if len(rows) > 1:
                middle = len(rows) // 2
                self._send(run, rows[:middle])
                self._send(run, rows[middle:])
                return
            self._on_refused(rows[0], error_line(error))
