"""``TrainingWatch``: ``otel-forge run``'s eye on its ranks, once a second.

It keeps the node's latest look (``ProgressTracker``) for the progress metrics, and acts on what
the look finds: a stall takes every rank's stacks, names the odd rank out, and is said on stderr,
tagged on the run with the stacks as an artifact (through the run's journal: an outage loses
nothing), and ended the same way when the training moves again; ``stall_action`` "end" stops the
stalled ranks once the stall has lasted ``stall_action_after_s``. A slow rank is named once. At the
job's end the goodput table goes to the run, and the node's GPU energy (``energy/<host>.json``).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from otel_forge.config import ForgeConfig
from otel_forge.progress.energy import JobEnergy
from otel_forge.progress.stacks import RankStacks, odd_one_out, stacks_report, take_stacks
from otel_forge.progress.tracker import (
    NS,
    Activity,
    JobProgress,
    ProgressTracker,
    RestartSeen,
    SlowRankNamed,
    Stall,
    StallEnded,
    StallPolicy,
    StallStarted,
)

_logger = logging.getLogger(__name__)

LOOK_INTERVAL_S = 1.0
STALL_TAG = "otel_forge.stall"
SLOW_RANK_TAG = "otel_forge.slow_rank"
GOODPUT_ARTIFACT = "goodput.json"
ENERGY_ARTIFACT = "energy/{host}.json"  # one per node: the job's total is their sum
_TERMINATE_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True)
class RunNotes:
    """Where the watch writes into the run: tags, a text artifact, a dict artifact (each journaled)."""

    tags: Callable[[dict[str, str]], None]
    text: Callable[[str, str], None]
    table: Callable[[str, dict[str, object]], None]


class TrainingWatch:
    def __init__(
        self,
        directory: Path,
        config: ForgeConfig,
        host: str,
        notes: RunNotes,
        say: Callable[[str], None],
        interval_s: float = LOOK_INTERVAL_S,
    ) -> None:
        policy = StallPolicy(
            config.stall_floor_s, config.stall_factor, config.slow_rank_ratio, config.slow_rank_after_s
        )
        self.tracker = ProgressTracker(directory, policy)
        self._config = config
        self._host = host
        self._notes = notes
        self._say = say
        self._interval_s = interval_s
        self._latest: JobProgress | None = None
        self.energy = JobEnergy()  # the node's agent adds its GPU readings (its ProgressCollector)
        self._stalls = 0
        self._acted_on: int | None = None  # the stall (its since_ns) the action was taken for
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="otel-forge-training-watch", daemon=True)

    def latest(self) -> JobProgress | None:
        return self._latest

    def start(self) -> TrainingWatch:
        self.look()  # the job's figures are there from the agent's first collect: start-up has begun
        self._thread.start()
        return self

    def stop(self) -> JobProgress | None:
        """Stop looking, after a last look; the goodput table goes to the run where the job stepped."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        final = self.look()
        if final is not None and final.time_s[Activity.STARTUP] < final.wall_s:
            self._notes.table(GOODPUT_ARTIFACT, goodput_table(final))
        if (energy := self.energy.at_end(self._host, final)) is not None:
            self._notes.table(ENERGY_ARTIFACT.format(host=_file_name(self._host)), energy)
        return final

    def _watch(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.look()

    def look(self) -> JobProgress | None:
        try:
            progress, events = self.tracker.look()
        except Exception as error:  # noqa: BLE001 - the watch must outlive a board it cannot read
            _logger.warning("training progress not read: %s", error)
            return self._latest
        suspect = self._latest.suspect_rank if self._latest is not None and progress.stall is not None else None
        progress = dataclasses.replace(progress, suspect_rank=suspect)
        self._latest = progress
        for event in events:
            if isinstance(event, StallStarted):
                self._latest = progress = dataclasses.replace(progress, suspect_rank=self._stalled(event))
            elif isinstance(event, StallEnded):
                self._ended(event)
            elif isinstance(event, SlowRankNamed):
                self._slow(event)
            elif isinstance(event, RestartSeen):
                _logger.info(
                    "torchrun restarted its workers (attempt %d): %.1f s of work lost", event.restart, event.lost_s
                )
        self._act(progress)
        return progress

    def _stalled(self, event: StallStarted) -> int | None:
        self._stalls += 1
        stall = event.stall
        dumps = take_stacks([view.progress for view in event.ranks if view.alive])
        odd = odd_one_out(dumps)
        headline = _stall_line(stall, odd, dumps, self._host, len(event.ranks))
        artifact = f"stalls/stall-{self._stalls}.txt"
        self._say(f"otel-forge: {headline}; every rank's stacks: run artifact {artifact}")
        self._notes.text(artifact, stacks_report(dumps, headline))
        tags = {
            STALL_TAG: headline,
            f"{STALL_TAG}.started": _wall_time(stall.since_ns),
            f"{STALL_TAG}.count": str(self._stalls),
        }
        if odd is not None:
            tags |= {
                f"{STALL_TAG}.rank": str(odd.rank.rank),
                f"{STALL_TAG}.host": self._host,
                f"{STALL_TAG}.step": str(odd.rank.steps),
                f"{STALL_TAG}.where": str(odd.where or "unknown"),
            }
        self._notes.tags(tags)
        return odd.rank.rank if odd is not None else None

    def _ended(self, event: StallEnded) -> None:
        stall = event.stall
        lasted = stall.duration_s(stall.until_ns or time.monotonic_ns())
        how = "the training moves again" if event.resumed else "the stalled ranks ended"
        self._say(f"otel-forge: {how}: the stall lasted {lasted:.0f} s")
        self._notes.tags({f"{STALL_TAG}.ended": _wall_time(stall.until_ns), f"{STALL_TAG}.seconds": f"{lasted:.1f}"})

    def _slow(self, event: SlowRankNamed) -> None:
        view = event.rank
        line = (
            f"rank {view.rank} on host {self._host} is the slow rank: its own work per step is "
            f"{view.work_ratio or 0:.2f}x the median rank's ({view.work_s or 0:.3f} s vs {event.median_work_s:.3f} s)"
        )
        self._say(f"otel-forge: {line}")
        self._notes.tags(
            {SLOW_RANK_TAG: line, f"{SLOW_RANK_TAG}.rank": str(view.rank), f"{SLOW_RANK_TAG}.host": self._host}
        )

    def _act(self, progress: JobProgress) -> None:
        stall = progress.stall
        if self._config.stall_action != "end" or stall is None or self._acted_on == stall.since_ns:
            return
        if (progress.now_ns - stall.since_ns) / NS < self._config.stall_action_after_s:
            return
        self._acted_on = stall.since_ns
        pids = [view.progress.identity.pid for view in progress.ranks if view.alive]
        self._say(
            f"otel-forge: the training stalled for {self._config.stall_action_after_s:.0f} s: stopping its "
            f"{len(pids)} rank(s) (stall_action=end) so that the launcher restarts them"
        )
        threading.Thread(target=_terminate, args=(pids,), name="otel-forge-stall-action", daemon=True).start()


def _terminate(pids: list[int]) -> None:
    for sig, wait_s in ((signal.SIGTERM, _TERMINATE_GRACE_S), (signal.SIGKILL, 0.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                continue
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(_exists(pid) for pid in pids):
            time.sleep(0.2)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _stall_line(stall: Stall, odd: RankStacks | None, dumps: list[RankStacks], host: str, ranks: int) -> str:
    waited = f"no rank advanced for {stall.threshold_s:.0f} s"
    if stall.median_step_s:
        waited += f" (median step {stall.median_step_s:.2f} s)"
    if odd is not None:
        where = f": in {odd.where}" if odd.where else ""
        return (
            f"training stalled: {waited}; rank {odd.rank.rank} on host {host} at step {odd.rank.steps} "
            f"is not in a collective{where}" + (", the others wait for it" if len(dumps) > 1 else "")
        )
    if dumps and all(dump.waiting_in_collective for dump in dumps):
        return (
            f"training stalled: {waited}; all {len(dumps)} rank(s) on host {host} wait in a collective: "
            "the cause is on another node"
        )
    return (
        f"training stalled: {waited}; {len(dumps)} of {ranks} rank(s) on host {host} gave their stacks, none stands out"
    )


def _file_name(host: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", host) or "node"


def _wall_time(monotonic_ns: int | None) -> str:
    """A monotonic time as UTC wall time (ISO 8601)."""
    at = time.time() - (time.monotonic_ns() - (monotonic_ns or time.monotonic_ns())) / NS
    return datetime.datetime.fromtimestamp(at, datetime.timezone.utc).isoformat(timespec="seconds")


def goodput_table(progress: JobProgress) -> dict[str, object]:
    """The job's wall time by activity, as MLflow's table artifacts lay it out (columns, data)."""
    wall = progress.wall_s
    rows = [[activity.value, round(seconds, 3), round(100 * seconds / wall, 2) if wall else 0.0]
            for activity, seconds in progress.time_s.items()]  # fmt: skip
    rows.append(["total", round(wall, 3), 100.0])
    return {"columns": ["activity", "seconds", "percent"], "data": rows}
