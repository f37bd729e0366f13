"""ProgressTracker on a fake clock over real board files: stalls, checkpoints, restarts, the slow rank,
and where the wall time went (goodput), including a hypothesis state machine over any sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from otel_forge.progress.board import Phase, RankBoard, RankIdentity, RankProgress
from otel_forge.progress.tracker import (
    NS,
    Activity,
    ProgressTracker,
    RestartSeen,
    SlowRankNamed,
    StallEnded,
    StallPolicy,
    StallStarted,
)


class Job:
    """Ranks writing boards on one fake clock, and the tracker reading them."""

    def __init__(self, directory: Path, ranks: int = 2, policy: StallPolicy | None = None) -> None:
        self.directory = directory
        self.now = 1_000 * NS
        self.dead: set[int] = set()  # pids
        self.restart = 0
        self.boards = self._boards(ranks)
        self.tracker = ProgressTracker(
            directory, policy or StallPolicy(floor_s=30, factor=10), self.now, lambda: self.now, self._alive
        )

    def _boards(self, ranks: int) -> list[RankBoard]:
        base = 1000 * (self.restart + 1)
        return [
            RankBoard(
                self.directory / f"rank-{r}-{base + r}.bin",
                RankIdentity(base + r, r, r, ranks, self.restart, 0),
                lambda: self.now,
            )
            for r in range(ranks)
        ]

    def _alive(self, rank: RankProgress) -> bool:
        return rank.identity.pid not in self.dead

    def wait(self, seconds: float) -> None:
        self.now += int(seconds * NS)

    def steps(self, count: int, seconds: float = 1.0, slow: dict[int, float] | None = None) -> None:
        """Every rank steps ``count`` times, each step ``seconds``; a slow rank's own work is longer, the
        others wait for it in a collective (as a synchronous job does)."""
        slow = slow or {}
        extra = max(slow.values(), default=0.0)
        for _ in range(count):
            for board in self.boards:
                board.enter_sync()
            self.wait(seconds + extra)
            for rank, board in enumerate(self.boards):
                # the rank's sync began when its own work was done
                board._entered_sync_ns += int((seconds * 0.5 + slow.get(rank, 0.0)) * NS)
                board.leave_sync()
                board.step()

    def checkpoint(self, seconds: float) -> None:
        backs = [board.enter(Phase.CHECKPOINTING) for board in self.boards]
        self.wait(seconds)
        for board, back in zip(self.boards, backs, strict=True):
            board.leave(back)

    def kill(self) -> None:
        self.dead |= {board_pid(board) for board in self.boards}

    def restart_workers(self) -> None:
        self.kill()
        self.restart += 1
        self.boards = self._boards(len(self.boards))

    def look(self):  # type: ignore[no-untyped-def]
        return self.tracker.look()


def board_pid(board: RankBoard) -> int:
    return int(board.path.stem.split("-")[2])


def test_a_stall_is_named_once_past_its_threshold_and_ends_when_a_rank_steps(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.wait(5)
    progress, events = job.look()
    assert progress.activity is Activity.STARTUP and not events
    job.steps(20)
    job.wait(29)
    progress, events = job.look()
    assert progress.activity is Activity.PRODUCTIVE and not events
    assert progress.threshold_s == 30  # the floor: 10 median steps are 10 s
    job.wait(1)
    progress, events = job.look()
    assert progress.activity is Activity.STALLED
    assert [type(e) for e in events] == [StallStarted]
    job.wait(40)
    assert job.look()[1] == []  # said once
    job.steps(1)
    progress, events = job.look()
    (ended,) = events
    assert isinstance(ended, StallEnded) and ended.stall.duration_s(0) == pytest.approx(71)
    assert progress.activity is Activity.PRODUCTIVE
    assert progress.time_s[Activity.STALLED] == pytest.approx(71)
    assert progress.time_s[Activity.STARTUP] == pytest.approx(6)  # to the first step's end
    assert progress.wall_s == pytest.approx(5 + 20 + 70 + 1)


def test_the_threshold_grows_with_the_median_step(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.steps(10, seconds=5.0)
    progress, _ = job.look()
    assert progress.median_step_s == pytest.approx(5.0)
    assert progress.threshold_s == pytest.approx(50.0)
    job.wait(45)
    assert job.look()[0].activity is Activity.PRODUCTIVE


def test_a_checkpoint_longer_than_the_floor_is_no_stall_and_counts_as_checkpointing(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.wait(3)
    job.steps(10)
    backs = [board.enter(Phase.CHECKPOINTING) for board in job.boards]
    for _ in range(10):
        job.wait(10)
        progress, events = job.look()
        assert progress.activity is Activity.CHECKPOINTING and not events
    for board, back in zip(job.boards, backs, strict=True):
        board.leave(back)
    job.steps(10)
    progress, events = job.look()
    assert not events and progress.activity is Activity.PRODUCTIVE
    assert progress.time_s[Activity.CHECKPOINTING] == pytest.approx(100)
    assert progress.time_s[Activity.PRODUCTIVE] == pytest.approx(19)  # the first step ended the start-up
    assert progress.goodput == pytest.approx(19 / 123)


def test_a_restart_loses_the_work_since_the_last_checkpoint(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.steps(10)
    job.checkpoint(4)
    job.steps(7)  # lost: 7 s of work since the checkpoint
    job.restart_workers()
    job.wait(3)
    progress, events = job.look()
    assert isinstance(events[0], RestartSeen) and events[0].lost_s == pytest.approx(7)
    assert progress.activity is Activity.OTHER
    job.steps(5)
    progress, _ = job.look()
    assert progress.time_s[Activity.RESTART_LOST] == pytest.approx(7)
    assert progress.time_s[Activity.CHECKPOINTING] == pytest.approx(4)
    # between the old attempt's last step and the new one's first: its start, and its first step
    assert progress.time_s[Activity.OTHER] == pytest.approx(4)
    assert progress.wall_s == pytest.approx(10 + 4 + 7 + 3 + 5)


def test_a_job_whose_ranks_ended_counts_the_rest_as_other(tmp_path: Path) -> None:
    job = Job(tmp_path)
    job.steps(10)
    job.kill()
    job.wait(6)
    progress, _ = job.look()
    assert progress.activity is Activity.OTHER
    assert progress.time_s[Activity.OTHER] == pytest.approx(6)
    assert progress.time_s[Activity.PRODUCTIVE] == pytest.approx(9)  # the first step is start-up's end


def test_the_slow_rank_is_named_once_it_stays_slow(tmp_path: Path) -> None:
    job = Job(tmp_path, ranks=4)
    named = []
    for _ in range(int(StallPolicy().slow_rank_after_s) + 20):
        job.steps(1, seconds=1.0, slow={2: 0.15})  # rank 2's own work: 0.65 s vs 0.5 s (1.3x)
        progress, events = job.look()
        named += [e for e in events if isinstance(e, SlowRankNamed)]
    (event,) = named
    assert event.rank.rank == 2 and event.rank.work_ratio == pytest.approx(1.3)
    assert progress.slow_rank is not None and progress.slow_rank.rank == 2


def test_a_rank_under_the_ratio_is_not_named(tmp_path: Path) -> None:
    job = Job(tmp_path, ranks=4)
    for _ in range(int(StallPolicy().slow_rank_after_s) + 20):
        job.steps(1, seconds=1.0, slow={2: 0.05})  # 1.1x
        progress, events = job.look()
        assert not [e for e in events if isinstance(e, SlowRankNamed)]
    assert progress.slow_rank is None


@settings(max_examples=40, stateful_step_count=30, deadline=None)
class TrackerMachine(RuleBasedStateMachine):
    """Any mix of steps, waits, checkpoints, restarts and ends: the time adds up, a stall is said once
    and ended once, and the job is stalled exactly when no rank advanced for the threshold."""

    @initialize(directory=st.uuids())
    def start(self, directory: object) -> None:
        import tempfile

        self.job = Job(Path(tempfile.mkdtemp(prefix=f"tracker-{directory}-")))
        self.stalled = False

    @rule(count=st.integers(1, 5), seconds=st.floats(0.1, 3.0))
    def steps(self, count: int, seconds: float) -> None:
        self.job.steps(count, seconds)

    @rule(seconds=st.floats(0.0, 60.0))
    def wait(self, seconds: float) -> None:
        self.job.wait(seconds)

    @rule(seconds=st.floats(1.0, 80.0))
    def checkpoint(self, seconds: float) -> None:
        self.job.checkpoint(seconds)

    @rule()
    def restart(self) -> None:
        self.job.restart_workers()

    @rule()
    def end(self) -> None:
        self.job.kill()

    @invariant()
    def looks_agree(self) -> None:
        if not hasattr(self, "job"):
            return
        progress, events = self.job.look()
        assert progress.wall_s == pytest.approx((self.job.now - self.job.tracker.started_ns) / NS, abs=1e-6)
        assert all(seconds >= -1e-9 for seconds in progress.time_s.values()), progress.time_s
        for event in events:
            if isinstance(event, StallStarted):
                assert not self.stalled
                self.stalled = True
            elif isinstance(event, StallEnded):
                assert self.stalled
                self.stalled = False
        assert self.stalled == (progress.activity is Activity.STALLED)


TestTrackerMachine = TrackerMachine.TestCase
