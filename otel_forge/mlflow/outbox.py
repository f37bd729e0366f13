"""``Outbox``: what a ``DeliveryWorker`` has yet to deliver, oldest first: a bounded queue in memory,
and an ``Overflow`` (the on-disk spool) for what does not fit, or for every item where it is written
ahead (the process may die before it is delivered). Items due together are taken as one call where
``join`` allows; a joined call the server refused is taken again item by item."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from otel_forge.ratelimit import RateLimitedLogger

_logger = logging.getLogger(__name__)

T = TypeVar("T")
MOST_JOINED = 16  # items one call may hold: the spool reads this many files to choose


def join_while(
    head: T, later: Iterable[T], join: Callable[[T, T], T | None], ready: Callable[[T], bool] = lambda _: True
) -> tuple[T, int]:
    """``head`` joined with the ``later`` items in turn, while each is ``ready`` and ``join`` takes it:
    the one item, and how many it holds."""
    item, count = head, 1
    for follower in later:
        if not ready(follower) or (joined := join(item, follower)) is None:
            break
        item, count = joined, count + 1
    return item, count


class Overflow(Protocol[T]):
    """Where items go when the queue is full (the spool), oldest first."""

    def append(self, item: T) -> bool:
        """Keep ``item`` after the others; False when there is no room (the item is dropped)."""

    def prepend(self, items: list[T]) -> int:
        """Keep ``items`` (older than those held) before the others; how many fit."""

    def peek(self) -> T | None: ...

    def peek_many(self, count: int) -> list[T]:
        """The oldest ``count`` items (fewer where fewer are held, or where one cannot be read)."""

    def pop(self) -> None: ...

    def __len__(self) -> int: ...


@dataclass
class DeliveryStats:
    """Cumulative counts; read by self-telemetry and ``otel-forge doctor``."""

    delivered: int = 0
    retried: int = 0
    spooled: int = 0
    dropped: int = 0
    hung_calls: int = 0


class Outbox(Generic[T]):
    """The items waiting for delivery, under the worker's condition (re-entrant: every method takes
    it, and a put or a pop wakes the worker's sender and its ``flush``)."""

    def __init__(
        self,
        name: str,
        cond: threading.Condition,
        stats: DeliveryStats,
        *,
        max_queue: int,
        overflow: Overflow[T] | None,
        write_ahead: bool,
        join: Callable[[T, T], T | None] | None,
    ) -> None:
        self.name = name
        self._cond = cond
        self._stats = stats
        self._queue: collections.deque[T] = collections.deque()
        self._max_queue = max_queue
        self._overflow = overflow
        # Write-ahead: every item goes to the overflow (the spool) first and leaves it once
        # delivered, so nothing is lost if the process dies; memory only when the spool refuses.
        self._write_ahead = write_ahead and overflow is not None
        # join(item, later): both as one call, or None where they cannot be one (too large).
        self._join = join
        self._alone = 0  # items to take one by one: a joined call that the server refused
        # Until the first call answers, waiting items are not counted as spooled: that call carries
        # the deliverer's one-time start (importing MLflow, reading the run), not the server's state.
        self._answered = False
        self._warnings = RateLimitedLogger(_logger)

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue) + (len(self._overflow) if self._overflow is not None else 0)

    def put(self, item: T) -> bool:
        """Keep ``item`` after the others; False if it had to be dropped (counted)."""
        with self._cond:
            if self._write_ahead:
                assert self._overflow is not None
                # Counted as spooled only when it has to wait behind others (the server is down or
                # behind): an item written and sent at once is the healthy case.
                waits = self._answered and bool(len(self._overflow))
                if self._overflow.append(item):
                    self._stats.spooled += waits
                    self._cond.notify()
                    return True
            # Once anything is in the overflow, newer items follow it there: order is kept.
            spilled = self._overflow is not None and len(self._overflow) and not self._write_ahead
            if len(self._queue) < self._max_queue and not spilled:
                self._queue.append(item)
                self._cond.notify()
                return True
            return self._to_overflow(item)

    def head(self) -> T | None:
        """The oldest item, None when there is none."""
        with self._cond:
            if self._write_ahead and (item := self._overflow.peek()) is not None:  # type: ignore[union-attr]
                return item
            if self._queue:
                return self._queue[0]
            return self._overflow.peek() if self._overflow is not None else None

    def take(self, head: T, ready: Callable[[T], bool]) -> tuple[T, int]:
        """``head`` and the items after it that are ``ready`` too, as one call where ``join`` allows:
        the call, and how many items it holds."""
        if self._join is None or self._alone:
            return head, 1
        with self._cond:
            if self._queue and self._queue[0] is head:
                later = list(itertools.islice(self._queue, 1, MOST_JOINED))
            elif self._overflow is not None and len(self._overflow) > 1:  # the usual one: no file read
                later = self._overflow.peek_many(MOST_JOINED)[1:]
            else:
                later = []
        return join_while(head, later, self._join, ready)

    def one_by_one(self, count: int) -> None:
        """The next ``count`` items are taken alone: a joined call of theirs was refused."""
        self._alone = count

    def pop(self, head: T, count: int = 1) -> None:
        """Remove ``head`` and the ``count - 1`` items after it, from where ``head`` came."""
        with self._cond:
            from_queue = bool(self._queue) and self._queue[0] is head
            for _ in range(count):
                if from_queue:
                    self._queue.popleft()
                elif self._overflow is not None:
                    self._overflow.pop()
            self._alone = max(self._alone - count, 0)
            self._cond.notify_all()  # flush() waits for the outbox to empty

    def answered(self, error: BaseException | None) -> None:
        """The first call has answered: from now on a waiting item is spooled; if it failed, so
        are the items that waited behind it."""
        with self._cond:
            if self._answered:
                return
            self._answered = True
            if error is not None and self._write_ahead:
                self._stats.spooled += max(len(self._overflow) - 1, 0)  # type: ignore[arg-type]

    def drop_memory(self) -> None:
        """Delivery has stopped: what waits in memory is dropped (counted)."""
        with self._cond:
            self._stats.dropped += len(self._queue)
            self._queue.clear()

    def spill(self) -> int:
        """Closing: the items in memory go to the overflow (counted as spooled, or dropped where it
        has no room); how many are left undelivered."""
        with self._cond:
            leftovers = list(self._queue)
            self._queue.clear()
            # The queue's items are older than those already spilled: they go first.
            kept = self._overflow.prepend(leftovers) if self._overflow is not None else 0
            self._stats.spooled += kept
            self._stats.dropped += len(leftovers) - kept
            return len(self._overflow) if self._overflow is not None else len(leftovers)

    def _to_overflow(self, item: T) -> bool:
        if self._overflow is not None and self._overflow.append(item):
            self._stats.spooled += 1
            self._cond.notify()
            return True
        self._stats.dropped += 1
        self._warnings.warning(
            f"{self.name}-dropped", "%s: queue and spool full, dropped an item (%d so far)", self.name,
            self._stats.dropped,
        )  # fmt: skip
        return False
