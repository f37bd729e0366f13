"""What a failed delivery means (``Outcome``), and how long to wait before trying again (``Backoff``)."""

from __future__ import annotations

import enum
import random
from collections.abc import Callable


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
