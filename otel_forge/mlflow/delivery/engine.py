"""``Delivery``: the one delivery engine, for a run's journal and for the system-metrics windows.

A ``Source`` says what to send next: a call due now, how long until one may be, or that it has
nothing more. The engine sends the call (on a call thread under a deadline, where one is given, so
a hung server costs a thread and a warning, never the caller), tells the source it was delivered,
and classifies a failure: retried after a ``Backoff`` pause (never shorter than the server's
``Retry-After``), dropped, waited for quietly (the run is not open yet), or the end of delivery (the
run is gone). A call past its deadline is never sent again while it may still be running: the retry
awaits it.

Each move is one ``step``: it says how long to wait before the next, or how the delivery ended.
``run`` waits between steps on the caller's thread, woken early by
``nudge`` (new items) and ``finish`` (deliver what is there within a deadline, then end); the journal's
simulation test steps it on a fake clock.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from otel_forge.mlflow.delivery.retry import Backoff, Outcome
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import error_line, scrub

_logger = logging.getLogger(__name__)

C = TypeVar("C")

# Past a close's deadline, a call still unanswered after this long is left (where answered calls go on).
HUNG_AT_CLOSE_S = 3.0


class Ended(enum.Enum):
    """How a delivery ended."""

    ALL = "all"  # the source has nothing more: everything is delivered
    LEFT = "left"  # given up (its deadline, its patience, a server refusing at close): the source keeps the rest
    STOPPED = "stopped"  # nothing more can be delivered (the run is gone)


@dataclass
class Call(Generic[C]):
    """One call to make: its payload, and how many of the source's items it holds."""

    payload: C
    count: int = 1


class Source(Protocol[C]):
    """What a delivery delivers from, oldest first."""

    def next_call(self, closing: bool) -> Call[C] | float | Ended:
        """The call due now; else the seconds until one may be (``math.inf``: until a ``nudge``); or
        ``Ended.ALL`` once nothing more will come. ``closing``: ``finish`` was called."""

    def answered(self, error: BaseException | None) -> None:
        """A call has answered (``error``: how it failed, None where it went through)."""

    def delivered(self, call: Call[C]) -> None:
        """``call`` went through: its items leave the source."""

    def refused(self, call: Call[C], error: BaseException) -> int:
        """The server refused ``call`` for good: how many of its items are dropped (0 where the
        source takes them again another way, e.g. one by one)."""

    def gave_up(self) -> bool:
        """True once the source would rather keep what it holds than wait longer (its patience)."""

    def stopped(self) -> None:
        """Nothing more can be delivered: what the source holds in memory is let go."""


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


def _never(error: BaseException) -> bool:
    return False


def _error_text(error: BaseException) -> str:
    return scrub(str(error))


@dataclass
class Policy:
    """How a delivery treats failures and time. ``classify``: what a failure means; ``describe``: it in
    a few words (the real status, never a credential); ``hopeless_at_close``: a failure not worth the
    rest of ``finish``'s deadline (a server refusing connections); ``call_deadline_s``: how long one call
    is awaited (None: the call is the caller's own, made in ``step``; ``math.inf``: on a call thread,
    awaited until ``finish``'s deadline alone); ``poll_s``: how often a source
    that is not deliverable yet is looked at again; ``keeps``: what the retry line says is kept
    ("<name>: delivery failed, retrying: <cause><keeps>"); ``notice_level``: the level of its lines;
    ``finish_while_answered``: past ``finish``'s deadline, calls that go through go on (a journal's
    delivery is the last before a replay), where otherwise the deadline ends delivery (a shutdown)."""

    classify: Callable[[BaseException], Outcome] = _retry_everything
    describe: Callable[[BaseException], str] = _error_text
    hopeless_at_close: Callable[[BaseException], bool] = _never
    backoff: Backoff = field(default_factory=lambda: Backoff(0.5, 10.0))
    call_deadline_s: float | None = None
    poll_s: float = 0.5
    keeps: str = ""
    notice_level: Callable[[], int] = lambda: logging.WARNING
    finish_while_answered: bool = False


class Delivery(Generic[C]):
    """Delivers ``source``'s calls through ``send`` in order, by ``policy``; ``name`` begins its lines."""

    def __init__(
        self,
        source: Source[C],
        send: Callable[[C], None],
        *,
        name: str,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.monotonic,
        stats: DeliveryStats | None = None,
    ) -> None:
        self.name = name
        self.stats = stats or DeliveryStats()
        self._source = source
        self._policy = policy or Policy()
        self._clock = clock
        deadline_s = self._policy.call_deadline_s
        self._call: _DeadlineCall[C] | _DirectCall[C] = (
            _DeadlineCall(send, deadline_s, name, self.stats, self._abandon) if deadline_s else _DirectCall(send)
        )
        self._wake = threading.Event()  # set by a nudge or a finish: the wait for the next call ends
        self._finishing = threading.Event()  # set by a finish: a failed call's pause ends too
        self._failing = False  # the last step failed: its pause holds
        self._deadline: float | None = None  # on the clock: set by finish()
        self.ended: Ended | None = None
        self.answered_past_deadline = False  # a call went through after finish's deadline
        self.cause: str | None = None  # why the last call failed, when it did
        self._warnings = RateLimitedLogger(_logger)

    # --- control, from any thread ---------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._deadline is not None

    def past_deadline(self) -> bool:
        return self._deadline is not None and self._clock() >= self._deadline

    def _abandon(self, running_s: float) -> bool:
        """Whether a call running for ``running_s`` is left: past ``finish``'s deadline; where calls
        that go through go on past it, once the call has hung ``HUNG_AT_CLOSE_S`` too."""
        if not self.past_deadline():
            return False
        return not self._policy.finish_while_answered or running_s >= HUNG_AT_CLOSE_S

    def nudge(self) -> None:
        """Something changed in the source (a new item, a flush): the wait between steps ends."""
        self._wake.set()

    def finish(self, deadline_s: float) -> None:
        """Deliver what is there within ``deadline_s``, then end (the source keeps what is left). A
        pause ends at once, and the backoff starts afresh within the deadline."""
        self._deadline = self._clock() + deadline_s
        self._policy.backoff.reset()
        self._finishing.set()
        self._wake.set()

    # --- the delivery's thread ------------------------------------------------------------

    def run(self) -> Ended:
        """Step until the delivery ends; how it ended."""
        while not isinstance(pause := self.step(), Ended):
            # A failed call's pause is the server's: new items and flushes do not shorten it, a finish does.
            wake = self._finishing if self._failing else self._wake
            if pause > 0 and wake.wait(None if math.isinf(pause) else pause):
                wake.clear()
        return pause

    def step(self) -> float | Ended:
        """One move: the next call sent, or nothing due yet. How long to wait before the next move
        (0: at once; ``math.inf``: until a nudge), or how the delivery ended."""
        if self.ended is not None:
            return self.ended
        self._failing = False
        if self.past_deadline() and not self._policy.finish_while_answered:
            return self._end(Ended.LEFT)
        call = self._source.next_call(self.closing)
        if isinstance(call, Ended):
            return self._end(call)
        if not isinstance(call, Call):
            return self._end(Ended.LEFT) if call > 0 and self._given_up() else self._within_deadline(call)
        error = self._call(call.payload)
        self._source.answered(error)
        if error is None:
            self.answered_past_deadline |= self.past_deadline()
            self._policy.backoff.reset()
            self.stats.delivered += call.count
            self._source.delivered(call)
            return 0.0
        return self._failed(call, error)

    def _failed(self, call: Call[C], error: BaseException) -> float | Ended:
        """A call failed: how long until it is made again, or how the delivery ended."""
        self._failing = True
        if self._call.hung:
            return 0.0 if not self.past_deadline() else self._end(Ended.LEFT)  # still running: await it
        if self.past_deadline():
            return self._end(Ended.LEFT)
        outcome = self._policy.classify(error)
        if outcome is Outcome.WAIT:
            return self._end(Ended.LEFT) if self._given_up() else self._within_deadline(self._policy.poll_s)
        if outcome is Outcome.DROP:
            self._policy.backoff.reset()
            self.stats.dropped += (dropped := self._source.refused(call, error))
            if dropped:
                self._warnings.warning(f"{self.name}-drop", "%s: refused and dropped: %s", self.name, error_line(error))
            return 0.0
        self.cause = self._policy.describe(error)
        if outcome is Outcome.STOP:
            _logger.log(self._policy.notice_level(), "%s: delivery stopped: %s", self.name, error_line(error))
            ended = self._end(Ended.STOPPED)  # first: a flush waiting on the source sees it stopped
            self._source.stopped()
            return ended
        if self.closing and self._policy.hopeless_at_close(error):
            return self._end(Ended.LEFT)  # the server down at close: its deadline would bring nothing
        return self._retry(error)

    def _retry(self, error: BaseException) -> float | Ended:
        self.stats.retried += 1
        backoff = self._policy.backoff
        pause_s = backoff.pause_s(error)
        if backoff.asked_s:
            self.cause = f"{self.cause}, Retry-After {backoff.asked_s:g} s"
        self._warnings.log(
            self._policy.notice_level(), f"{self.name}-retry", "%s: delivery failed, retrying: %s%s", self.name,
            self.cause, self._policy.keeps,
        )  # fmt: skip
        return self._end(Ended.LEFT) if self._given_up() else self._within_deadline(pause_s)

    def _given_up(self) -> bool:
        return self._source.gave_up() or self.past_deadline()

    def _within_deadline(self, pause_s: float) -> float:
        if self._deadline is None:
            return pause_s
        return max(min(pause_s, self._deadline - self._clock()), 0.0)

    def _end(self, ended: Ended) -> Ended:
        self.ended = ended
        return ended


class _DirectCall(Generic[C]):
    """``send(payload)`` on the delivery's own thread (where the caller bounds it: the journal's
    client has its own timeouts); never ``hung``."""

    hung = False

    def __init__(self, send: Callable[[C], None]) -> None:
        self._send = send

    def __call__(self, payload: C) -> BaseException | None:
        try:
            self._send(payload)
        except Exception as error:  # noqa: BLE001 - classified: retry, drop, wait or stop
            return error
        return None


class DeadlineExceeded(TimeoutError):
    """A call did not return within its deadline; it may still complete later."""


class _DeadlineCall(Generic[C]):
    """``send(payload)`` on a call thread, awaited at most ``deadline_s``, or until ``abandon()``.

    A call past its deadline is not abandoned for a new one: the server may still be working on it,
    and sending the payload again would double its load when it is slowest. The retry of the same
    payload awaits that first call instead (``hung`` meanwhile).
    """

    def __init__(
        self,
        send: Callable[[C], None],
        deadline_s: float,
        name: str,
        stats: DeliveryStats,
        abandon: Callable[[float], bool],
    ) -> None:
        self._send = send
        self._deadline_s = deadline_s
        self._name = name
        self._stats = stats
        self._abandon = abandon
        self._in_flight: _CallThread[C] | None = None  # a call past its deadline, awaited by the retry
        self._warnings = RateLimitedLogger(_logger)

    @property
    def hung(self) -> bool:
        return self._in_flight is not None

    def __call__(self, payload: C) -> BaseException | None:
        in_flight = self._in_flight
        if in_flight is None or in_flight.payload is not payload:
            in_flight = self._start(payload)
        started = time.monotonic()
        deadline = started + self._deadline_s
        while not in_flight.done.wait(0.05):
            if self._abandon(time.monotonic() - started):
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

    def _start(self, payload: C) -> _CallThread[C]:
        call = _CallThread(payload)

        def send() -> None:
            try:
                self._send(payload)
            except BaseException as error:  # noqa: BLE001 - reported to the sender, classified there
                call.error = error
            finally:
                call.done.set()

        threading.Thread(target=send, name=f"{self._name}-call", daemon=True).start()
        return call


@dataclass
class _CallThread(Generic[C]):
    """One ``send(payload)`` running on a call thread."""

    payload: C
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
