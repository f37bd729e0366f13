"""Deliver items to a server in order, on threads of our own, whatever the server does.

``DeliveryWorker.submit`` never blocks: it appends to a bounded queue (or, when the queue is full,
to an ``Overflow`` such as the on-disk spool) and returns. A sender thread delivers the oldest item
first (with the items due after it, where ``join`` makes them one call); each call runs on a call
thread under a deadline, so a hung server costs one thread and a warning, never the caller. An item
whose call passed its deadline is never sent again while that call may still be running: the retry
awaits it. A failure is classified: retried with jittered backoff (the item stays first in line),
dropped, or the end of delivery (e.g. the run was deleted).
"""

from __future__ import annotations

import collections
import enum
import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import scrub

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


class Outcome(enum.Enum):
    """What a failed delivery means."""

    RETRY = "retry"  # transient: try the same item again after a backoff
    DROP = "drop"  # this item can never be delivered: count it and go on
    STOP = "stop"  # nothing more can be delivered (e.g. the run is gone)
    WAIT = "wait"  # not deliverable yet, and expected (the run is not open): try again, quietly


class Backoff:
    """The pause before a failed call is tried again: doubling from ``initial_s`` up to ``most_s``, half
    fixed and half random (nodes failed by one overload come back spread, not together), and never
    shorter than what the server asked (``asked(error)``: its ``Retry-After``, where it sent one)."""

    def __init__(
        self, initial_s: float, most_s: float, asked: Callable[[BaseException], float | None] | None = None
    ) -> None:
        self._initial_s, self._most_s = initial_s, most_s
        self._asked = asked
        self._next_s = initial_s
        self.asked_s: float | None = None  # what the server asked before the last pause, if it did

    def reset(self) -> None:
        """A call went through: the next failure pauses briefly again."""
        self._next_s = self._initial_s

    def pause_s(self, error: BaseException) -> float:
        jittered = self._next_s * (0.5 + random.random() / 2)
        self._next_s = min(self._next_s * 2, self._most_s)
        self.asked_s = self._asked(error) if self._asked is not None else None
        return max(jittered, self.asked_s or 0.0)


class DeadlineExceeded(TimeoutError):
    """A call did not return within its deadline; it may still complete later."""


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


def _retry_everything(error: BaseException) -> Outcome:
    return Outcome.RETRY


class DeliveryWorker(Generic[T]):
    """A bounded, deadline-guarded, in-order delivery of ``T`` items through ``deliver(item)``."""

    def __init__(
        self,
        deliver: Callable[[T], None],
        *,
        name: str,
        max_queue: int = 64,
        call_deadline_s: float = 30.0,
        classify: Callable[[BaseException], Outcome] = _retry_everything,
        overflow: Overflow[T] | None = None,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 10.0,
        write_ahead: bool = False,
        due: Callable[[T], float] | None = None,
        join: Callable[[T, T], T | None] | None = None,
        asked_pause: Callable[[BaseException], float | None] | None = None,
    ) -> None:
        self.name = name
        # join(item, later): both as one call, or None where they cannot be one (too large).
        self._join = join
        self._alone = 0  # items to send one by one: a joined call that the server refused
        # due(item): the wall-clock time before which the item is not sent (until close hurries it).
        self._due = due
        self._hurry = threading.Event()  # set at close and during a flush: nothing waits for its due time
        self._wake = threading.Event()  # set at close (and by abandon): a backoff pause ends at once
        self.stats = DeliveryStats()
        self._deliver = deliver
        self._classify = classify
        self._overflow = overflow
        # Write-ahead: every item goes to the overflow (the spool) first and leaves it once
        # delivered, so nothing is lost if the process dies; memory only when the spool refuses.
        self._write_ahead = write_ahead and overflow is not None
        # Until the first call answers, waiting items are not counted as spooled: that call carries
        # the deliverer's one-time start (importing MLflow, reading the run), not the server's state.
        self._answered = False
        self._max_queue = max_queue
        self._call_deadline_s = call_deadline_s
        self._backoff = Backoff(backoff_initial_s, backoff_max_s, asked_pause)
        self._first_pause_s = backoff_initial_s  # a WAIT (the run not open yet) is looked at again this often
        self._queue: collections.deque[T] = collections.deque()
        self._cond = threading.Condition()
        self._in_flight: _Call[T] | None = None  # a call past its deadline, awaited by the retry
        self._closing = False
        self._close_not_before = 0.0  # closing: the time before which nothing is sent
        self._abandon = threading.Event()  # set when the drain deadline has passed
        self._stopped = False
        self._warnings = RateLimitedLogger(_logger)
        self._thread = threading.Thread(target=self._run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """True once delivery has ended for good (an ``Outcome.STOP`` error)."""
        return self._stopped

    def pending(self) -> int:
        with self._cond:
            return len(self._queue) + (len(self._overflow) if self._overflow is not None else 0)

    def submit(self, item: T, follow_up: bool = False) -> bool:
        """Queue ``item`` for delivery without waiting; False if it had to be dropped.

        ``follow_up`` marks an item a delivery queues to continue its own work (draining a
        buffer): it is taken while closing too, so the drain deadline covers it.
        """
        with self._cond:
            if self._stopped or (self._closing and not follow_up):
                self.stats.dropped += 1
                return False
            if self._write_ahead:
                # Counted as spooled only when it has to wait behind others (the server is down or
                # behind): a window written and sent at once is the healthy case.
                waits = self._answered and bool(len(self._overflow))  # type: ignore[arg-type]
                if self._overflow.append(item):  # type: ignore[union-attr]
                    self.stats.spooled += waits
                    self._cond.notify()
                    return True
            # Once anything is in the overflow, newer items follow it there: order is kept.
            spilled = self._overflow is not None and len(self._overflow) and not self._write_ahead
            if len(self._queue) < self._max_queue and not spilled:
                self._queue.append(item)
                self._cond.notify()
                return True
            return self._to_overflow(item)

    def _to_overflow(self, item: T) -> bool:
        if self._overflow is not None and self._overflow.append(item):
            self.stats.spooled += 1
            self._cond.notify()
            return True
        self.stats.dropped += 1
        self._warnings.warning(
            f"{self.name}-dropped",
            "%s: queue and spool full, dropped an item (%d so far)",
            self.name,
            self.stats.dropped,
        )
        return False

    def nudge(self) -> None:
        """The item waiting for its due time reads it again: it may have become due (a full batch)."""
        with self._cond:
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Deliver what is pending now, not at its due time; True once all of it is delivered,
        False if ``timeout_s`` passes first (or delivery has stopped). Delivery goes on either way."""
        self._hurry.set()
        try:
            with self._cond:
                self._cond.notify_all()  # an item waiting for its due time goes now
                return self._cond.wait_for(lambda: self._stopped or not self.pending(), timeout_s) and not self._stopped
        finally:
            if not self._closing:
                self._hurry.clear()

    def close(self, drain_deadline_s: float = 10.0, spread_s: float = 0.0) -> int:
        """Deliver what is pending for up to ``drain_deadline_s``; what is left goes to the overflow.
        ``spread_s``: nothing is sent before that much of the deadline has passed (the nodes of a job,
        stopped together, spread their last calls instead of all calling at once).

        Returns the number of items left undelivered (in the overflow, or dropped without one).
        """
        with self._cond:
            self._closing = True
            self._close_not_before = time.time() + spread_s
            self._cond.notify_all()
        if spread_s <= 0:
            self._hurry.set()
        self._wake.set()
        self._thread.join(drain_deadline_s)
        self._abandon.set()
        self._wake.set()
        self._thread.join()
        with self._cond:
            leftovers = list(self._queue)
            self._queue.clear()
            if self._stopped:
                self.stats.dropped += len(leftovers)
                return 0
            # The queue's items are older than those already spilled: they go first.
            kept = self._overflow.prepend(leftovers) if self._overflow is not None else 0
            self.stats.spooled += kept
            self.stats.dropped += len(leftovers) - kept
            return len(self._overflow) if self._overflow is not None else len(leftovers)

    # --- the sender thread -----------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._next()) is not None:
            self._deliver_until_done(item)

    def _next(self) -> T | None:
        with self._cond:
            while not self._stopped and not self._abandon.is_set():
                if self._write_ahead and (item := self._overflow.peek()) is not None:  # type: ignore[union-attr]
                    return item
                if self._queue:
                    return self._queue[0]
                if self._overflow is not None and (item := self._overflow.peek()) is not None:
                    return item
                if self._closing:
                    return None
                self._cond.wait()
            return None

    def _pop(self, head: T, count: int = 1) -> None:
        """Remove ``head`` and the ``count - 1`` items after it, from where ``head`` came."""
        with self._cond:
            from_queue = bool(self._queue) and self._queue[0] is head
            for _ in range(count):
                if from_queue:
                    self._queue.popleft()
                elif self._overflow is not None:
                    self._overflow.pop()
            self._alone = max(self._alone - count, 0)
            self._cond.notify_all()  # flush() waits for the queue to empty

    def _joined(self, head: T) -> tuple[T, int]:
        """``head`` and the items after it that are due too, as one call where ``join`` allows: the
        call, and how many items it holds."""
        if self._join is None or self._alone:
            return head, 1
        with self._cond:
            if self._queue and self._queue[0] is head:
                later = list(itertools.islice(self._queue, 1, MOST_JOINED))
            elif self._overflow is not None and len(self._overflow) > 1:  # the usual one: no file read
                later = self._overflow.peek_many(MOST_JOINED)[1:]
            else:
                later = []
        return join_while(head, later, self._join, self._is_due)

    def _deliver_until_done(self, head: T) -> None:
        if self._due is not None:
            self._wait_until_due(head)
        item, count = self._joined(head)
        self._backoff.reset()
        while not self._abandon.is_set():
            error = self._call(item)
            if not self._answered:
                self._first_answer(error)
            if error is None:
                self.stats.delivered += count
                self._pop(head, count)
                return
            if self._abandon.is_set():
                return  # closing gave up on it: close() keeps what is left, and says so
            if self._in_flight is not None:
                continue  # past its deadline and still running: await it, it is not a new try
            outcome = self._classify(error)
            if outcome is Outcome.WAIT:
                self._abandon.wait(self._first_pause_s)
                continue
            if outcome is Outcome.STOP:
                self._stop(error)
                return
            if outcome is Outcome.DROP and count > 1:
                self._alone = count  # which of them is refused: each alone, the others are delivered
                return
            if outcome is Outcome.DROP:
                self.stats.dropped += 1
                self._warnings.warning(f"{self.name}-drop", "%s: dropped an item: %s", self.name, scrub(str(error)))
                self._pop(head)
                return
            self.stats.retried += 1
            self._warnings.warning(
                f"{self.name}-retry", "%s: delivery failed, retrying: %s", self.name, scrub(str(error))
            )
            if self._wake.wait(self._backoff.pause_s(error)):
                self._wake.clear()  # closing: try again now, and back off afresh within the drain deadline
                self._backoff.reset()

    def _due_at(self, item: T) -> float:
        """When ``item`` may be sent: its due time, or at a close, the close's own time if sooner."""
        assert self._due is not None
        return min(self._due(item), self._close_not_before) if self._closing else self._due(item)

    def _is_due(self, item: T) -> bool:
        return self._due is None or self._hurry.is_set() or self._due_at(item) <= time.time()

    def _wait_until_due(self, item: T) -> None:
        with self._cond:
            while not self._hurry.is_set():
                wait_s = self._due_at(item) - time.time()
                if wait_s <= 0:
                    return
                self._cond.wait(wait_s)

    def _first_answer(self, error: BaseException | None) -> None:
        """The first call has answered: from now on a waiting item is spooled; if it failed, so
        are the items that waited behind it."""
        with self._cond:
            self._answered = True
            if error is not None and self._write_ahead:
                self.stats.spooled += max(len(self._overflow) - 1, 0)  # type: ignore[arg-type]

    def _stop(self, error: BaseException) -> None:
        _logger.warning("%s: delivery stopped: %s", self.name, scrub(str(error)))
        with self._cond:
            self._stopped = True
            self.stats.dropped += len(self._queue)
            self._queue.clear()
            self._cond.notify_all()

    def _call(self, item: T) -> BaseException | None:
        """Run ``deliver(item)`` on a call thread; wait at most the call deadline.

        A call past its deadline is not abandoned for a new one: the server may still be working on
        it, and sending the item again would double its load when it is slowest. The retry of the
        same item awaits that first call instead.
        """
        in_flight = self._in_flight
        if in_flight is None or in_flight.item is not item:
            in_flight = self._start_call(item)
        deadline = time.monotonic() + self._call_deadline_s
        while not in_flight.done.wait(0.05):
            if self._abandon.is_set():
                return DeadlineExceeded("abandoned: the drain deadline at close has passed")
            if time.monotonic() >= deadline:
                self._in_flight = in_flight
                self.stats.hung_calls += 1
                self._warnings.warning(
                    f"{self.name}-hung",
                    "%s: a call exceeded its %.1f s deadline; waiting for it, not sending again",
                    self.name,
                    self._call_deadline_s,
                )
                return DeadlineExceeded(f"no answer within {self._call_deadline_s:g} s")
        self._in_flight = None
        return in_flight.error

    def _start_call(self, item: T) -> _Call[T]:
        call = _Call(item)

        def deliver() -> None:
            try:
                self._deliver(item)
            except BaseException as error:  # noqa: BLE001 - reported to the sender, classified there
                call.error = error
            finally:
                call.done.set()

        threading.Thread(target=deliver, name=f"{self.name}-call", daemon=True).start()
        return call


@dataclass
class _Call(Generic[T]):
    """One ``deliver(item)`` running on a call thread."""

    item: T
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
