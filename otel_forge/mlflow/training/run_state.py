"""The run's states and the events that move it, in one table (``TRANSITIONS``). ``RunStateMachine``
holds the state under one condition: every thread that waits on the run (the opener's pauses, a rank
waiting for rank 0's run, ``TrainingRun.start``) waits on it, and reads nothing else."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable

_logger = logging.getLogger(__name__)


class RunState(enum.Enum):
    IDLE = "idle"  # nothing asked yet: no thread, no I/O
    WAITING_FOR_SCRIPT = "waiting for the script"  # the script may name the experiment yet
    OPENING = "opening"  # asking the server, or waiting for rank 0's run
    UNANSWERED = "unanswered"  # the server does not answer: asked again with backoff until closed
    OPEN = "open"
    CLOSING = "closing"  # close() began: the opener has the drain deadline to finish opening
    # close() stopped waiting for the opener: at most one last attempt, never a new run; a run not
    # open yet is left to the journal's delivery (or a replay), which opens it from the plan.
    LEFT = "left to the delivery"
    ENDED = "ended"  # closed: the run's end is journaled or handed to its delivery
    FAILED = "failed"  # not to be opened here (a missing run, a local store that refuses, no run to attach)


class RunEvent(enum.Enum):
    BEGIN = "begin"  # the run is asked for (with, start(), the first log()); the script's wait is over
    WAIT_FOR_SCRIPT = "wait for the script"
    UNANSWERED = "unanswered"  # an attempt, or a look for rank 0's run, found the server down
    ANSWERED = "answered"  # a look went through; the run is not there yet
    RANK_ZERO = "rank zero"  # this process holds global rank 0: it makes the run, no longer waits for it
    OPENED = "opened"
    REFUSED = "refused"  # the run is not to be opened (or there is none to attach to)
    CLOSE = "close"
    LEAVE = "leave"  # close() waits for the opener no longer
    CLOSED = "closed"


S, E = RunState, RunEvent
# A row per state: the events that move it, and where to. An event a state has no row for leaves it
# as it is (the opener's late answer after close, a second close).
TRANSITIONS: dict[RunState, dict[RunEvent, RunState]] = {
    S.IDLE: {E.BEGIN: S.OPENING, E.WAIT_FOR_SCRIPT: S.WAITING_FOR_SCRIPT, E.CLOSE: S.ENDED},
    S.WAITING_FOR_SCRIPT: {E.BEGIN: S.OPENING, E.CLOSE: S.CLOSING},
    S.OPENING: {E.UNANSWERED: S.UNANSWERED, E.OPENED: S.OPEN, E.REFUSED: S.FAILED, E.CLOSE: S.CLOSING},
    # A server that does not answer is not waited for at close: one last attempt, at once.
    S.UNANSWERED: {E.ANSWERED: S.OPENING, E.OPENED: S.OPEN, E.REFUSED: S.FAILED, E.CLOSE: S.LEFT},
    S.OPEN: {E.CLOSE: S.CLOSING},
    S.FAILED: {E.CLOSE: S.CLOSING},
    S.CLOSING: {E.LEAVE: S.LEFT},  # the opener may still open the run meanwhile: close ends it then
    S.LEFT: {E.CLOSED: S.ENDED},
    S.ENDED: {},
}
del S, E
CLOSED_STATES = (RunState.CLOSING, RunState.LEFT, RunState.ENDED)  # close() has begun


class RunStateMachine:
    """The run's state, moved only by ``fire``; waits wake on every move."""

    def __init__(self, on_move: Callable[[RunState, RunEvent, RunState], None] | None = None) -> None:
        self._cond = threading.Condition()
        self._state = RunState.IDLE
        self._rank_zero_told = 0  # RANK_ZERO events: a pause ends at the next one
        self._on_move = on_move
        self.asked_at: float | None = None  # when the server was first asked (MLflow imported)

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def closed(self) -> bool:
        """close() has begun: nothing more is logged or opened from this process."""
        return self._state in CLOSED_STATES

    @property
    def left(self) -> bool:
        """Nobody waits for the opener any more: its waits end, it makes no new run."""
        return self._state in (RunState.LEFT, RunState.ENDED)

    def fire(self, event: RunEvent) -> RunState:
        """Move on ``event``; the state before it."""
        with self._cond:
            before = self._state
            self._state = TRANSITIONS[before].get(event, before)
            self._rank_zero_told += event is RunEvent.RANK_ZERO
            self._cond.notify_all()
        if self._state is not before:
            _logger.debug("run: %s --%s--> %s", before.value, event.value, self._state.value)
        return before

    def asked(self) -> None:
        """The server is being asked now: ``wait_answer``'s clock starts."""
        if self.asked_at is None:
            self.asked_at = time.monotonic()

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds``, less once the opener is left or this process is known to hold rank 0:
        True then."""
        with self._cond:
            told = self._rank_zero_told
            return self._cond.wait_for(lambda: self._rank_zero_told != told or self.left, seconds)

    def wait_while(self, state: RunState, timeout_s: float) -> bool:
        """Wait until the run leaves ``state``, at most ``timeout_s``; True when it did."""
        with self._cond:
            return self._cond.wait_for(lambda: self._state is not state, timeout_s)

    def wait_answer(self, timeout_s: float) -> bool:
        """Wait while the run is opening, at most ``timeout_s`` once the server is asked (importing
        MLflow is not counted); False when that time ran out."""
        with self._cond:
            while self._state is RunState.OPENING:
                if self.asked_at is not None and time.monotonic() - self.asked_at >= timeout_s:
                    return False
                self._cond.wait(0.05)
        return True
