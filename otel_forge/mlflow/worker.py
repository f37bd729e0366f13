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

import enum
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from otel_forge.mlflow.outbox import DeliveryStats, Outbox, Overflow
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import scrub

_logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        self.initial_s, self._most_s = initial_s, most_s
        self._asked = asked
        self._next_s = initial_s
        self.asked_s: float | None = None  # what the server asked before the last pause, if it did

    def reset(self) -> None:
        """A call went through: the next failure pauses briefly again."""
        self._next_s = self.initial_s

    def pause_s(self, error: BaseException) -> float:
        jittered = self._next_s * (0.5 + random.random() / 2)
        self._next_s = min(self._next_s * 2, self._most_s)
        self.asked_s = self._asked(error) if self._asked is not None else None
        return max(jittered, self.asked_s or 0.0)


class DeadlineExceeded(TimeoutError):
    """A call did not return within its deadline; it may still complete later."""


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
        self.stats = DeliveryStats()
        self._cond = threading.Condition()  # re-entrant: the outbox takes it too
        self._outbox = Outbox(
            name, self._cond, self.stats, max_queue=max_queue, overflow=overflow, write_ahead=write_ahead, join=join
        )
        self._pace = _DuePace(due, self._cond)
        self._call = _DeadlineCall(deliver, call_deadline_s, name, self.stats)
        self._classify = classify
        self._backoff = Backoff(backoff_initial_s, backoff_max_s, asked_pause)
        self._wake = threading.Event()  # set at close (and by abandon): a backoff pause ends at once
        self._closing = False
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
        return len(self._outbox)

    def submit(self, item: T, follow_up: bool = False) -> bool:
        """Queue ``item`` for delivery without waiting; False if it had to be dropped.

        ``follow_up`` marks an item a delivery queues to continue its own work (draining a
        buffer): it is taken while closing too, so the drain deadline covers it.
        """
        with self._cond:
            if self._stopped or (self._closing and not follow_up):
                self.stats.dropped += 1
                return False
            return self._outbox.put(item)

    def nudge(self) -> None:
        """The item waiting for its due time reads it again: it may have become due (a full batch)."""
        with self._cond:
            self._cond.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Deliver what is pending now, not at its due time; True once all of it is delivered,
        False if ``timeout_s`` passes first (or delivery has stopped). Delivery goes on either way."""
        self._pace.hurry.set()
        try:
            with self._cond:
                self._cond.notify_all()  # an item waiting for its due time goes now
                return self._cond.wait_for(lambda: self._stopped or not self.pending(), timeout_s) and not self._stopped
        finally:
            if not self._closing:
                self._pace.hurry.clear()

    def close(self, drain_deadline_s: float = 10.0, spread_s: float = 0.0) -> int:
        """Deliver what is pending for up to ``drain_deadline_s``; what is left goes to the overflow.
        ``spread_s``: nothing is sent before that much of the deadline has passed (the nodes of a job,
        stopped together, spread their last calls instead of all calling at once).

        Returns the number of items left undelivered (in the overflow, or dropped without one).
        """
        with self._cond:
            self._closing = True
            self._pace.close(spread_s)
        self._wake.set()
        self._thread.join(drain_deadline_s)
        self._abandon.set()
        self._wake.set()
        self._thread.join()
        if self._stopped:
            self._outbox.drop_memory()
            return 0
        return self._outbox.spill()

    # --- the sender thread -----------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._next()) is not None:
            self._deliver_until_done(item)

    def _next(self) -> T | None:
        with self._cond:
            while not self._stopped and not self._abandon.is_set():
                if (item := self._outbox.head()) is not None:
                    return item
                if self._closing:
                    return None
                self._cond.wait()
            return None

    def _deliver_until_done(self, head: T) -> None:
        self._pace.wait_until_due(head, self._closing)
        item, count = self._outbox.take(head, lambda later: self._pace.is_due(later, self._closing))
        self._backoff.reset()
        while not self._abandon.is_set():
            error = self._call(item, self._abandon)
            self._outbox.answered(error)
            if error is None:
                self.stats.delivered += count
                self._outbox.pop(head, count)
                return
            if self._abandon.is_set():
                return  # closing gave up on it: close() keeps what is left, and says so
            if self._call.hung:
                continue  # past its deadline and still running: await it, it is not a new try
            if not self._failed(head, count, error):
                return

    def _failed(self, head: T, count: int, error: BaseException) -> bool:
        """What a failed call means; True where the same call is to be made again."""
        outcome = self._classify(error)
        if outcome is Outcome.WAIT:
            self._abandon.wait(self._backoff.initial_s)  # the run not open yet: looked at again this often
            return True
        if outcome is Outcome.STOP:
            self._stop(error)
        elif outcome is Outcome.DROP and count > 1:
            self._outbox.one_by_one(count)  # which of them is refused: each alone, the others are delivered
        elif outcome is Outcome.DROP:
            self.stats.dropped += 1
            self._warnings.warning(f"{self.name}-drop", "%s: dropped an item: %s", self.name, scrub(str(error)))
            self._outbox.pop(head)
        else:
            self.stats.retried += 1
            self._warnings.warning(
                f"{self.name}-retry", "%s: delivery failed, retrying: %s", self.name, scrub(str(error))
            )
            if self._wake.wait(self._backoff.pause_s(error)):
                self._wake.clear()  # closing: try again now, and back off afresh within the drain deadline
                self._backoff.reset()
            return True
        return False

    def _stop(self, error: BaseException) -> None:
        _logger.warning("%s: delivery stopped: %s", self.name, scrub(str(error)))
        with self._cond:
            self._stopped = True
            self._outbox.drop_memory()
            self._cond.notify_all()


class _DuePace(Generic[T]):
    """When an item may be sent: ``due(item)``, a wall-clock time (None: at once); sooner at a close
    (its own time, after its spread), at once while hurried (a flush, a close without spread)."""

    def __init__(self, due: Callable[[T], float] | None, cond: threading.Condition) -> None:
        self._due = due
        self._cond = cond  # the worker's: a nudge or a flush makes the waiting item look again
        self.hurry = threading.Event()  # set at close and during a flush: nothing waits for its due time
        self._close_not_before = 0.0  # closing: the time before which nothing is sent

    def close(self, spread_s: float) -> None:
        self._close_not_before = time.time() + spread_s
        if spread_s <= 0:
            self.hurry.set()
        self._cond.notify_all()

    def _due_at(self, item: T, closing: bool) -> float:
        assert self._due is not None
        return min(self._due(item), self._close_not_before) if closing else self._due(item)

    def is_due(self, item: T, closing: bool) -> bool:
        return self._due is None or self.hurry.is_set() or self._due_at(item, closing) <= time.time()

    def wait_until_due(self, item: T, closing: bool) -> None:
        if self._due is None:
            return
        with self._cond:
            while not self.hurry.is_set():
                wait_s = self._due_at(item, closing) - time.time()
                if wait_s <= 0:
                    return
                self._cond.wait(wait_s)


class _DeadlineCall(Generic[T]):
    """``deliver(item)`` on a call thread, awaited at most ``deadline_s``.

    A call past its deadline is not abandoned for a new one: the server may still be working on it,
    and sending the item again would double its load when it is slowest. The retry of the same item
    awaits that first call instead (``hung`` meanwhile).
    """

    def __init__(self, deliver: Callable[[T], None], deadline_s: float, name: str, stats: DeliveryStats) -> None:
        self._deliver = deliver
        self._deadline_s = deadline_s
        self._name = name
        self._stats = stats
        self._in_flight: _Call[T] | None = None  # a call past its deadline, awaited by the retry
        self._warnings = RateLimitedLogger(_logger)

    @property
    def hung(self) -> bool:
        return self._in_flight is not None

    def __call__(self, item: T, abandon: threading.Event) -> BaseException | None:
        in_flight = self._in_flight
        if in_flight is None or in_flight.item is not item:
            in_flight = self._start(item)
        deadline = time.monotonic() + self._deadline_s
        while not in_flight.done.wait(0.05):
            if abandon.is_set():
                return DeadlineExceeded("abandoned: the drain deadline at close has passed")
            if time.monotonic() >= deadline:
                self._in_flight = in_flight
                self._stats.hung_calls += 1
                self._warnings.warning(
                    f"{self._name}-hung", "%s: a call exceeded its %.1f s deadline; waiting for it, not sending again",
                    self._name, self._deadline_s,
                )  # fmt: skip
                return DeadlineExceeded(f"no answer within {self._deadline_s:g} s")
        self._in_flight = None
        return in_flight.error

    def _start(self, item: T) -> _Call[T]:
        call = _Call(item)

        def deliver() -> None:
            try:
                self._deliver(item)
            except BaseException as error:  # noqa: BLE001 - reported to the sender, classified there
                call.error = error
            finally:
                call.done.set()

        threading.Thread(target=deliver, name=f"{self._name}-call", daemon=True).start()
        return call


@dataclass
class _Call(Generic[T]):
    """One ``deliver(item)`` running on a call thread."""

    item: T
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
