"""Every rank's Python stacks, taken from the node's process, and the rank that is the odd one out.

The rank hook registered faulthandler on ``STACKS_SIGNAL``: faulthandler writes all threads' stacks
from the signal handler itself, in C, so a rank stuck in C code (a collective, a lock) still answers.
A rank whose main thread is not waiting in a collective (torch.distributed, DDP's backward, a CUDA
synchronize) while the others are is the one the job waits for.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from otel_forge.progress.board import STACKS_SIGNAL, RankProgress, start_ticks

_WAIT_S = 3.0  # a rank answers in milliseconds; one that does not is said to have given no stack
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
# Where a rank waits for its peers: a collective, DDP's gradient all-reduce (inside backward), a device sync.
_WAITING_IN = ("/torch/distributed/", "/torch/nn/parallel/", "/torch/autograd/", "/torch/cuda/")
_LIBRARY = ("/lib/python3", "site-packages", "dist-packages", "<frozen")


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    def __str__(self) -> str:
        return f"{self.function} ({os.path.basename(self.file)}:{self.line})"


@dataclass(frozen=True)
class RankStacks:
    """One rank's dump: faulthandler's text, and its main thread's frames, innermost first."""

    rank: RankProgress
    text: str
    main_thread: tuple[Frame, ...]

    @property
    def waiting_in_collective(self) -> bool:
        return any(part in frame.file for frame in self.main_thread for part in _WAITING_IN)

    @property
    def where(self) -> Frame | None:
        """The innermost frame of the rank's own code (not a library's), else the innermost one."""
        own = [frame for frame in self.main_thread if not any(part in frame.file for part in _LIBRARY)]
        frames = own or list(self.main_thread)
        return frames[0] if frames else None


def take_stacks(ranks: Sequence[RankProgress], wait_s: float = _WAIT_S) -> list[RankStacks]:
    """Signal each live rank to dump its stacks, and read what each wrote (a rank that wrote nothing
    within ``wait_s`` is left out)."""
    asked: dict[int, tuple[RankProgress, int]] = {}
    for rank in ranks:
        stacks = rank.path.with_suffix(".stacks")
        pid = rank.identity.pid
        if start_ticks(pid) != rank.identity.start_ticks or not stacks.exists():
            continue  # gone, or a pid another process took since
        size = stacks.stat().st_size
        try:
            os.kill(pid, STACKS_SIGNAL)
        except OSError:
            continue
        asked[pid] = (rank, size)
    return _read_dumps(asked, wait_s)


def _read_dumps(asked: dict[int, tuple[RankProgress, int]], wait_s: float) -> list[RankStacks]:
    deadline = time.monotonic() + wait_s
    dumps: dict[int, RankStacks] = {}
    while len(dumps) < len(asked) and time.monotonic() < deadline:
        time.sleep(0.05)
        for pid, (rank, size) in asked.items():
            if pid not in dumps and (text := _new_text(rank, size)) is not None:
                dumps[pid] = RankStacks(rank, text, main_thread_frames(text))
    return sorted(dumps.values(), key=lambda dump: dump.rank.rank)


def _new_text(rank: RankProgress, size: int) -> str | None:
    """What the rank wrote past ``size``, once its dump looks complete: it ends a line, and a moment
    later it is the same (faulthandler writes frame by frame)."""
    data = _read_past(rank, size)
    if not data or not data.endswith(b"\n"):
        return None
    time.sleep(0.02)
    return data.decode(errors="replace") if _read_past(rank, size) == data else None


def _read_past(rank: RankProgress, size: int) -> bytes | None:
    try:
        with open(rank.path.with_suffix(".stacks"), "rb") as file:
            file.seek(size)
            return file.read()
    except OSError:
        return None


def main_thread_frames(text: str) -> tuple[Frame, ...]:
    """The main thread's frames from a faulthandler dump: the last thread listed (the oldest)."""
    blocks = re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+ .*$", text, flags=re.MULTILINE)
    last = blocks[-1] if blocks else ""
    frames = []
    for line in last.splitlines():
        if match := _FRAME.match(line):
            frames.append(Frame(match["file"], int(match["line"]), match["function"]))
    return tuple(frames)


def odd_one_out(dumps: Sequence[RankStacks]) -> RankStacks | None:
    """The rank the others wait for: the one not waiting in a collective (the fewest steps first,
    where several are not); None where every rank waits (the cause is on another node) or none answered."""
    outside = [dump for dump in dumps if not dump.waiting_in_collective]
    if not outside or (len(outside) == len(dumps) and len(dumps) > 1 and _same_steps(outside)):
        return None
    return min(outside, key=lambda dump: (dump.rank.steps, dump.rank.rank))


def _same_steps(dumps: Sequence[RankStacks]) -> bool:
    return len({dump.rank.steps for dump in dumps}) == 1


def stacks_report(dumps: Sequence[RankStacks], headline: str) -> str:
    """The artifact: the headline, then each rank's dump."""
    parts = [headline, ""]
    for dump in dumps:
        identity = dump.rank.identity
        waiting = "waiting in a collective" if dump.waiting_in_collective else "not in a collective"
        parts.append(f"=== rank {identity.rank} (local rank {identity.local_rank}, pid {identity.pid}), "
                     f"step {dump.rank.steps}, {waiting}")  # fmt: skip
        parts.append(dump.text.rstrip())
        parts.append("")
    return "\n".join(parts)
