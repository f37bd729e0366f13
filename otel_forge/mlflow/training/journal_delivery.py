"""``JournalDelivery``: a run's journal delivered into its run by a process that is not the one writing
it: the node's sampler process, the ``otel-forge run`` process, a delivery process of its own, or
``otel-forge replay`` (the same delivery, later).

The journal is the ``Delivery`` engine's source (``JournalSource``: tailing, batching, the cursor,
the run's end); the engine sends its calls and treats failures as it does the windows': retried
after a pause (``Backoff``: jittered, never shorter than a server's ``Retry-After``) for an outage, an
overloaded server, a refused credential or certificate; dropped for a value the server refuses; the
end of delivery where the run is gone. Here: the journal's lock, its removal once all is delivered,
and the line naming what is kept where it is not. ``step`` is one move of the engine; the simulation
test steps it on a fake clock (``DeliveryWorld``).
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.client import classify, outage_cause, refuses_connections, unanswered_reason
from otel_forge.mlflow.delivery.engine import Delivery, Ended, Policy
from otel_forge.mlflow.delivery.retry import Backoff, Outcome
from otel_forge.mlflow.spool_files import SpoolBusy, claim, kept_notice_level
from otel_forge.mlflow.training.delivery_world import REAL_WORLD, DeliveryWorld
from otel_forge.mlflow.training.journal_cursor import Cursor, undelivered, wait_described
from otel_forge.mlflow.training.journal_run import JournalRun, RunNotOpenYet
from otel_forge.mlflow.training.journal_source import POLL_S, JournalSource
from otel_forge.mlflow.training.journal_tail import METRICS, JournalTail
from otel_forge.mlflow.training.run_journal import RunEnd, read_header
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.scrub import uri_without_credentials

_logger = logging.getLogger(__name__)

__all__ = ["Delivered", "DeliveryPace", "DeliveryWorld", "JournalDelivery", "wait_described"]

_BACKOFF_S = (0.5, 10.0)  # as the windows': first pause, longest pause


class Delivered(enum.Enum):
    """How a delivery ended."""

    ALL = "all"  # everything, the run's end included: the journal is removed
    LEFT = "left"  # given up (deadline, patience, the run gone): the journal stays for replay
    BUSY = "busy"  # another process delivers this journal


@dataclass(frozen=True)
class DeliveryPace:
    """How often values go (``flush_interval_s``), the journal is forced to disk (``fsync_s``, 0: never),
    and how long a delivery tries once its writer is gone (``patience_s``)."""

    flush_interval_s: float = 1.0
    fsync_s: float = 1.0
    patience_s: float = 600.0

    @classmethod
    def of(cls, config: ForgeConfig) -> DeliveryPace:
        return cls(config.flush_interval_s, config.journal_fsync_s, config.delivery_patience_s)


class JournalDelivery:
    """Delivers the journal in ``directory`` until the run is ended, or it gives up.

    ``tracking_uri``: the one to deliver to (the journal records it without credentials).
    ``on_run``: called once the run is known (the sampler's windows go there too).
    ``job_run``: where the journal's plan leaves the run to its launcher (``otel-forge run``), the
    launcher's run, once it knows it. ``caller_reports``: the caller says what was delivered and what
    is kept (a replay), so the delivery's own lines about it are INFO. ``on_delivered``: told the
    count after each call that delivered values.
    """

    def __init__(
        self,
        directory: Path,
        *,
        tracking_uri: str | None = None,
        pace: DeliveryPace = DeliveryPace(),
        on_run: Callable[[OpenRun], None] | None = None,
        job_run: Callable[[], str | None] | None = None,
        caller_reports: bool = False,
        on_delivered: Callable[[int], None] | None = None,
        world: DeliveryWorld = REAL_WORLD,
    ) -> None:
        self.directory = directory
        self._caller_reports = caller_reports
        header = read_header(directory)
        self._world = world
        cursor = Cursor.load(directory)
        tail = JournalTail(directory, cursor.offset, lambda: world.writer_alive(header), world.clock, pace.fsync_s)
        uri = tracking_uri or header.get("tracking_uri")
        run = JournalRun(uri, cursor, lambda: self._source.save(), world, on_run, job_run, directory)
        self._source = JournalSource(
            directory, tail, cursor, run, clock=world.clock, flush_interval_s=pace.flush_interval_s,
            patience_s=pace.patience_s, on_delivered=on_delivered,
        )  # fmt: skip
        policy = Policy(
            classify=lambda error: Outcome.WAIT if isinstance(error, RunNotOpenYet) else classify(error),
            describe=lambda error: outage_cause(error, run.experiment) or unanswered_reason(error),
            hopeless_at_close=refuses_connections,
            # No deadline of its own (the client's timeouts bound a call), but a call that hangs at a
            # close is left at the close's deadline, not awaited until the client gives up (a SIGTERM's
            # exit within the scheduler's grace).
            call_deadline_s=math.inf,
            backoff=Backoff(*_BACKOFF_S, asked=lambda error: world.asked_pause(uri, error)),
            poll_s=POLL_S,
            keeps=f"; everything is kept in {directory}",
            notice_level=self._notice_level,
            finish_while_answered=True,
        )
        name = f"MLflow at {self.where}"
        self._delivery = Delivery(self._source, self._source.send, name=name, policy=policy, clock=world.clock)

    @classmethod
    def for_config(cls, directory: Path, config: ForgeConfig, tracking_uri: str, **hooks: Any) -> JournalDelivery:
        """A delivery by the settings (flush interval, fsync interval, patience)."""
        return cls(directory, tracking_uri=tracking_uri, pace=DeliveryPace.of(config), **hooks)

    # --- control, from any thread ---------------------------------------------------------

    def finish(self, deadline_s: float, end: RunEnd | None = None) -> None:
        """Deliver what is there within ``deadline_s``, then stop (the journal keeps what is left).
        ``end``: the run's end as its writer ended it, where the journal could not keep it."""
        self._source.run.told_end = end
        if end is not None:
            self._source.tail.writer_closed = True  # it appends nothing more: its end is what we were told
        self._delivery.finish(deadline_s)

    @property
    def run_id(self) -> str | None:
        open_run = self._source.run.open_run
        return open_run.run_id if open_run is not None else None

    @property
    def ended(self) -> str | None:
        """The status the run was ended with, once it was."""
        return self._source.run.ended

    @property
    def plan(self) -> dict[str, Any]:
        """How the journal's writer asked for its run (experiment, job key, node)."""
        return self._source.cursor.plan

    @property
    def delivered_values(self) -> int:
        return self._source.delivered_values

    @property
    def answered_past_deadline(self) -> bool:
        """A call went through after ``finish``'s deadline: the delivery goes on while the server answers."""
        return self._delivery.answered_past_deadline

    @property
    def cause(self) -> str | None:
        """Why the last call failed, when it did."""
        return self._delivery.cause

    # --- the delivery's thread ------------------------------------------------------------

    def run(self) -> Delivered:
        """Deliver until the run is ended (``ALL``) or it gives up (``LEFT``); ``BUSY`` at once when
        another process holds the journal."""
        try:
            lock = claim(self.directory)
        except SpoolBusy:
            return Delivered.BUSY
        with lock:
            try:
                outcome = _delivered(self._delivery.run())
            finally:
                self.close()
        if outcome is Delivered.ALL:
            self._remove()
        else:
            self.say_left()
        return outcome

    def close(self) -> None:
        """Let go of the journal's files (``run`` does, at its end)."""
        self._source.tail.close()

    def step(self) -> float | Delivered:
        """One move of the engine: how long to wait before the next (0: at once), or how it ended."""
        result = self._delivery.step()
        return _delivered(result) if isinstance(result, Ended) else result

    # --- the end of the delivery ----------------------------------------------------------

    def pending_values(self) -> int:
        """The metric values in the journal past what is delivered (those held in memory included)."""
        try:
            return undelivered(self.directory, self._source.cursor.offset).values
        except OSError:
            return sum(1 for item in self._source.tail.items if item.kind == METRICS)

    def _remove(self) -> None:
        import shutil

        shutil.rmtree(self.directory, ignore_errors=True)

    def say_left(self) -> None:
        """The one line naming what is kept in the journal, and the command that delivers it."""
        cause = f" ({self.cause})" if self.cause else ""
        _logger.log(
            self._notice_level(),
            "MLflow: %s were not delivered to %s%s; they are kept in %s. Deliver them with: otel-forge replay %s",
            self._undelivered(), self.where, cause, self.directory, self.directory,
        )  # fmt: skip

    def say_going_on(self, pid: int) -> None:
        """The one line for a delivery that goes on past the close's deadline in process ``pid``."""
        _logger.log(
            self._notice_level(),
            "MLflow: %s are still being delivered to %s: the otel-forge companion (pid %d) goes on after this "
            "process exits; what it cannot deliver stays in %s (otel-forge replay %s)",
            self._undelivered(), self.where, pid, self.directory, self.directory,
        )  # fmt: skip

    def _undelivered(self) -> str:
        """What the journal holds past its cursor, in words: values, the run's end, of which run."""
        end = "" if self.ended else " and the run's end"
        return f"{self.pending_values()} metric value(s){end} of run {self.run_id or '(not opened yet)'}"

    def _notice_level(self) -> int:
        source = self._source
        if source.run.open_run is None and source.run.opens_for_writer and not source.tail.writer_done:
            return logging.DEBUG  # its writer waits for the run we open, and says why there is none yet
        return logging.INFO if self._caller_reports else kept_notice_level(self.directory)

    @property
    def where(self) -> str:
        return uri_without_credentials(self._source.run.uri or "")


def _delivered(ended: Ended) -> Delivered:
    return Delivered.ALL if ended is Ended.ALL else Delivered.LEFT
