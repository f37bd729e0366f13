"""The journal's delivery, simulated: hypothesis's stateful testing drives a training process that
logs, opens its run, closes or dies, a disk that fills and frees, a tracking server that is down,
refuses (401, 403, 429 with Retry-After, 500) or applies a call and loses its answer, and delivery
processes that die and are started again, over a fake clock (``JournalDelivery.step``), with the
real journal, tail, cursor and delivery code, and an in-memory server (``sim_server``).

After every example, with the server answering and the disk free, whatever is left is replayed to
its end, and then: every value whose ``log()`` reported no drop is in the run exactly once, in step
order per key, and no other; the run ended with the status the job earned; the drops are the
count the run's tag holds (with the values the server refused, each dropped alone). A few hundred
examples in the fast tier; thousands in the slow one (``SIMULATION_EXAMPLES`` sets the fast tier's).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule
from sim_server import EXPERIMENT, EXPERIMENT_ID, Health, SimServer

from otel_forge.journal import writer as journal_writer
from otel_forge.mlflow.training.journal_delivery import Delivered, DeliveryPace, DeliveryWorld, JournalDelivery
from otel_forge.mlflow.training.run_journal import JOURNAL_FILE, RunEnd, RunJournal
from otel_forge.mlflow.training.run_metadata import REJECTED_TAG
from otel_forge.mlflow.training.run_source import RunSource
from otel_forge.node import NodeIdentity

EXAMPLES = int(os.environ.get("SIMULATION_EXAMPLES", "200"))
DEADLINE_S = 10.0  # the drain deadline a close gives its delivery
REPLAY_STEPS = 20_000  # a replay that has not ended by then does not move


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Disk:
    full: bool = False


class DeliverySimulation(RuleBasedStateMachine):
    """One training process's run, its journal and its deliveries."""

    @initialize()
    def begin(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="otel-forge-sim-"))
        self.server = SimServer()
        self.run_id = self.server.create_run()  # the run the plan names (MLFLOW_RUN_ID)
        self.clock = FakeClock()
        self.disk = Disk()
        real_write = journal_writer._write_at

        def write_at(fd: int, data: bytes, offset: int) -> None:
            if self.disk.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write(fd, data, offset)

        self._patch = mock.patch.object(journal_writer, "_write_at", write_at)
        self._patch.start()
        self.journal = RunJournal.create(self.root, "sim://server")
        self.directory = self.journal.directory
        self.journal.plan(_plan(self.run_id))
        self.journal.describe({"records": [["tags", {"sim.described": "yes"}]], "creation_tags": {}})
        self.alive, self.closed, self.opened = True, False, False
        self.earned: str | None = None  # the status the job earned
        self.end_known = False  # the delivery knows the run's end and its count of drops (journaled, or told)
        self.told_end: RunEnd | None = None  # an end the journal could not keep, told to the delivery
        self.acked: list[tuple[str, int, float]] = []  # every value whose log() did not report a drop
        self.dropped = 0
        self.next_step = 0
        self.outcome: Delivered | None = None
        self.delivery = self._new_delivery()

    def _new_delivery(self, patience_s: float = 600.0) -> JournalDelivery:
        world = DeliveryWorld(
            clock=self.clock,
            make_client=lambda uri: self.server.client(),
            writer_alive=lambda header: self.alive,
            asked_pause=lambda uri, error: self.server.retry_after(error),
            check_connects=lambda uri: None,
        )
        pace = DeliveryPace(flush_interval_s=1.0, fsync_s=0.0, patience_s=patience_s)
        return JournalDelivery(self.directory, tracking_uri="sim://server", pace=pace, world=world)

    # --- the training process -------------------------------------------------------------

    @precondition(lambda self: self.alive and not self.closed)
    @rule(width=st.integers(1, 3))
    def log(self, width: int) -> None:
        step = self.next_step
        self.next_step += 1
        values = {f"k{i}": step * 10.0 + i for i in range(width)}
        try:
            self.journal.metrics(values, step, int(self.clock() * 1000))
        except OSError:
            self.dropped += width
            return
        self.acked += [(key, step, value) for key, value in values.items()]

    @precondition(lambda self: self.alive and not self.closed and not self.opened)
    @rule()
    def open_run(self) -> None:
        if self.server.health is Health.UP:  # the training process's opener got its answer
            self.opened = self.journal.opened(
                {"run_id": self.run_id, "experiment": EXPERIMENT, "experiment_id": EXPERIMENT_ID, "describe": False}
            )

    @precondition(lambda self: self.alive and not self.closed)
    @rule(status=st.sampled_from(["FINISHED", "FAILED", "KILLED"]))
    def close(self, status: str) -> None:
        self.closed, self.earned, self.end_known = True, status, True
        if not self.journal.end(status, self.dropped):
            self.told_end = RunEnd(status, self.dropped)
        self.delivery.finish(DEADLINE_S, self.told_end)
        self.alive = False  # the script's end follows its close

    @precondition(lambda self: self.alive and not self.closed)
    @rule()
    def die(self) -> None:
        self.alive, self.earned = False, "KILLED"

    # --- the world ------------------------------------------------------------------------

    @rule(health=st.sampled_from(list(Health)))
    def server_becomes(self, health: Health) -> None:
        self.server.health = health

    @rule(full=st.booleans())
    def disk_becomes(self, full: bool) -> None:
        self.disk.full = full

    @precondition(lambda self: self.outcome is None)
    @rule(steps=st.integers(1, 40))
    def deliver(self, steps: int) -> None:
        for _ in range(steps):
            result = self.delivery.step()
            if isinstance(result, Delivered):
                self.outcome = result
                if result is Delivered.LEFT:
                    self._lose_told_end()  # the delivery process exits: what it was told goes with it
                return
            self.clock.now += result

    def _lose_told_end(self) -> None:
        if self.told_end is not None and self.delivery.ended is None:  # not delivered yet
            self.told_end, self.earned, self.end_known = None, "KILLED", False

    @precondition(lambda self: self.outcome is None)
    @rule()
    def delivery_process_dies(self) -> None:
        """The companion is killed: during the job a new one takes the journal on from its cursor;
        after the close none does, and the journal waits for a replay. An end the journal could not
        keep, told to the dead one, is lost with it: the run ends KILLED."""
        self.delivery.close()
        if self.closed:
            self.outcome = Delivered.LEFT
        else:
            self.delivery = self._new_delivery()
        self._lose_told_end()

    # --- the end --------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if hasattr(self, "server"):
                self.delivery.close()
                self._replay_and_check()
        finally:
            if hasattr(self, "_patch"):
                self._patch.stop()
                self.journal._writer.close()
                shutil.rmtree(self.root, ignore_errors=True)

    def _replay_and_check(self) -> None:
        self.server.health, self.disk.full = Health.UP, False
        if self.alive:
            self.alive, self.earned = False, "KILLED"  # the job ends without a close
        if self.outcome is not Delivered.ALL and (self.directory / JOURNAL_FILE).exists():
            replay = self._new_delivery(patience_s=0.0)
            if self.told_end is not None:
                replay.finish(DEADLINE_S * 100, self.told_end)  # the companion that was told, at leisure
            for _ in range(REPLAY_STEPS):
                result = replay.step()
                if isinstance(result, Delivered):
                    break
                self.clock.now += result
            replay.close()
            assert result is Delivered.ALL, f"the replay ended {result}, the server answering"
        run, refused = self.server.runs[self.run_id], self.server.refused
        for key in {key for key, _, _ in self.acked} | set(run.metrics):
            sent = [(step, value) for step, _, value in run.metrics.get(key, [])]
            expected = [(step, value) for k, step, value in self.acked if k == key and (k, step, value) not in refused]
            assert sent == expected, f"{key}: in the run {sent[:10]}..., logged and not refused {expected[:10]}..."
        assert run.status == self.earned
        if self.end_known:  # every drop is counted: the training process's, and the server's refusals
            assert run.tags.get(REJECTED_TAG, "0") == str(self.dropped + len(refused))


def _plan(run_id: str) -> dict:
    node = NodeIdentity(None, None, None, None, None, None, "sim-host")
    return {
        "tracking_uri": "sim://server", "experiment": EXPERIMENT, "experiment_id": EXPERIMENT_ID,
        "source": RunSource.given(run_id).entry(), "run_name": None, "named": None, "tags": {},
        "node": dataclasses.asdict(node), "attempt_environ": {},
    }  # fmt: skip


SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestDeliverySimulation = DeliverySimulation.TestCase
TestDeliverySimulation.settings = SETTINGS


@pytest.mark.slow
def test_a_thousand_examples_in_the_slow_tier():
    """The same simulation, longer (the fast tier runs ``EXAMPLES``)."""
    from hypothesis.stateful import run_state_machine_as_test

    run_state_machine_as_test(DeliverySimulation, settings=settings(SETTINGS, max_examples=max(EXAMPLES, 1_000)))
