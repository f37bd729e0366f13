"""``JournalDelivery``: a run's journal delivered into its run by a process that is not the one writing
it: the node's sampler process, the ``otel-forge run`` process, a delivery process of its own, or
``otel-forge replay`` (the same delivery, later).

It tails the journal (``JournalTail``) and sends its entries in order into the run (``JournalRun``):
metric values as ``log_batch`` calls (one per flush interval, or per 1,000 values), records and
checkpoints as they come, then the run's end. A failure is classified as the windows' are: retried
after a pause (``Backoff``: jittered, never shorter than a server's ``Retry-After``) for an outage,
an overloaded server, a refused credential or certificate; dropped for a value the server refuses;
the end of delivery where the run is gone. How far it has delivered is written after every call
(``Cursor``), so a delivery that starts again sends nothing twice (and MLflow drops an exact
duplicate anyway).

Each move is one ``step``: a call made, or nothing due yet; it says how long to wait before the next,
or how the delivery ended. ``run`` waits between steps on a thread; the simulation test steps it on
a fake clock (``DeliveryWorld``).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.client import (
    MAX_METRICS_PER_BATCH,
    classify,
    outage_cause,
    refuses_connections,
    unanswered_reason,
)
from otel_forge.mlflow.spool_files import SpoolBusy, claim, kept_notice_level
from otel_forge.mlflow.training.delivery_world import REAL_WORLD, DeliveryWorld
from otel_forge.mlflow.training.journal_cursor import Cursor, undelivered, wait_described
from otel_forge.mlflow.training.journal_run import JournalRun, RunNotOpenYet
from otel_forge.mlflow.training.journal_tail import MARK, ROWS, Item, JournalTail
from otel_forge.mlflow.training.run_journal import (
    END,
    METRICS,
    RunEnd,
    read_header,
)
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.worker import Backoff, Outcome
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import error_line, uri_without_credentials

_logger = logging.getLogger(__name__)

__all__ = ["Delivered", "DeliveryPace", "DeliveryWorld", "JournalDelivery", "wait_described"]

POLL_S = 0.1  # how often a quiet journal is read again
_BACKOFF_S = (0.5, 10.0)  # as the windows' worker: first pause, longest pause


class Delivered(enum.Enum):
    """How a delivery ended."""

    ALL = "all"  # everything, the run's end included: the journal is removed
    LEFT = "left"  # given up (deadline, patience, the run gone): the journal stays for replay
    BUSY = "busy"  # another process delivers this journal


@dataclass(frozen=True)
class DeliveryPace:
    """How often values go (``flush_interval_s``), the journal is forced to disk (``fsync_s``, 0: never),
    and how long a delivery tries once its writer is gone (``patience_s``)."""

    flush_interval_s: float = 1.0
    fsync_s: float = 1.0
    patience_s: float = 600.0

    @classmethod
    def of(cls, config: ForgeConfig) -> DeliveryPace:
        return cls(config.flush_interval_s, config.journal_fsync_s, config.delivery_patience_s)


class JournalDelivery:
    """Delivers the journal in ``directory`` until the run is ended, or it gives up.

    ``tracking_uri``: the one to deliver to (the journal records it without credentials).
    ``on_run``: called once the run is known (the sampler's windows go there too).
    ``job_run``: where the journal's plan leaves the run to its launcher (``otel-forge run``), the
    launcher's run, once it knows it. ``caller_reports``: the caller says what was delivered and what
    is kept (a replay), so the delivery's own lines about it are INFO. ``on_delivered``: told the
    count after each call that delivered values.
    """

    def __init__(
        self,
        directory: Path,
        *,
        tracking_uri: str | None = None,
        pace: DeliveryPace = DeliveryPace(),
        on_run: Callable[[OpenRun], None] | None = None,
        job_run: Callable[[], str | None] | None = None,
        caller_reports: bool = False,
        on_delivered: Callable[[int], None] | None = None,
        world: DeliveryWorld = REAL_WORLD,
    ) -> None:
        self.directory = directory
        self._caller_reports = caller_reports
        header = read_header(directory)
        self._pace = pace
        self._world = world
        self._cursor = Cursor.load(directory)
        self._tail = JournalTail(
            directory, self._cursor.offset, lambda: world.writer_alive(header), world.clock, pace.fsync_s
        )
        uri = tracking_uri or header.get("tracking_uri")
        self._run = JournalRun(uri, self._cursor, self._save, world, on_run, job_run)
        # When the last batch of values went: the next goes one flush interval later (the run's
        # first value at once, a full batch at once).
        self._flushed_at: float | None = None
        self._deadline: float | None = None  # on the world's clock: set by finish()
        self._wake = threading.Event()
        self._warnings = RateLimitedLogger(_logger)
        self._backoff = Backoff(*_BACKOFF_S, asked=lambda error: world.asked_pause(uri, error))
        self._on_delivered = on_delivered
        self.delivered_values = 0
        self.cause: str | None = None  # why the last call failed, when it did

    @classmethod
    def for_config(cls, directory: Path, config: ForgeConfig, tracking_uri: str, **hooks: Any) -> JournalDelivery:
        """A delivery by the settings (flush interval, fsync interval, patience)."""
        return cls(directory, tracking_uri=tracking_uri, pace=DeliveryPace.of(config), **hooks)

    # --- control, from any thread ---------------------------------------------------------

    def finish(self, deadline_s: float, end: RunEnd | None = None) -> None:
        """Deliver what is there within ``deadline_s``, then stop (the journal keeps what is left).
        ``end``: the run's end as its writer ended it, where the journal could not keep it."""
        self._run.told_end = end
        if end is not None:
            self._tail.writer_closed = True  # it appends nothing more: its end is what we were told
        self._deadline = self._world.clock() + deadline_s
        self._wake.set()

    @property
    def run_id(self) -> str | None:
        return self._run.open_run.run_id if self._run.open_run is not None else None

    @property
    def ended(self) -> str | None:
        """The status the run was ended with, once it was."""
        return self._run.ended

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
                while not isinstance(outcome := self.step(), Delivered):
                    if outcome > 0 and self._wake.wait(outcome):
                        self._wake.clear()  # finish() woke us: a pause ends, the deadline counts
            finally:
                self.close()
        if outcome is Delivered.ALL:
            self._remove()
        else:
            self.say_left()
        return outcome

    def close(self) -> None:
        """Let go of the journal's files (``run`` does, at its end)."""
        self._tail.close()

    def step(self) -> float | Delivered:
        """One move: read what is new, then send the next call that is due. How long to wait before
        the next move (0: at once), or how the delivery ended."""
        self._read()
        if self._tail.control.disabled:
            return Delivered.ALL
        item = self._next_item()
        if item is None:
            return self._idle()
        try:
            self._send(item)
        except RunNotOpenYet:
            return Delivered.LEFT if self._gave_up() else POLL_S
        except Exception as error:  # noqa: BLE001 - classified: retry, drop or stop
            if (outcome := classify(error)) is not Outcome.DROP:
                return self._failed(error, outcome)
            self._warnings.warning("drop", "MLflow: refused and dropped: %s", error_line(error))
        self._backoff.reset()
        self._done(item)
        return 0.0

    def _idle(self) -> float | Delivered:
        """Nothing to send now: the end, or a wait."""
        if self._tail.read_all and not self._tail.items:
            if self.ended is not None or not self._run.ending_is_ours():
                return Delivered.ALL
            # Its writer died without closing, or told us the end it could not journal.
            told = self._run.told_end or RunEnd("KILLED")
            self._tail.items.append(Item(END, (told.status, told.rejected, told.worker), None))
            return 0.0
        return Delivered.LEFT if self._gave_up() else POLL_S

    def _failed(self, error: BaseException, outcome: Outcome) -> float | Delivered:
        """A call failed, to be tried again (how long to wait first), or the end (``LEFT``)."""
        self.cause = outage_cause(error, self._run.experiment) or unanswered_reason(error)
        if outcome is Outcome.STOP:
            _logger.log(self._notice_level(), "MLflow: delivery of %s stopped: %s", self.directory, error_line(error))
            return Delivered.LEFT
        if self._deadline is not None and refuses_connections(error):
            return Delivered.LEFT  # closing, the server down: its deadline would bring nothing
        pause_s = self._backoff.pause_s(error)
        if self._backoff.asked_s:
            self.cause += f", Retry-After {self._backoff.asked_s:g} s"
        self._warnings.log(
            self._notice_level(), "retry", "MLflow at %s: %s; retrying, everything is kept in %s",
            self.where, self.cause, self.directory,
        )  # fmt: skip
        if self._gave_up():
            return Delivered.LEFT
        return pause_s if self._deadline is None else max(min(pause_s, self._deadline - self._world.clock()), 0.0)

    def _gave_up(self) -> bool:
        now = self._world.clock()
        if self._deadline is not None and now >= self._deadline:
            return True
        done_at = self._tail.writer_done_at
        return done_at is not None and now - done_at >= self._pace.patience_s

    # --- reading and batching -------------------------------------------------------------

    def _read(self) -> None:
        self._tail.read()
        control = self._tail.control
        self._cursor.plan = control.plan or self._cursor.plan
        self._cursor.describe = control.describe or self._cursor.describe
        self._cursor.opened = control.opened or self._cursor.opened
        self._tail.say_skipped()

    def _next_item(self) -> Item | None:
        """The next call: a batch of rows once due (full, followed by something else, the flush
        interval passed, or the writer done), else the item first in line."""
        items = self._tail.items
        if not items:
            return None
        if items[0].kind != METRICS:
            return items[0]
        rows = list(itertools.takewhile(lambda i: i.kind == METRICS, itertools.islice(items, MAX_METRICS_PER_BATCH)))
        due = (
            len(rows) == MAX_METRICS_PER_BATCH
            or len(rows) < len(items)
            or self._tail.writer_done
            or self._deadline is not None
            or self._flushed_at is None
            or self._world.clock() - self._flushed_at >= self._pace.flush_interval_s
        )
        return Item(ROWS, rows, None) if due else None

    def _done(self, item: Item) -> None:
        taken = item.data if item.kind == ROWS else [item]
        for _ in taken:
            self._tail.items.popleft()
        if item.kind == ROWS:
            self._flushed_at = self._world.clock()
        if ends := [t.end for t in taken if t.end is not None]:
            self._cursor.offset = ends[-1]
            self._save()

    def _save(self) -> None:
        with contextlib.suppress(OSError):
            self._cursor.save(self.directory)

    def _send(self, item: Item) -> None:
        if item.kind != MARK:
            delivered = self._run.send(item, self._tail.writer_done)
            self.delivered_values += delivered
            if delivered and self._on_delivered is not None:
                self._on_delivered(delivered)

    # --- the end of the delivery ----------------------------------------------------------

    def pending_values(self) -> int:
        """The metric values in the journal past what is delivered (those held in memory included)."""
        try:
            return undelivered(self.directory, self._cursor.offset).values
        except OSError:
            return sum(1 for item in self._tail.items if item.kind == METRICS)

    def _remove(self) -> None:
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)

    def say_left(self) -> None:
        """The one line naming what is kept in the journal, and the command that delivers it."""
        _logger.log(
            self._notice_level(),
            "MLflow: %d metric value(s)%s of run %s were not delivered to %s%s; they are kept in %s. "
            "Deliver them with: otel-forge replay %s",
            self.pending_values(),
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
        return uri_without_credentials(self._run.uri or "")
