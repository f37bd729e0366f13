"""``DeliveryWorker``: items handed over by the process that makes them (the system-metrics
windows), delivered in order on threads of its own, whatever the server does.

``submit`` never blocks: the item goes to the ``Outbox`` (a bounded queue, or the on-disk spool) and
the ``Delivery`` engine's thread sends it at its due time, under a call deadline, retrying as the
engine does for every source.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from otel_forge.mlflow.delivery.engine import Delivery, DeliveryStats, Ended, Policy
from otel_forge.mlflow.delivery.outbox import Outbox, Overflow
from otel_forge.mlflow.delivery.retry import Backoff, Outcome

T = TypeVar("T")


def _retry_everything(error: BaseException) -> Outcome:
    return Outcome.RETRY


class DeliveryWorker(Generic[T]):
    """A bounded, deadline-guarded, in-order delivery of ``T`` items through ``deliver(item)``.

    ``overflow``: where items go when the queue is full (every item, written ahead, where
    ``write_ahead``); ``due(item)``: the wall-clock time it is sent at; ``join``: two items as one call;
    ``describe``, ``hopeless_at_close``: as ``Policy``'s; ``asked_pause``: the server's ``Retry-After``.
    """

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
        describe: Callable[[BaseException], str] | None = None,
        hopeless_at_close: Callable[[BaseException], bool] | None = None,
    ) -> None:
        self.name = name
        self.stats = DeliveryStats()
        self._outbox = Outbox(
            name, self.stats, max_queue=max_queue, overflow=overflow, write_ahead=write_ahead, join=join, due=due
        )
        policy = Policy(
            classify=classify,
            backoff=Backoff(backoff_initial_s, backoff_max_s, asked_pause),
            call_deadline_s=call_deadline_s,
            poll_s=backoff_initial_s,  # the run not open yet: looked at again this often
        )
        policy.describe = describe or policy.describe
        policy.hopeless_at_close = hopeless_at_close or policy.hopeless_at_close
        self._delivery: Delivery[T] = Delivery(self._outbox, deliver, name=name, policy=policy, stats=self.stats)
        self._outbox.on_put = self._delivery.nudge
        self._thread = threading.Thread(target=self._delivery.run, name=f"{name}-sender", daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        """True once delivery has ended for good (an ``Outcome.STOP`` error)."""
        return self._delivery.ended is Ended.STOPPED

    def pending(self) -> int:
        return len(self._outbox)

    def submit(self, item: T, follow_up: bool = False) -> bool:
        """Queue ``item`` for delivery without waiting; False if it had to be dropped.

        ``follow_up`` marks an item a delivery queues to continue its own work (draining a
        buffer): it is taken while closing too, so the drain deadline covers it.
        """
        if self.stopped or (self._delivery.closing and not follow_up):
            self.stats.dropped += 1
            return False
        return self._outbox.put(item)

    def nudge(self) -> None:
        """The item waiting for its due time reads it again: it may have become due (a full batch)."""
        self._delivery.nudge()

    def flush(self, timeout_s: float) -> bool:
        """Deliver what is pending now, not at its due time; True once all of it is delivered,
        False if ``timeout_s`` passes first (or delivery has stopped). Delivery goes on either way."""
        hurry = self._outbox.pace.hurry
        hurry.set()
        self._delivery.nudge()
        try:
            return self._outbox.wait_empty(timeout_s, lambda: self.stopped)
        finally:
            if not self._delivery.closing:
                hurry.clear()

    def close(self, drain_deadline_s: float = 10.0, spread_s: float = 0.0) -> int:
        """Deliver what is pending for up to ``drain_deadline_s``; what is left goes to the overflow.
        ``spread_s``: nothing is sent before that much of the deadline has passed (the nodes of a job,
        stopped together, spread their last calls instead of all calling at once).

        Returns the number of items left undelivered (in the overflow, or dropped without one).
        """
        self._outbox.pace.close(spread_s)
        self._delivery.finish(drain_deadline_s)
        self._thread.join()
        if self.stopped:
            self._outbox.drop_memory()
            return 0
        return self._outbox.spill()


__all__ = ["Backoff", "DeliveryWorker", "Outcome"]
