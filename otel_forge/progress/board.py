"""The progress board: one small memory-mapped file per rank, written by that rank, read by the node.

A rank's file is ``<board>/rank-<RANK>-<pid>.bin``: a header (who wrote it) and a live part (its
steps, its phase, a ring of its last step times). A phase or a logged step is written under a sequence
number that is odd meanwhile (a seqlock: the reader retries a torn read, the writer never waits); a
step writes its time before the count that makes it read. A step is two 64-bit stores into the
page cache: no system call, no lock shared with another process.
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
VERSION = 3
RING = 130  # steps kept: 129 read (128 durations, 8 of them timed), and the next step's

# magic, version, pid, rank, local_rank, world_size, restart, started_ns, start_ticks (/proc stat): 8 slots
_HEADER = struct.Struct("=4sIqqqqqqq")
# The live part: 64-bit slots after the header, written through a memoryview; native byte order, as one
# host writes and reads them. Then three rings of RING entries, by the step count: each step's time (all a
# step stores, then the count that makes it read), and what the interval after a count was not the rank's
# own work, each entry a tag (count + 1: an entry from an earlier lap is not this count's) and a time: its
# waits for the peers (collectives, backward), written by the step that ends the interval, and its
# checkpoints and evaluations, written by the phases (a checkpoint's thread may write them meanwhile).
(SEQ, STEPS, LOGGED, LOGGED_NS, FIRST_NS, PHASE, PHASE_SINCE_NS, CHECKPOINT_NS, EVALUATION_NS,
 CHECKPOINT_END_NS, WAITS_EVERY) = range(_HEADER.size // 8, _HEADER.size // 8 + 11)  # fmt: skip
_STEP_TIMES = WAITS_EVERY + 1
_WAITS = _STEP_TIMES + RING
_PHASES = _WAITS + 2 * RING
SIZE = (_PHASES + 2 * RING) * 8
# faulthandler writes a rank's stacks on this signal. A realtime one: no launcher or framework we know
# uses it (SLURM and Lightning take SIGUSR1, submitit SIGUSR2); sent only to a rank that made a board.
STACKS_SIGNAL = signal.SIGRTMIN + 7
# A rank's backward passes are timed as waits for its peers in one step of this many (a power of two):
# a Python wrapper around every backward, and its swap in and out, would cost the training ~1 µs a step,
# one in 16 a sixteenth of it. A median of own work needs no more than the 8 steps in a ring that this leaves.
WAITS_EVERY_STEPS = 16


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
    """A rank's own file, mapped: ``step()`` after each optimizer step, phases around checkpoints.
    Each write is bracketed by the sequence number: odd while the slots change, a reader retries."""

    def __init__(self, path: Path, identity: RankIdentity, clock: Callable[[], int] = time.monotonic_ns) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, SIZE)
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.path = path
        self._lock = threading.Lock()  # a checkpoint thread and the loop may write at once
        self._clock = clock
        now = clock()
        _HEADER.pack_into(self._map, 0, MAGIC, VERSION, identity.pid, identity.rank, identity.local_rank,
                          identity.world_size, identity.restart, now, identity.start_ticks)  # fmt: skip
        self._q = q = memoryview(self._map).cast("q")
        q[PHASE], q[PHASE_SINCE_NS] = Phase.TRAINING, now
        self._entered_sync_ns = 0
        self.sync_depth = 0  # waits nested in a wait are the outer one's
        self.sync_ns = 0  # the waits of the interval since the last step, that step writes
        self.step = self._stepper(None)

    def time_waits_with(self, time_waits: Callable[[bool], None]) -> None:
        """From now on ``time_waits(True)`` after one step in ``WAITS_EVERY_STEPS``, ``time_waits(False)``
        after the next: between the two, the rank's waits are timed (the reader takes its own work from
        those steps alone). A new ``step``: the one taken before it is no longer called."""
        self._q[WAITS_EVERY] = WAITS_EVERY_STEPS
        self.step = self._stepper(time_waits)

    def _stepper(self, time_waits: Callable[[bool], None] | None) -> Callable[..., None]:
        """``step``: one optimizer step (also PyTorch's step hook itself: its arguments are ignored). A
        closure over the map (locals, not attributes: a tenth of their cost) that stores two slots (a
        memoryview's item costs ~300 instructions): the step's time, then the count that makes it read;
        and before that count, where the interval that ends waited for the peers, its waits.
        No lock and no sequence number: the loop's thread alone steps (a reader's copy holds either count,
        each with its time; the reader asks for two copies alike, which a store that is late to show cannot
        give); the next step's slot is never read."""
        q, clock, mask, board = self._q, self._clock, WAITS_EVERY_STEPS - 1, self
        steps = q[STEPS]  # the count this process wrote: only this closure writes STEPS

        def step(_optimizer: object = None, _args: object = None, _kwargs: object = None) -> None:
            nonlocal steps
            now = clock()
            if not steps and not q[FIRST_NS]:  # (a script that logged steps began with those)
                q[FIRST_NS] = now
            slot = steps % RING
            q[_STEP_TIMES + slot] = now
            if waited := board.sync_ns:
                q[_WAITS + 2 * slot], q[_WAITS + 2 * slot + 1] = steps + 1, waited
                board.sync_ns = 0
            steps += 1
            if time_waits is not None and (after := steps & mask) < 2:
                time_waits(not after)
            q[STEPS] = steps

        return step

    def logged(self, step: int) -> None:
        """A step the script logged (``TrainingRun.log``, ``mlflow.log_metric(step=)``)."""
        q = self._q
        with self._lock:
            if step <= q[LOGGED] and q[LOGGED_NS]:
                return
            seq = q[SEQ] + 1
            q[SEQ] = seq
            q[LOGGED], q[LOGGED_NS] = step, self._clock()
            if not q[FIRST_NS]:
                q[FIRST_NS] = q[LOGGED_NS]  # a script that only logs: its first logged step is its first step
            q[SEQ] = seq + 1

    def enter_sync(self) -> None:
        """A collective (or a backward, where DDP's collectives run) begins: its time is not the rank's own."""
        if self.sync_depth == 0:
            self._entered_sync_ns = self._clock()
        self.sync_depth += 1

    def leave_sync(self) -> None:
        self.sync_depth -= 1
        if self.sync_depth == 0:
            self.add_sync(self._clock() - self._entered_sync_ns)

    def add_sync(self, ns: int) -> None:
        """``ns`` more of waiting for the peers (``enter_sync``/``leave_sync``, or a wrapper that timed it),
        in the interval the next step ends. The loop's thread waits: no lock (a wait in another thread at
        the moment of a step may be lost, never miscounted as another interval's)."""
        self.sync_ns += ns

    def enter(self, phase: Phase) -> Phase:
        """The rank checkpoints or evaluates from now; returns the phase to go back to."""
        with self._lock:
            before = Phase(self._q[PHASE])
            if before is not phase:
                self._switch(phase)
            return before

    def leave(self, back_to: Phase) -> None:
        with self._lock:
            if self._q[PHASE] != back_to:
                self._switch(back_to)

    def _switch(self, phase: Phase) -> None:
        q, now = self._q, self._clock()
        seq = q[SEQ] + 1
        q[SEQ] = seq
        # Before the first step a checkpoint or evaluation is part of the start-up.
        spent = now - max(q[PHASE_SINCE_NS], q[FIRST_NS]) if q[FIRST_NS] else 0
        if q[PHASE] == Phase.CHECKPOINTING:
            q[CHECKPOINT_NS] += spent
            q[CHECKPOINT_END_NS] = now
        elif q[PHASE] == Phase.EVALUATING:
            q[EVALUATION_NS] += spent
        if q[PHASE] != Phase.TRAINING:
            entry = _PHASES + 2 * (q[STEPS] % RING)  # the interval since the last step (under the lock)
            if q[entry] != q[STEPS] + 1:
                q[entry], q[entry + 1] = q[STEPS] + 1, 0
            q[entry + 1] += spent
        q[PHASE], q[PHASE_SINCE_NS] = int(phase), now  # leaving or entering a phase is progress too
        q[SEQ] = seq + 1

    def close(self) -> None:
        self._q.release()
        self._map.close()


@dataclass(frozen=True)
class RankProgress:
    """One rank as the node reads it."""

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
    work_ns: tuple[int, ...]  # own work of the steps whose waits were timed

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
        if data == before and memoryview(data).cast("q")[SEQ] % 2 == 0:
            return _decode(path, data)
        before = data
    return None


def _decode(path: Path, data: bytes) -> RankProgress:
    _, _, pid, rank, local_rank, world, restart, started, ticks = _HEADER.unpack_from(data, 0)
    q = memoryview(data).cast("q")
    steps = q[STEPS]
    first = max(0, steps - RING + 1)  # not the slot the next step writes
    times = [q[_STEP_TIMES + count % RING] for count in range(first, steps)]
    # A step's duration less the checkpoints and evaluations in its interval; its own work less its waits
    # too, where they were timed: the interval after the count reached a multiple of WAITS_EVERY.
    every = q[WAITS_EVERY] or 1
    durations, work = [], []
    for count, t0, t in zip(range(first + 1, steps), times, times[1:], strict=False):
        waits, phases = _WAITS + 2 * (count % RING), _PHASES + 2 * (count % RING)
        sync = q[waits + 1] if q[waits] == count + 1 else 0
        phases = q[phases + 1] if q[phases] == count + 1 else 0
        durations.append(t - t0 - phases)
        if count % every == 0:
            work.append(max(0, t - t0 - phases - sync))
    last_step = times[-1] if times else 0
    return RankProgress(
        RankIdentity(pid, rank, local_rank, world, restart, ticks), path, started, steps, q[LOGGED], q[FIRST_NS],
        last_step, max(last_step, q[LOGGED_NS], q[PHASE_SINCE_NS]), Phase(q[PHASE]), q[PHASE_SINCE_NS],
        q[CHECKPOINT_NS], q[EVALUATION_NS], q[CHECKPOINT_END_NS], tuple(durations), tuple(work),
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
