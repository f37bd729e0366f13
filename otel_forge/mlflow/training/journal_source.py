"""``JournalSource``: a run's journal as the delivery engine's ``Source``.

It tails the journal (``JournalTail``) and gives its entries in order as calls into the run
(``JournalRun``): metric values as ``log_batch`` calls (one per flush interval, or per 1,000
values), records and checkpoints as they come, then the run's end (KILLED where its writer died
without one). How far it has delivered is written after every call (``Cursor``), so a delivery that
starts again sends nothing twice (and MLflow drops an exact duplicate anyway).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from pathlib import Path

from otel_forge.mlflow.client import MAX_METRICS_PER_BATCH
from otel_forge.mlflow.delivery.engine import Call, Ended
from otel_forge.mlflow.training.journal_cursor import Cursor
from otel_forge.mlflow.training.journal_run import JournalRun
from otel_forge.mlflow.training.journal_tail import MARK, ROWS, Item, JournalTail
from otel_forge.mlflow.training.run_journal import END, METRICS, RunEnd

POLL_S = 0.1  # how often a quiet journal is read again
_OPEN = Item("open", None, None)  # the run to open for its writer (``RunPlan.delivery_opens``): not a journal entry


class JournalSource:
    """The journal in ``directory`` read by ``tail`` from ``cursor``, delivered into ``run``: a value is
    sent ``flush_interval_s`` after the last batch at the latest; once the writer is done, the
    delivery waits ``patience_s`` for the server before it leaves the rest to a replay."""

    def __init__(
        self,
        directory: Path,
        tail: JournalTail,
        cursor: Cursor,
        run: JournalRun,
        *,
        clock: Callable[[], float],
        flush_interval_s: float,
        patience_s: float,
        on_delivered: Callable[[int], None] | None = None,
    ) -> None:
        self.directory = directory
        self.tail = tail
        self.cursor = cursor
        self.run = run
        self._clock = clock
        self._flush_interval_s = flush_interval_s
        self._patience_s = patience_s
        self._on_delivered = on_delivered
        # When the last batch of values went: the next goes one flush interval later (the run's
        # first value at once, a full batch at once).
        self._flushed_at: float | None = None
        self.delivered_values = 0

    # --- the Source -----------------------------------------------------------------------

    def next_call(self, closing: bool) -> Call[Item] | float | Ended:
        """Read what is new; the next call that is due, or the end, or a wait."""
        self._read()
        if self.tail.control.disabled:
            return Ended.ALL
        if self.run.open_run is None and self.run.opens_for_writer:
            return Call(_OPEN, 0)  # at once, values or not: the writer waits for it
        if (item := self._next_item(closing)) is not None:
            return Call(item, len(item.data) if item.kind == ROWS else 0)  # counted: the values
        if self.tail.read_all and not self.tail.items:
            if self.run.ended is not None or not self.run.ending_is_ours():
                return Ended.ALL
            # Its writer died without closing, or told us the end it could not journal.
            told = self.run.told_end or RunEnd("KILLED")
            self.tail.items.append(Item(END, (told.status, told.rejected, told.worker), None))
            return 0.0
        return POLL_S

    def send(self, item: Item) -> None:
        if item is _OPEN:
            self.run.live(self.tail.writer_done)
        elif item.kind != MARK:
            delivered = self.run.send(item, self.tail.writer_done)
            self.delivered_values += delivered
            if delivered and self._on_delivered is not None:
                self._on_delivered(delivered)

    def answered(self, error: BaseException | None) -> None:
        pass

    def delivered(self, call: Call[Item]) -> None:
        item = call.payload
        if item is _OPEN:
            return
        taken = item.data if item.kind == ROWS else [item]
        for _ in taken:
            self.tail.items.popleft()
        if item.kind == ROWS:
            self._flushed_at = self._clock()
        if ends := [t.end for t in taken if t.end is not None]:
            self.cursor.offset = ends[-1]
            self.save()

    def refused(self, call: Call[Item], error: BaseException) -> int:
        self.delivered(call)  # the cursor moves past it: it is never sent again
        return call.count

    def gave_up(self) -> bool:
        done_at = self.tail.writer_done_at
        return done_at is not None and self._clock() - done_at >= self._patience_s

    def stopped(self) -> None:
        pass

    # --- reading and batching -------------------------------------------------------------

    def save(self) -> None:
        with contextlib.suppress(OSError):
            self.cursor.save(self.directory)

    def _read(self) -> None:
        self.tail.read()
        control = self.tail.control
        self.cursor.plan = control.plan or self.cursor.plan
        self.cursor.describe = control.describe or self.cursor.describe
        self.cursor.opened = control.opened or self.cursor.opened
        self.tail.say_skipped()

    def _next_item(self, closing: bool) -> Item | None:
        """The next call: a batch of rows once due (full, followed by something else, the flush
        interval passed, the writer done, or closing), else the item first in line."""
        items = self.tail.items
        if not items:
            return None
        if items[0].kind != METRICS:
            return items[0]
        rows = list(itertools.takewhile(lambda i: i.kind == METRICS, itertools.islice(items, MAX_METRICS_PER_BATCH)))
        due = (
            len(rows) == MAX_METRICS_PER_BATCH
            or len(rows) < len(items)
            or self.tail.writer_done
            or closing
            or self._flushed_at is None
            or self._clock() - self._flushed_at >= self._flush_interval_s
        )
        return Item(ROWS, rows, None) if due else None
