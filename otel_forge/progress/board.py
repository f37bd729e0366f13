"""The progress board: one small memory-mapped file per rank, written by that rank, read by the node.

A rank's file is ``<board>/rank-<RANK>-<pid>.bin``: a header (who wrote it) and a live part (its
steps, its phase, a ring of its last step times) under a sequence number that is odd while the rank
writes (a seqlock: the reader retries a torn read, the writer never waits). A step is a handful of
``struct.pack_into`` calls into the page cache: no system call, no lock shared with another process.
Times are ``time.monotonic_ns()``, one clock for every process on the host.
"""

from __future__ import annotations

import enum
import mmap
import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"OFPB"
VERSION = 1
RING = 64  # the step times a rank keeps: enough for a median and a p95

# magic, version, pid, rank, local_rank, world_size, restart, started_ns, start_ticks (/proc stat)
_HEADER = struct.Struct("<4sIqqqqqqq")
# seq, steps, logged_step, first_step_ns, last_step_ns, last_progress_ns, phase, phase_since_ns,
# checkpoint_ns, evaluation_ns, sync_ns (this step so far), ring_count, checkpoint_end_ns
_LIVE = struct.Struct("<Qqqqqqqqqqqqq")
_ENTRY = struct.Struct("<qq")  # a step's duration and its own work (outside collectives and backward)
_LIVE_AT = _HEADER.size
_RING_AT = _LIVE_AT + _LIVE.size
SIZE = _RING_AT + RING * _ENTRY.size
_SEQ = struct.Struct("<Q")
# faulthandler writes a rank's stacks on this signal. A realtime one: no launcher or framework we know
# uses it (SLURM and Lightning take SIGUSR1, submitit SIGUSR2); sent only to a rank that made a board.
STACKS_SIGNAL = signal.SIGRTMIN + 7


class Phase(enum.IntEnum):
    """What a rank is doing between its steps, as far as it told us."""

    TRAINING = 0
    CHECKPOINTING = 1
    EVALUATING = 2


@dataclass(frozen=True)
class RankIdentity:
    pid: int
    rank: int
    local_rank: int
    world_size: int
    restart: int  # torchrun's restart count: a new attempt's workers write new files
    start_ticks: int  # the process's start in clock ticks since boot: a reused pid is not this rank


def start_ticks(pid: int | str = "self") -> int:
    """Field 22 of ``/proc/<pid>/stat`` (the start since boot), 0 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


class RankBoard:
    """A rank's own file, mapped: ``step()`` after each optimizer step, phases around checkpoints."""

    def __init__(self, path: Path, identity: RankIdentity, clock: Callable[[], int] = time.monotonic_ns) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.path = path
        self._lock = threading.Lock()  # a checkpoint thread and the loop may write at once
        self._seq = 0
        self._clock = clock
        now = clock()
        self._live = [0, -1, 0, 0, 0, 0, Phase.TRAINING, now, 0, 0, 0, 0, 0]
        self._entered_sync_ns = 0
        self._sync_depth = 0
        self._phases_at_step = 0  # checkpoint and evaluation time at the last step
        _HEADER.pack_into(self._map, 0, MAGIC, VERSION, identity.pid, identity.rank, identity.local_rank,
                          identity.world_size, identity.restart, now, identity.start_ticks)  # fmt: skip
        self._write()

    def _write(self) -> None:
        self._seq += 1  # odd while the fields change: a reader retries
        self._live[0] = self._seq
        _LIVE.pack_into(self._map, _LIVE_AT, *self._live)
        self._seq += 1
        _SEQ.pack_into(self._map, _LIVE_AT, self._seq)

    def step(self) -> None:
        """One optimizer step: the count, its time, its duration and the rank's own share of it."""
        now = self._clock()
        with self._lock:
            live = self._live
            if live[1] > 0:
                # A checkpoint or an evaluation between two steps is not the step's time.
                duration = now - live[4] - (live[8] + live[9] - self._phases_at_step)
                index = live[11] % RING
                _ENTRY.pack_into(self._map, _RING_AT + index * _ENTRY.size, duration, max(0, duration - live[10]))
                live[11] += 1
            else:
                live[1] = 0
                live[3] = now
            live[1] += 1
            live[4] = live[5] = now
            live[10] = 0
            self._phases_at_step = live[8] + live[9]
            self._write()

    def logged(self, step: int) -> None:
        """A step the script logged (``TrainingRun.log``, ``mlflow.log_metric(step=)``)."""
        with self._lock:
            live = self._live
            if step > live[2] or live[1] < 0:
                live[2] = step
                live[5] = self._clock()
                if live[1] < 0:
                    live[1] = 0
                if not live[3]:
                    live[3] = live[5]  # a script that only logs: its first logged step is its first step
                self._write()

    def enter_sync(self) -> None:
        """A collective (or a backward, where DDP's collectives run) begins: its time is not the rank's own."""
        if self._sync_depth == 0:
            self._entered_sync_ns = self._clock()
        self._sync_depth += 1

    def leave_sync(self) -> None:
        self._sync_depth -= 1
        if self._sync_depth == 0:
            self._live[10] += self._clock() - self._entered_sync_ns

    def enter(self, phase: Phase) -> Phase:
        """The rank checkpoints or evaluates from now; returns the phase to go back to."""
        with self._lock:
            before = Phase(self._live[6])
            if before is not phase:
                self._switch(phase)
            return before

    def leave(self, back_to: Phase) -> None:
        with self._lock:
            if self._live[6] != back_to:
                self._switch(back_to)

    def _switch(self, phase: Phase) -> None:
        live, now = self._live, self._clock()
        # Before the first step a checkpoint or evaluation is part of the start-up.
        spent = now - max(live[7], live[3]) if live[3] else 0
        if live[6] == Phase.CHECKPOINTING:
            live[8] += spent
            live[12] = now
        elif live[6] == Phase.EVALUATING:
            live[9] += spent
        live[6], live[7] = int(phase), now
        live[5] = now  # leaving or entering a phase is progress too
        if live[1] < 0:
            live[1] = 0
        self._write()

    def close(self) -> None:
        self._map.close()


@dataclass(frozen=True)
class RankProgress:
    """One rank as the node reads it. ``steps`` is -1 until the rank stepped or logged."""

    identity: RankIdentity
    path: Path
    started_ns: int
    steps: int
    logged_step: int
    first_step_ns: int
    last_step_ns: int
    last_progress_ns: int
    phase: Phase
    phase_since_ns: int
    checkpoint_ns: int
    evaluation_ns: int
    checkpoint_end_ns: int  # when its last checkpoint ended (0: none yet)
    durations_ns: tuple[int, ...]  # the last step durations, oldest first
    work_ns: tuple[int, ...]  # each one's own work

    @property
    def rank(self) -> int:
        return self.identity.rank

    def phase_ns(self, phase: Phase, now_ns: int) -> int:
        """Time spent in ``phase`` so far, the current stretch included."""
        total = self.checkpoint_ns if phase is Phase.CHECKPOINTING else self.evaluation_ns
        if self.phase is not phase or not self.first_step_ns:
            return total
        return total + max(0, now_ns - max(self.phase_since_ns, self.first_step_ns))


def read_rank(path: Path, attempts: int = 100) -> RankProgress | None:
    """The rank's file as it stands, or None (not a board file, or still being created). One read
    is one copy that a write may cross: two alike, at an even sequence number, are one state."""
    before = b""
    for _ in range(attempts):
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) < SIZE or data[:4] != MAGIC:
            return None
        if data == before and _SEQ.unpack_from(data, _LIVE_AT)[0] % 2 == 0:
            return _decode(path, data)
        before = data
    return None


def _decode(path: Path, data: bytes) -> RankProgress:
    _, _, pid, rank, local_rank, world, restart, started, ticks = _HEADER.unpack_from(data, 0)
    live = _LIVE.unpack_from(data, _LIVE_AT)
    count = live[11]
    at = [_RING_AT + (i % RING) * _ENTRY.size for i in range(max(0, count - RING), count)]
    entries = [_ENTRY.unpack_from(data, offset) for offset in at]
    return RankProgress(
        RankIdentity(pid, rank, local_rank, world, restart, ticks), path, started, live[1], live[2], live[3],
        live[4], live[5], Phase(live[6]), live[7], live[8], live[9], live[12],
        tuple(d for d, _ in entries), tuple(w for _, w in entries),
    )  # fmt: skip


def read_board(directory: Path) -> list[RankProgress]:
    """Every rank file in ``directory``, the latest attempt's and the earlier ones'."""
    try:
        paths = sorted(directory.glob("rank-*.bin"))
    except OSError:
        return []
    return [rank for path in paths if (rank := read_rank(path)) is not None]


def rank_file(directory: Path, rank: int, pid: int) -> Path:
    return directory / f"rank-{rank}-{pid}.bin"
