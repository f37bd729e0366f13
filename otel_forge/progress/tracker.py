"""``ProgressTracker``: the node's view of its ranks' progress, one look at a time.

Each look reads the board and says what the job does now (``Activity``), whether it stalled (no rank
advanced for max(``stall_factor`` median steps, ``stall_floor_s``), no rank checkpointing or
evaluating), which rank is slow (its own work per step against the median rank's), and where the
wall time went since the job started (goodput). Stalls, restarts and the slow rank are also returned
as events, once each. Times are ``time.monotonic_ns()``, the clock the ranks write.
"""

from __future__ import annotations

import enum
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from otel_forge.progress.board import Phase, RankProgress, read_board, start_ticks

NS = 1_000_000_000
_MIN_SAMPLES = 8  # step times a rank needs before it is compared with the others


class Activity(str, enum.Enum):
    STARTUP = "startup"
    PRODUCTIVE = "productive"
    CHECKPOINTING = "checkpointing"
    EVALUATING = "evaluating"
    STALLED = "stalled"
    RESTART_LOST = "restart_lost"
    OTHER = "other"


@dataclass(frozen=True)
class StallPolicy:
    floor_s: float = 120.0
    factor: float = 10.0
    slow_rank_ratio: float = 1.2
    slow_rank_after_s: float = 30.0  # a rank is named slow once it has been the slowest, past the ratio, this long

    def threshold_s(self, median_step_s: float | None) -> float:
        return max(self.floor_s, self.factor * median_step_s) if median_step_s else self.floor_s


@dataclass(frozen=True)
class RankView:
    progress: RankProgress
    alive: bool
    age_s: float  # since its last progress
    p50_s: float | None
    p95_s: float | None
    work_s: float | None
    work_ratio: float | None = None

    @property
    def rank(self) -> int:
        return self.progress.rank


@dataclass(frozen=True)
class Stall:
    since_ns: int  # the job's last progress
    steps: int  # the most steps any rank had taken
    threshold_s: float
    median_step_s: float | None
    until_ns: int | None = None

    def duration_s(self, now_ns: int) -> float:
        return ((self.until_ns or now_ns) - self.since_ns) / NS


@dataclass(frozen=True)
class JobProgress:
    now_ns: int
    ranks: tuple[RankView, ...]  # the current attempt's
    activity: Activity
    median_step_s: float | None
    threshold_s: float
    steps_per_s: float
    time_s: dict[Activity, float]
    stall: Stall | None = None
    slow_rank: RankView | None = None  # named (confirmed) slow rank
    suspect_rank: int | None = None  # the stall's odd rank out, once its stacks named it (the watch's)

    @property
    def wall_s(self) -> float:
        return sum(self.time_s.values())

    @property
    def goodput(self) -> float | None:
        wall = self.wall_s
        return self.time_s[Activity.PRODUCTIVE] / wall if wall > 0 else None

    @property
    def world_size(self) -> int:
        return max((view.progress.identity.world_size for view in self.ranks), default=0)


@dataclass(frozen=True)
class StallStarted:
    stall: Stall
    ranks: tuple[RankView, ...]


@dataclass(frozen=True)
class StallEnded:
    stall: Stall
    resumed: bool  # a rank moved again (else its ranks ended, or the launcher restarted them)


@dataclass(frozen=True)
class SlowRankNamed:
    rank: RankView
    median_work_s: float


@dataclass(frozen=True)
class RestartSeen:
    restart: int
    lost_s: float


Event = StallStarted | StallEnded | SlowRankNamed | RestartSeen


@dataclass
class _Attempt:
    ranks: list[RankProgress] = field(default_factory=list)

    def first_ns(self) -> int | None:
        return min((r.first_step_ns for r in self.ranks if r.first_step_ns), default=None)

    def last_ns(self) -> int:
        return max((r.last_progress_ns for r in self.ranks), default=0)

    def phase_s(self, phase: Phase, now_ns: int, alive: Callable[[RankProgress], bool]) -> float:
        # Ranks checkpoint together: the attempt's time is its longest rank's.
        return max((r.phase_ns(phase, now_ns if alive(r) else r.last_progress_ns) for r in self.ranks), default=0) / NS

    def lost_s(self, stalls: Sequence[Stall] = ()) -> float:
        """Work done since the attempt's last checkpoint (or its first step), less its stalls: what a
        restart redoes."""
        if (first := self.first_ns()) is None:
            return 0.0
        anchor, last = max([first, *(r.checkpoint_end_ns for r in self.ranks)]), self.last_ns()
        stalled = sum(max(0, min(s.until_ns or last, last) - max(s.since_ns, anchor)) for s in stalls)
        return max(0, last - anchor - stalled) / NS


class ProgressTracker:
    def __init__(
        self,
        directory: Path,
        policy: StallPolicy,
        started_ns: int | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
        is_alive: Callable[[RankProgress], bool] | None = None,
    ) -> None:
        self.directory = directory
        self.policy = policy
        self._clock = clock
        self.started_ns = clock() if started_ns is None else started_ns
        self._is_alive = is_alive or _alive
        self._stalls: list[tuple[int, Stall]] = []  # (attempt, stall) ended
        self._stall: tuple[int, Stall] | None = None
        self._stall_phases_s = 0.0  # the ranks' checkpoint and evaluation time when the stall began
        self._restart = -1
        self._slow_candidate: tuple[int, int] | None = None  # (rank, since ns)
        self._slow_named: int | None = None

    def look(self) -> tuple[JobProgress, list[Event]]:
        now = self._clock()
        attempts = _attempts(read_board(self.directory))
        events: list[Event] = []
        current = max(attempts, default=-1)
        if current > self._restart:
            if earlier := [number for number in attempts if number < current]:
                before = max(earlier)
                events.append(RestartSeen(current, attempts[before].lost_s(self._stalls_of(before))))
            self._restart = current
        ranks = attempts[current].ranks if current >= 0 else []
        alive = {id(rank): self._is_alive(rank) for rank in ranks}
        views = tuple(_view(rank, alive[id(rank)], now) for rank in ranks)
        median = _median([v.p50_s for v in views if v.p50_s is not None])
        threshold = self.policy.threshold_s(median)
        activity = self._activity(attempts, current, views, now, threshold)
        events.extend(self._follow_stall(activity, current, views, now, threshold, median))
        views, slow, slow_events = self._slow(views, now)
        events.extend(slow_events)
        time_s = self._time(attempts, current, now)
        steps_per_s = 1 / median if median and activity is Activity.PRODUCTIVE else 0.0
        stall = self._stall[1] if self._stall else None
        progress = JobProgress(now, views, activity, median, threshold, steps_per_s, time_s, stall, slow)
        return progress, events

    def _activity(
        self, attempts: dict[int, _Attempt], current: int, views: Sequence[RankView], now: int, threshold: float
    ) -> Activity:
        live = [v for v in views if v.alive]
        if not live or attempts[current].first_ns() is None:
            first_ever = any(a.first_ns() is not None for a in attempts.values())
            return Activity.OTHER if first_ever else Activity.STARTUP
        if any(v.progress.phase is Phase.CHECKPOINTING for v in live):
            return Activity.CHECKPOINTING
        if any(v.progress.phase is Phase.EVALUATING for v in live):
            return Activity.EVALUATING
        if (now - attempts[current].last_ns()) / NS >= threshold:
            return Activity.STALLED
        return Activity.PRODUCTIVE

    def _follow_stall(
        self, activity: Activity, current: int, views: Sequence[RankView], now: int, threshold: float,
        median: float | None,
    ) -> list[Event]:  # fmt: skip
        if self._stall is None:
            if activity is not Activity.STALLED:
                return []
            since = max(v.progress.last_progress_ns for v in views)
            stall = Stall(since, max(v.progress.steps for v in views), threshold, median)
            self._stall = (current, stall)
            self._stall_phases_s = _phases_s(views, now)
            return [StallStarted(stall, tuple(views))]
        attempt, stall = self._stall
        if activity is Activity.STALLED and attempt == current:
            return []
        moved = [v.progress.last_progress_ns for v in views if v.progress.last_progress_ns > stall.since_ns]
        until = min(moved) if attempt == current and moved else now
        if attempt == current:
            # A checkpoint or an evaluation that began and ended between two looks ended the stall at its start.
            until -= int((_phases_s(views, until) - self._stall_phases_s) * NS)
        ended = Stall(stall.since_ns, stall.steps, stall.threshold_s, stall.median_step_s, until)
        self._stalls.append((attempt, ended))
        self._stall = None
        return [StallEnded(ended, resumed=attempt == current and bool(moved))]

    def _slow(self, views: tuple[RankView, ...], now: int) -> tuple[tuple[RankView, ...], RankView | None, list[Event]]:
        measured = [v for v in views if v.work_s is not None and v.alive]
        if len(measured) < 2:
            self._slow_candidate = None
            return views, None, []
        works = {v.rank: v.work_s for v in measured if v.work_s is not None}
        # Against the median of the *other* ranks: in a job of two, the median of both is halfway to the slow one.
        others = {rank: statistics.median(w for r, w in works.items() if r != rank) for rank in works}
        ratios = {rank: work / others[rank] for rank, work in works.items() if others[rank] > 0}
        median = statistics.median(works.values())
        views = tuple(_with_ratio(v, ratios.get(v.rank)) for v in views)
        slowest = max(ratios, key=lambda rank: ratios[rank], default=None)
        events: list[Event] = []
        if slowest is None or ratios[slowest] < self.policy.slow_rank_ratio:
            self._slow_candidate = None
            self._slow_named = None
        elif self._slow_candidate is None or self._slow_candidate[0] != slowest:
            self._slow_candidate = (slowest, now)
        elif (now - self._slow_candidate[1]) / NS >= self.policy.slow_rank_after_s and self._slow_named != slowest:
            self._slow_named = slowest
            events.append(SlowRankNamed(next(v for v in views if v.rank == slowest), median))
        named = next((v for v in views if v.rank == self._slow_named), None)
        return views, named, events

    def _stalls_of(self, attempt: int) -> list[Stall]:
        return [s for a, s in (*self._stalls, *([self._stall] if self._stall else [])) if a == attempt]

    def _time(self, attempts: dict[int, _Attempt], current: int, now: int) -> dict[Activity, float]:
        time_s = dict.fromkeys(Activity, 0.0)
        order = sorted(attempts)
        firsts = [attempts[a].first_ns() for a in order]
        first_ever = min((f for f in firsts if f is not None), default=None)
        time_s[Activity.STARTUP] = ((first_ever or now) - self.started_ns) / NS
        stalls = [*self._stalls, *([self._stall] if self._stall else [])]
        time_s[Activity.STALLED] = sum(stall.duration_s(now) for _, stall in stalls)
        for index, number in enumerate(order):
            attempt = attempts[number]
            alive = (lambda rank: self._is_alive(rank)) if number == current else (lambda rank: False)
            time_s[Activity.CHECKPOINTING] += attempt.phase_s(Phase.CHECKPOINTING, now, alive)
            time_s[Activity.EVALUATING] += attempt.phase_s(Phase.EVALUATING, now, alive)
            if attempt.first_ns() is None:
                continue
            ended = max([attempt.last_ns(), *(s.until_ns or now for a, s in stalls if a == number)])
            if number != current:
                time_s[Activity.RESTART_LOST] += attempt.lost_s([s for a, s in stalls if a == number])
                following = next((f for f in firsts[index + 1 :] if f is not None), now)
                time_s[Activity.OTHER] += max(0, following - ended) / NS
            elif not any(self._is_alive(rank) for rank in attempt.ranks):
                time_s[Activity.OTHER] += max(0, now - ended) / NS
        wall = (now - self.started_ns) / NS
        time_s[Activity.PRODUCTIVE] = max(0.0, wall - sum(time_s.values()))
        return time_s


def _phases_s(views: Sequence[RankView], at_ns: int) -> float:
    """The ranks' checkpoint and evaluation time up to ``at_ns`` (the longest rank's, as ``_Attempt``)."""
    return (
        max(
            (
                sum(v.progress.phase_ns(phase, at_ns) for phase in (Phase.CHECKPOINTING, Phase.EVALUATING))
                for v in views
            ),
            default=0,
        )
        / NS
    )


def _attempts(ranks: Sequence[RankProgress]) -> dict[int, _Attempt]:
    """The ranks by torchrun attempt, the latest process of each rank in each."""
    latest: dict[tuple[int, int], RankProgress] = {}
    for rank in ranks:
        key = (rank.identity.restart, rank.rank)
        if key not in latest or rank.started_ns > latest[key].started_ns:
            latest[key] = rank
    attempts: dict[int, _Attempt] = {}
    for (restart, _), rank in sorted(latest.items()):
        attempts.setdefault(restart, _Attempt()).ranks.append(rank)
    return attempts


def _alive(rank: RankProgress) -> bool:
    return start_ticks(rank.identity.pid) == rank.identity.start_ticks


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _quantile(values: Sequence[int], q: float) -> float | None:
    if len(values) < 1:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / NS


def _view(rank: RankProgress, alive: bool, now: int) -> RankView:
    durations, work = rank.durations_ns, rank.work_ns
    return RankView(
        rank,
        alive,
        (now - rank.last_progress_ns) / NS if rank.last_progress_ns else 0.0,
        _quantile(durations, 0.5),
        _quantile(durations, 0.95),
        statistics.median(work) / NS if len(work) >= _MIN_SAMPLES else None,
    )


def _with_ratio(view: RankView, ratio: float | None) -> RankView:
    return RankView(view.progress, view.alive, view.age_s, view.p50_s, view.p95_s, view.work_s, ratio)
