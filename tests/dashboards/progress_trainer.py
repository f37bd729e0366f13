"""A training without torch, for ``otel-forge run``: four ranks that step on the progress board.

``otel-forge run`` hands its CMD the node's progress board (``OTEL_FORGE_PROGRESS_BOARD``); each rank
here is a thread with a board file of its own (``RankBoard``), as a rank process would have. A step
takes about 40 ms, most of it in a "collective" (``enter_sync`` / ``leave_sync``); rank ``SLOW_RANK``
does three times the others' own work, so the node names it the slow rank once it has been the
slowest for 30 s. Runs until stopped.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from otel_forge.config import PROGRESS_BOARD_ENV
from otel_forge.progress.board import RankBoard, RankIdentity, rank_file, start_ticks

WORLD_SIZE = 4
SLOW_RANK = 3
STEP_S = 0.04
OWN_WORK_S = 0.01  # the slow rank's: 3 x this


def train(board: Path, rank: int) -> None:
    pid = os.getpid()
    ranks = RankBoard(rank_file(board, rank, pid), RankIdentity(pid, rank, rank, WORLD_SIZE, 0, start_ticks()))
    own = OWN_WORK_S * (3 if rank == SLOW_RANK else 1)
    while True:
        time.sleep(own)  # forward and backward
        ranks.enter_sync()  # the all-reduce: the fast ranks wait here for the slow one
        time.sleep(STEP_S - own)
        ranks.leave_sync()
        ranks.step()


def main() -> None:
    board = Path(os.environ[PROGRESS_BOARD_ENV])
    board.mkdir(parents=True, exist_ok=True)
    for rank in range(WORLD_SIZE):
        threading.Thread(target=train, args=(board, rank), name=f"rank-{rank}", daemon=True).start()
    print(f"training on the board {board}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
