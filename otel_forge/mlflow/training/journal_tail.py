"""``JournalTail``: a run's journal read by its delivery, two ways at once.

The items to deliver (metric values, records, checkpoints, the end) are read in order and held no
further ahead than ``MAX_ITEMS``: memory stays bounded, the journal holds the rest. The control
entries (the plan, the description, the run opened, logging disabled, the end) are scanned ahead
of them, as far as the file goes, and held alone: a backlog of values never hides the run they
belong to, nor the writer's end (an outage at a job's start left 39,000 values behind an ``opened``
entry that a bounded read never reached).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.journal import JournalReader
from otel_forge.mlflow.training.run_journal import (
    CHECKPOINT,
    DESCRIBE,
    DISABLED,
    END,
    JOURNAL_FILE,
    METRICS,
    OPENED,
    PLAN,
    RECORD,
    decode,
)

_logger = logging.getLogger(__name__)

MAX_ITEMS = 20_000  # items held ahead of the delivery
READ_RECORDS = 1_000  # journal records one read takes at most (each holds one log() call's values)
_VALUES_PREFIX = b'["' + METRICS.encode() + b'",'  # a values entry, told apart without decoding it
MARK = "mark"  # an item with nothing to send: its offset is delivered once it is reached
ROWS = "rows"  # metric values taken together from the items, for one log_batch

# (key, value, timestamp_ms, step)
MetricRow = tuple[str, float, int, int]


@dataclass
class Item:
    """One entry's worth of the journal, in order; ``end``: the offset delivered once it is."""

    kind: str
    # By kind: a MetricRow (METRICS), a list of METRICS items (ROWS), the entry's fields after its kind
    # (RECORD, CHECKPOINT, END), None (OPENED, MARK). Any: the delivery unpacks it into typed calls.
    data: Any
    end: int | None


@dataclass
class Control:
    """The control entries read so far (the latest of each): their JSON objects."""

    plan: dict[str, object] | None = None
    describe: dict[str, object] | None = None
    opened: dict[str, object] | None = None
    disabled: bool = False


class JournalTail:
    """Reads the journal in ``directory`` from ``offset``, while ``writer_alive()`` says whether more
    may come; forces its pages to disk every ``fsync_s`` (0: never), which its writer never does."""

    def __init__(
        self, directory: Path, offset: int, writer_alive: Callable[[], bool], clock: Callable[[], float], fsync_s: float
    ) -> None:
        self._writer_alive = writer_alive
        self._clock = clock
        self._fsync_s = fsync_s
        self._synced_at = clock()
        self.directory = directory
        self._items_reader = JournalReader(directory / JOURNAL_FILE, offset)
        self._control_reader = JournalReader(directory / JOURNAL_FILE, offset)
        self.items: deque[Item] = deque()
        self.control = Control()
        # When it was known that nothing more comes: its end read, or it died and all it wrote is read.
        self.writer_done_at: float | None = None
        # Its writer closed and told its end by other means (the journal could not keep it): nothing
        # more comes once what it wrote is read, though its process lives on (waiting for us).
        self.writer_closed = False
        self._told_damaged = 0  # the damaged stretches said so far
        self._told_torn = False

    @property
    def writer_done(self) -> bool:
        return self.writer_done_at is not None

    @property
    def read_all(self) -> bool:
        """Every item the journal will ever hold has been read into ``items``."""
        return self.writer_done and self._items_reader.offset >= self._control_reader.offset

    def read(self) -> None:
        """Scan the control entries to the end of what is written, then read items while there is room."""
        alive = self._writer_alive()  # asked first: a final read only once the writer is gone
        self._scan_control(final=not alive)
        if len(self.items) < MAX_ITEMS:
            for payload, end in self._items_reader.read(final=not alive, limit=READ_RECORDS):
                self._take(payload, end)
        self._sync_if_due()

    def say_skipped(self) -> None:
        """What a final read skipped, told apart by where it was: a record torn at the journal's end is
        what a writer's death leaves; damage with intact records after it is not (the file was changed)."""
        reader = self._items_reader
        # Said when first found, and again once all is read if more was found meanwhile: twice at most.
        if reader.damaged > self._told_damaged and (not self._told_damaged or self.read_all):
            self._told_damaged = reader.damaged
            _logger.warning(
                "MLflow: %s: %d byte(s) in %d place(s) in the middle of the journal (the first at "
                "offset %d) held no intact record and were skipped: the file was changed after it was written "
                "(overwritten, cut while written to, or corrupted on disk), which a writer's death does not do "
                "(it tears only what it was writing at the end); the values there are lost, the intact records "
                "around them are delivered",
                self.directory, reader.damaged_bytes, reader.damaged, reader.damaged_at,
            )  # fmt: skip
        if reader.torn_tail_bytes and self.read_all and not self._told_torn:
            self._told_torn = True
            _logger.warning(
                "MLflow: %s: the journal ends in an incomplete record (%d byte(s)), skipped: a write cut short "
                "by its writer's death or the node's crash, or the file was cut there",
                self.directory, reader.torn_tail_bytes,
            )  # fmt: skip

    def _sync_if_due(self) -> None:
        if self._fsync_s <= 0 or self._clock() - self._synced_at < self._fsync_s:
            return
        self._synced_at = self._clock()
        # The training process never waits on the disk: its pages are forced out from here.
        with contextlib.suppress(OSError):
            fd = os.open(self._items_reader.path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)

    def _scan_control(self, final: bool) -> None:
        while not self.writer_done:
            records = self._control_reader.read(final=final, limit=READ_RECORDS)
            for payload, _ in records:
                if not payload.startswith(_VALUES_PREFIX):
                    self._note(decode(payload))
            if len(records) < READ_RECORDS:
                # A dead writer's last record is read, or a closed one's: nothing more comes. (Without
                # the second, an end handed over by a writer whose disk refused it waited for the
                # writer's death, which waits for us: the run was left RUNNING.)
                if final or (self.writer_closed and self._control_reader.at_end):
                    self._mark_writer_done()
                return

    def _note(self, entry: Sequence[object] | None) -> None:
        if not entry:
            return
        kind = entry[0]
        # A plan, description or run is a JSON object; an entry without one is not ours (as decode's None).
        fields = dict(entry[1]) if len(entry) > 1 and isinstance(entry[1], dict) else None
        if kind == PLAN and fields is not None:
            self.control.plan = fields
        elif kind == DESCRIBE and fields is not None:
            self.control.describe = fields
        elif kind == OPENED and fields is not None:
            self.control.opened = fields
        elif kind == DISABLED:
            self.control.disabled = True
        elif kind == END:
            self._mark_writer_done()

    def _mark_writer_done(self) -> None:
        if self.writer_done_at is None:
            self.writer_done_at = self._clock()

    def _take(self, payload: bytes, end: int) -> None:
        entry = decode(payload)
        kind = entry[0] if entry else None
        if kind == METRICS and entry is not None:
            _, step, timestamp_ms, values = entry
            rows = [Item(METRICS, (key, float(value), timestamp_ms, step), None) for key, value in values.items()]
            if rows:
                rows[-1].end = end
                self.items.extend(rows)
                return
        elif kind in (RECORD, CHECKPOINT, END) and entry is not None:
            self.items.append(Item(kind, tuple(entry[1:]), end))
            return
        elif kind == OPENED:
            # Described at once, not with the first value: a framework's own params (the same config)
            # follow the block's start, and find ours there (``wait_described``).
            self.items.append(Item(OPENED, None, end))
            return
        self.items.append(Item(MARK, None, end))  # nothing to send: the cursor moves past it

    def close(self) -> None:
        self._items_reader.close()
        self._control_reader.close()
