"""``Outbox``: the windows' ``Source``, what a ``DeliveryWorker`` has yet to deliver, oldest first: a
bounded queue in memory, and an ``Overflow`` (the on-disk spool) for what does not fit, or for every
item where it is written ahead (the process may die before it is delivered). An item is sent at its
due time (``due``), sooner at a close or a flush; items due together are taken as one call where
``join`` allows; a joined call the server refused is taken again item by item."""

from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from otel_forge.mlflow.delivery.engine import Call, DeliveryStats, Ended
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


class Outbox(Generic[T]):
    """The items waiting for delivery. A put calls ``on_put`` (the delivery's nudge); a pop wakes
    ``wait_empty``."""

    def __init__(
        self,
        name: str,
        stats: DeliveryStats,
        *,
        max_queue: int,
        overflow: Overflow[T] | None,
        write_ahead: bool,
        join: Callable[[T, T], T | None] | None,
        due: Callable[[T], float] | None = None,
    ) -> None:
        self.name = name
        self._cond = threading.Condition()  # re-entrant: the methods call each other
        self._stats = stats
        self.on_put: Callable[[], None] = lambda: None
        self.on_delivered: Callable[[int], None] = lambda count: None  # told how many items each call delivered
        self.pace = _DuePace(due)
        # The call being made, until it is delivered or refused, and its first item.
        self._making: tuple[Call[T], T] | None = None
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
                    self.on_put()
                    return True
            # Once anything is in the overflow, newer items follow it there: order is kept.
            spilled = self._overflow is not None and len(self._overflow) and not self._write_ahead
            if len(self._queue) < self._max_queue and not spilled:
                self._queue.append(item)
                self.on_put()
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
            self._cond.notify_all()  # wait_empty

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
            self._cond.notify_all()

    def wait_empty(self, timeout_s: float, stopped: Callable[[], bool]) -> bool:
        """True once nothing waits, False if ``timeout_s`` passes first or delivery has ``stopped``."""
        with self._cond:
            return self._cond.wait_for(lambda: stopped() or not len(self), timeout_s) and not stopped()

    # --- the Source the delivery takes its calls from -------------------------------------

    def next_call(self, closing: bool) -> Call[T] | float | Ended:
        if self._making is not None:
            return self._making[0]  # the same call again (a call past its deadline is awaited, not sent twice)
        with self._cond:
            if (head := self.head()) is None:
                return Ended.ALL if closing else math.inf
        if (wait_s := self.pace.wait_s(head, closing)) > 0:
            return wait_s
        item, count = self.take(head, lambda later: self.pace.wait_s(later, closing) <= 0)
        self._making = (Call(item, count), head)
        return self._making[0]

    def delivered(self, call: Call[T]) -> None:
        self._took(call.count)
        self.on_delivered(call.count)

    def refused(self, call: Call[T], error: BaseException) -> int:
        if call.count > 1:
            self.one_by_one(call.count)  # which of them is refused: each alone, the others are delivered
            self._making = None
            return 0
        self._took(1)
        return 1

    def _took(self, count: int) -> None:
        """The call being made is done with: ``count`` of its items leave."""
        assert self._making is not None
        self.pop(self._making[1], count)
        self._making = None

    def gave_up(self) -> bool:
        return False

    def stopped(self) -> None:
        self.drop_memory()

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
            self.on_put()
            return True
        self._stats.dropped += 1
        self._warnings.warning(
            f"{self.name}-dropped", "%s: queue and spool full, dropped an item (%d so far)", self.name,
            self._stats.dropped,
        )  # fmt: skip
        return False


class _DuePace(Generic[T]):
    """When an item may be sent: ``due(item)``, a wall-clock time (None: at once); sooner at a close
    (its own time, after its spread), at once while hurried (a flush, a close without spread)."""

    def __init__(self, due: Callable[[T], float] | None) -> None:
        self._due = due
        self.hurry = threading.Event()  # set at close and during a flush: nothing waits for its due time
        self._close_not_before = 0.0  # closing: the time before which nothing is sent

    def close(self, spread_s: float) -> None:
        self._close_not_before = time.time() + spread_s
        if spread_s <= 0:
            self.hurry.set()

    def wait_s(self, item: T, closing: bool) -> float:
        """How long ``item`` waits for its time (0 or less: it is due)."""
        if self._due is None or self.hurry.is_set():
            return 0.0
        due = min(self._due(item), self._close_not_before) if closing else self._due(item)
        return due - time.time()
