"""``JournalDelivery``: a run's journal delivered into its run by a process that is not the one writing
it: the node's sampler process, the ``otel-forge run`` process, a delivery process of its own, or
``otel-forge replay`` (the same delivery, later).

It tails the journal and sends its entries in order: metric values as ``log_batch`` calls (one per
flush interval, or per 1,000 values), records and checkpoints as they come, then the run's end. A
failure is classified as the windows' are: retried with jittered backoff (an outage, an overloaded
server, a refused credential or certificate), dropped (a value the server refuses), or the end of
delivery (the run is gone). How far it has delivered is written after every call (``delivered.json``),
so a delivery that starts again sends nothing twice (and MLflow drops an exact duplicate anyway).

The run is the one the training process opened (its ``opened`` entry). Where the training process
died, or ended, before it could open one, the delivery opens it from the journal's plan as the
training process would have: one run, whatever happened on the way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.client import (
    MAX_METRICS_PER_BATCH,
    asked_pause_s,
    classify,
    import_mlflow,
    make_client,
    outage_cause,
    refuses_connections,
    unanswered_reason,
)
from otel_forge.mlflow.server_probe import check_connects
from otel_forge.mlflow.spool_files import SpoolBusy, claim, kept_notice_level, write_atomically
from otel_forge.mlflow.training.journal_tail import MARK, Item, JournalTail, MetricRow
from otel_forge.mlflow.training.run_journal import (
    CHECKPOINT,
    CURSOR_FILE,
    END,
    JOURNAL_FILE,
    METRICS,
    RECORD,
    Record,
    RunEnd,
    read_header,
    undelivered,
)
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.worker import Backoff, Outcome
from otel_forge.node import NodeIdentity, torchrun_attempt
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import error_line, uri_without_credentials

_logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a quiet journal is read again
_BACKOFF_S = (0.5, 10.0)  # as the windows' worker: first pause, longest pause
_DESCRIBED_POLL_S = 0.02  # how often a TrainingRun looks whether its description is in


class Delivered(enum.Enum):
    """How a delivery ended."""

    ALL = "all"  # everything, the run's end included: the journal is removed
    LEFT = "left"  # given up (deadline, patience, the run gone): the journal stays for replay
    BUSY = "busy"  # another process delivers this journal


@dataclass
class Cursor:
    """What ``delivered.json`` holds: the journal offset delivered up to, the run, models, refusals,
    and the entries that say how to open and describe the run (the offset may be past them)."""

    offset: int = 0
    plan: dict[str, Any] = field(default_factory=dict)
    describe: dict[str, Any] = field(default_factory=dict)
    opened: dict[str, Any] | None = None
    run: dict[str, Any] | None = None
    models: dict[str, str] = field(default_factory=dict)
    refused: int = 0
    undescribed: bool = False  # the run is ours to describe, and its description is not delivered yet

    @classmethod
    def load(cls, directory: Path) -> Cursor:
        try:
            return cls(**json.loads((directory / CURSOR_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            return cls()

    def save(self, directory: Path) -> None:
        write_atomically(directory / CURSOR_FILE, json.dumps(dataclasses.asdict(self)))


def wait_described(directory: Path, timeout_s: float) -> bool:
    """Wait, at most ``timeout_s``, until the delivery of the journal in ``directory`` has described
    its run (or delivered the journal whole); True then."""
    deadline = time.monotonic() + timeout_s
    while not _described(directory):
        if time.monotonic() >= deadline:
            _logger.info("MLflow: the run's description is not delivered yet; it follows in the background")
            return False
        time.sleep(_DESCRIBED_POLL_S)
    return True


def _described(directory: Path) -> bool:
    if not directory.exists():
        return True
    cursor = Cursor.load(directory)
    return cursor.run is not None and not cursor.undescribed


class _RunPending(Exception):
    """The training process has not opened the run yet: wait for it."""


class JournalDelivery:
    """Delivers the journal in ``directory`` until the run is ended, or it gives up.

    ``tracking_uri``: the one to deliver to (the journal records it without credentials).
    ``on_run``: called once the run is known (the sampler's windows go there too).
    ``job_run``: where the journal's plan leaves the run to its launcher (``otel-forge run``), the
    launcher's run, once it knows it.
    """

    def __init__(
        self,
        directory: Path,
        *,
        tracking_uri: str | None = None,
        flush_interval_s: float = 1.0,
        fsync_s: float = 1.0,
        patience_s: float = 600.0,
        on_run: Callable[[OpenRun], None] | None = None,
        job_run: Callable[[], str | None] | None = None,
        caller_reports: bool = False,
        on_delivered: Callable[[int], None] | None = None,
    ) -> None:
        self.directory = directory
        # A replay's caller says what was delivered and what is kept (the CLI's line, the leftovers'
        # INFO): the lines meant for a live run's user would repeat it at every start.
        self._caller_reports = caller_reports
        self._header = read_header(directory)
        self._uri = tracking_uri or self._header.get("tracking_uri")
        self._flush_interval_s = flush_interval_s
        self._fsync_s = fsync_s
        self._patience_s = patience_s
        self._on_run = on_run
        self._job_run = job_run
        self._cursor = Cursor.load(directory)
        self._tail = JournalTail(directory, self._cursor.offset, self._header)
        self._items = self._tail.items
        # When the last batch of values went: the next goes one flush interval later (the run's
        # first value at once, a full batch at once).
        self._flushed_at: float | None = None
        self._run: OpenRun | None = None
        self._client: Any = None
        self._deadline: float | None = None  # monotonic: set by finish()
        self._told_end: RunEnd | None = None  # the end its writer could not journal
        self._done_at: float | None = None  # when the writer ended or died: patience counts from then
        self._wake = threading.Event()
        self._synced_at = time.monotonic()
        self._warnings = RateLimitedLogger(_logger)
        self._backoff = Backoff(*_BACKOFF_S, asked=lambda error: asked_pause_s(self._uri, error))
        self.delivered_values = 0
        self._on_delivered = on_delivered  # called with the count after each call that delivered values
        self.ended: str | None = None  # the status the run was ended with
        self.cause: str | None = None  # why the last call failed, when it did

    @classmethod
    def for_config(cls, directory: Path, config: ForgeConfig, tracking_uri: str, **hooks: Any) -> JournalDelivery:
        """A delivery by the settings (flush interval, fsync interval, patience)."""
        return cls(
            directory, tracking_uri=tracking_uri, flush_interval_s=config.flush_interval_s,
            fsync_s=config.journal_fsync_s, patience_s=config.delivery_patience_s, **hooks,
        )  # fmt: skip

    # --- control, from any thread ---------------------------------------------------------

    def finish(self, deadline_s: float, end: RunEnd | None = None) -> None:
        """Deliver what is there within ``deadline_s``, then stop (the journal keeps what is left).
        ``end``: the run's end as its writer ended it, where the journal could not keep it."""
        self._told_end = end
        self._deadline = time.monotonic() + deadline_s
        self._wake.set()

    @property
    def run_id(self) -> str | None:
        return self._run.run_id if self._run is not None else None

    @property
    def plan(self) -> dict[str, Any]:
        """How the journal's writer asked for its run (experiment, job key, node)."""
        return self._cursor.plan

    # --- the delivery's thread ------------------------------------------------------------

    def run(self) -> Delivered:
        """Deliver until the run is ended (``ALL``) or it gives up (``LEFT``); ``BUSY`` at once when
        another process holds the journal."""
        try:
            lock = claim(self.directory)
        except SpoolBusy:
            return Delivered.BUSY
        with lock:
            try:
                outcome = self._deliver_all()
            finally:
                self._tail.close()
        if outcome is Delivered.ALL:
            self._remove()
        else:
            self.say_left()
        return outcome

    def _deliver_all(self) -> Delivered:
        while True:
            self._read()
            if self._tail.control.disabled:
                return Delivered.ALL
            self._sync_if_due()
            item = self._next_item()
            if item is None:
                if self._tail.read_all and not self._items:
                    if self.ended is not None or not self._ending_is_ours():
                        return Delivered.ALL
                    # Its writer died without closing, or told us the end it could not journal.
                    told = self._told_end or RunEnd("KILLED")
                    self._items.append(Item(END, (told.status, told.rejected, told.worker), None))
                    continue
                if self._gave_up():
                    return Delivered.LEFT
                self._wake.wait(POLL_S)
                self._wake.clear()
                continue
            try:
                self._send(item)
            except _RunPending:
                if self._gave_up():
                    return Delivered.LEFT
                self._wake.wait(POLL_S)
                continue
            except Exception as error:  # noqa: BLE001 - classified: retry, drop or stop
                outcome = classify(error)
                experiment = (self._run.experiment if self._run else None) or self._cursor.plan.get("experiment")
                self.cause = outage_cause(error, experiment) or unanswered_reason(error)
                if outcome is Outcome.STOP:
                    _logger.log(
                        self._notice_level(), "MLflow: delivery of %s stopped: %s", self.directory, error_line(error)
                    )
                    return Delivered.LEFT
                if outcome is not Outcome.DROP:
                    if self._deadline is not None and refuses_connections(error):
                        return Delivered.LEFT  # closing, the server down: its deadline would bring nothing
                    pause_s = self._backoff.pause_s(error)
                    if self._backoff.asked_s:
                        self.cause += f", Retry-After {self._backoff.asked_s:g} s"
                    self._warnings.log(
                        self._notice_level(), "retry", "MLflow at %s: %s; retrying, everything is kept "
                        "in %s", self.where, self.cause, self.directory,
                    )  # fmt: skip
                    if self._gave_up():
                        return Delivered.LEFT
                    if self._wake.wait(self._within_deadline(pause_s)):
                        self._wake.clear()
                    continue
                self._warnings.warning("drop", "MLflow: refused and dropped: %s", error_line(error))
            self._backoff.reset()
            self._done(item)

    def _within_deadline(self, pause_s: float) -> float:
        return pause_s if self._deadline is None else max(min(pause_s, self._deadline - time.monotonic()), 0.0)

    def _gave_up(self) -> bool:
        now = time.monotonic()
        if self._deadline is not None and now >= self._deadline:
            return True
        return self._done_at is not None and now - self._done_at >= self._patience_s

    # --- reading --------------------------------------------------------------------------

    def _read(self) -> None:
        self._tail.read()
        control = self._tail.control
        self._cursor.plan = control.plan or self._cursor.plan
        self._cursor.describe = control.describe or self._cursor.describe
        self._cursor.opened = control.opened or self._cursor.opened
        if self._tail.writer_done and self._done_at is None:
            self._done_at = time.monotonic()
        if self._tail.skipped:
            self._warnings.warning(
                "torn", "MLflow: %s: a record torn by the writer's death was skipped", self.directory
            )

    def _next_item(self) -> Item | None:
        """The next call: a batch of rows once due (full, followed by something else, the flush
        interval passed, or the writer done), else the item first in line."""
        if not self._items:
            return None
        if self._items[0].kind != METRICS:
            return self._items[0]
        rows = list(
            itertools.takewhile(lambda item: item.kind == METRICS, itertools.islice(self._items, MAX_METRICS_PER_BATCH))
        )
        count = len(rows)
        due = (
            count == MAX_METRICS_PER_BATCH
            or count < len(self._items)
            or self._tail.writer_done
            or self._deadline is not None
            or self._flushed_at is None
            or time.monotonic() - self._flushed_at >= self._flush_interval_s
        )
        if not due:
            return None
        return Item("rows", rows, None)

    def _done(self, item: Item) -> None:
        taken = item.data if item.kind == "rows" else [item]
        for _ in taken:
            self._items.popleft()
        ends = [t.end for t in taken if t.end is not None]
        if item.kind == "rows":
            self._flushed_at = time.monotonic()
        if ends:
            self._cursor.offset = ends[-1]
            self._save()

    def _save(self) -> None:
        with contextlib.suppress(OSError):
            self._cursor.save(self.directory)

    def _sync_if_due(self) -> None:
        if self._fsync_s <= 0 or time.monotonic() - self._synced_at < self._fsync_s:
            return
        self._synced_at = time.monotonic()
        # The training process never waits on the disk: its pages are forced out from here.
        with contextlib.suppress(OSError):
            fd = os.open(self.directory / JOURNAL_FILE, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    # --- sending --------------------------------------------------------------------------

    def _send(self, item: Item) -> None:
        if item.kind == MARK:
            return
        run = self._live_run()  # opens and describes the run (``OPENED``: nothing more)
        if item.kind == "rows":
            self._send_rows(run, [row.data for row in item.data if self._kept_step(run, row.data[3])])
        elif item.kind == RECORD:
            Record(*item.data).deliver(run.client, run.run_id)
        elif item.kind == CHECKPOINT:
            self._register(run, *item.data)
        elif item.kind == END:
            self._end(run, *item.data)

    def _kept_step(self, run: OpenRun, step: int) -> bool:
        """Steps a resumed run holds already are skipped, except in a later torchrun attempt
        (``--max-restarts``): it logs its steps again, and they are the job's."""
        attempt = torchrun_attempt(self._cursor.plan.get("attempt_environ") or {})
        return run.last_step is None or (attempt is not None and attempt.is_retry) or step > run.last_step

    def _send_rows(self, run: OpenRun, rows: list[MetricRow]) -> None:
        """One ``log_batch``; a batch the server refuses is split until the refused values are found."""
        if not rows:
            return
        metric = import_mlflow().entities.Metric
        try:
            run.client.log_batch(run.run_id, metrics=[metric(*row) for row in rows], synchronous=True)
            self.delivered_values += len(rows)
            if self._on_delivered is not None:
                self._on_delivered(len(rows))
        except Exception as error:
            if classify(error) is not Outcome.DROP:
                raise
            if len(rows) > 1:
                middle = len(rows) // 2
                self._send_rows(run, rows[:middle])
                self._send_rows(run, rows[middle:])
                return
            self._cursor.refused += 1
            self._warnings.warning(
                "refused", "MLflow: metric %r at step %d refused by the server: %s", rows[0][0], rows[0][3],
                error_line(error),
            )  # fmt: skip

    def _register(self, run: OpenRun, step: int, path: str, model_name: str) -> None:
        from otel_forge.mlflow.training.checkpoints import find_or_create_external_model

        if str(step) in self._cursor.models:
            return
        model_id = find_or_create_external_model(run, model_name, step, Path(path))
        self._cursor.models[str(step)] = model_id

    def _end(self, run: OpenRun, status: str, rejected: int, worker: str | None = None) -> None:
        from otel_forge.mlflow.training.outcome import end_run
        from otel_forge.mlflow.training.run_metadata import REJECTED_TAG

        if rejected or self._cursor.refused:
            run.client.set_tag(run.run_id, REJECTED_TAG, str(rejected + self._cursor.refused), synchronous=True)
        node = NodeIdentity(**self._cursor.plan["node"]) if self._cursor.plan.get("node") else NodeIdentity.detect()
        attempt_environ = self._cursor.plan.get("attempt_environ")
        end_run(run.client, run.run_id, run.experiment_id, status, node, environ=attempt_environ, worker=worker)
        self.ended = status
        if status == "FINISHED" and not self._cursor.plan.get("launched"):
            _warn_runs_elsewhere(run)

    def _ending_is_ours(self) -> bool:
        """A journal whose writer died without closing: its run ends KILLED here, unless its
        launcher (``otel-forge run``) ends it from the command's exit."""
        return (
            bool(self._cursor.plan)
            and not self._cursor.plan.get("launched")
            and not self._cursor.plan.get("launcher_opens")
        )

    # --- the run --------------------------------------------------------------------------

    def _live_run(self) -> OpenRun:
        if self._run is None:
            self._run = self._find_run()
        if self._cursor.undescribed:  # retried until every record is in: a call may fail on the way
            for record in self._describe_records():
                record.deliver(self._run.client, self._run.run_id)
            self._cursor.undescribed = False
            self._save()
        return self._run

    def _find_run(self) -> OpenRun:
        known = self._cursor.opened or self._cursor.run
        job_run = self._job_run() if self._job_run and known is None else None
        if known is None and job_run is None and not self._tail.writer_done:
            raise _RunPending()  # no client before there is a run: a local store is made once, by its opener
        if self._client is None:
            check_connects(self._uri)  # a server that is down costs no MLflow import (a second)
            self._client = make_client(self._uri)
        if known is None and job_run is not None:
            # The launcher's run, opened by its own journal's delivery: this journal describes it too,
            # and names it as the script did (online, the script's TrainingRun renames the run handed to it).
            known = {"run_id": job_run, "experiment": self._cursor.plan.get("experiment"), "describe": True}
            if name := self._cursor.plan.get("named"):
                Record("run_name", name).deliver(self._client, job_run)
                known["run_name"] = name
        if known is None:
            known = self._open_from_plan()
        run = OpenRun(
            known["run_id"],
            known.get("run_name"),
            known.get("experiment_id"),
            known.get("experiment") or "",
            bool(known.get("resumed")),
            known.get("last_step"),
            self._client,
            described=not known.get("describe", False),
        )
        if self._cursor.run is None:
            self._cursor.run = {k: v for k, v in known.items() if k != "describe"}
            self._cursor.undescribed = bool(known.get("describe"))
            self._save()
        if self._on_run is not None:
            self._on_run(run)
        return run

    def _open_from_plan(self) -> dict[str, Any]:
        """The run the training process would have opened, had the server answered while it ran."""
        from otel_forge.mlflow.training.job_run import JobRunFinder, JobRunRequest

        if not self._cursor.plan:
            raise RuntimeError(f"{self.directory}: the journal has no plan (its writer died before writing it)")
        plan = self._cursor.plan
        node = NodeIdentity(**plan["node"])
        request = JobRunRequest(
            tracking_uri=self._uri or "",
            experiment=plan["experiment"],
            experiment_id=plan.get("experiment_id"),
            run_id=plan.get("run_id"),
            run_name=plan.get("run_name"),
            launched=bool(plan.get("launched")),
            launcher_opens=bool(plan.get("launcher_opens")),
            create_if_missing=bool(plan.get("create_if_missing")),
            samples_node=False,
            late_after_s=60.0,
        )
        stopping, wake = threading.Event(), threading.Event()
        wake.set()  # a run of a launcher's job is looked for once per attempt, not waited for
        finder = JobRunFinder(request, self._new_run_spec, lambda: node, stopping, wake, threading.Event())
        run = finder.open(self._client)
        if run is None:
            raise _RunPending()
        described = run.described or (run.resumed and plan.get("launched", False))
        return {
            "run_id": run.run_id,
            "run_name": run.run_name,
            "experiment_id": run.experiment_id,
            "experiment": run.experiment,
            "resumed": run.resumed,
            "last_step": run.last_step,
            "describe": not described and node.is_global_zero,
        }

    def _new_run_spec(self, job_key: str | None) -> tuple[str | None, dict[str, str]]:
        from otel_forge.mlflow.training.rendezvous import JOB_KEY_TAG

        tags = dict(self._cursor.describe.get("creation_tags") or self._cursor.plan.get("tags") or {})
        if job_key:
            tags[JOB_KEY_TAG] = job_key
        return self._cursor.plan.get("run_name"), tags

    def _describe_records(self) -> list[Record]:
        return [Record(kind, payload) for kind, payload in self._cursor.describe.get("records", [])]

    # --- the end of the delivery ----------------------------------------------------------

    def pending_values(self) -> int:
        """The metric values in the journal past what is delivered (those held in memory included)."""
        try:
            return undelivered(self.directory, self._cursor.offset).values
        except OSError:
            return sum(1 for item in self._items if item.kind == METRICS)

    def _remove(self) -> None:
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)

    def say_left(self) -> None:
        """The one line naming what is kept in the journal, and the command that delivers it."""
        values = self.pending_values()
        _logger.log(
            self._notice_level(),
            "MLflow: %d metric value(s)%s of run %s were not delivered to %s%s; they are kept in %s. "
            "Deliver them with: otel-forge replay %s",
            values,
            "" if self.ended else " and the run's end",
            self.run_id or "(not opened yet)",
            self.where,
            f" ({self.cause})" if self.cause else "",
            self.directory,
            self.directory,
        )

    def _notice_level(self) -> int:
        return logging.INFO if self._caller_reports else kept_notice_level(self.directory)

    @property
    def where(self) -> str:
        return uri_without_credentials(self._uri or "")


def _warn_runs_elsewhere(run: OpenRun) -> None:
    from otel_forge.mlflow.training.run_context import runs_elsewhere

    if run.experiment_id is None:
        return
    try:
        elsewhere = runs_elsewhere(run.client, run.run_id, run.experiment_id)
    except Exception as error:  # noqa: BLE001 - a look for the user's sake, after the run's end
        _logger.debug("MLflow: the job's runs in other experiments not looked for: %s", error_line(error))
        return
    for run_id, experiment in elsewhere:
        _logger.warning(
            "MLflow: run %s of this job is in experiment %s, not beside run %s in %s: give the "
            "framework the job's run (Lightning: MLFlowLogger(run_id=otel_forge.job_run_id()))",
            run_id,
            experiment,
            run.run_id,
            run.experiment,
        )
