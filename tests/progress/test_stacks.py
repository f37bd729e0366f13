"""Every rank's stacks from the node's process, through the signal the rank hook registered: two real
ranks, one blocked in code of its own, one waiting in a collective (a module under torch/distributed/)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from otel_forge.progress.board import read_board
from otel_forge.progress.stacks import main_thread_frames, odd_one_out, stacks_report, take_stacks

BOOTSTRAP = Path(__file__).resolve().parents[2] / "otel_forge" / "cli" / "bootstrap"

RANK = """
import sys, threading, time
sys.path.insert(0, sys.argv[2])
from torch.distributed import collectives  # a stand-in at a path like torch's: .../torch/distributed/
from otel_forge.progress import rank_hooks

def wait_for_the_disk():
    time.sleep(600)

hooks = rank_hooks.installed()
for _ in range(3):
    hooks.step()
threading.Thread(target=time.sleep, args=(600,), name="loader", daemon=True).start()
print("ready", flush=True)
if sys.argv[1] == "odd":
    wait_for_the_disk()
else:
    collectives.all_reduce()
"""


@pytest.fixture
def ranks(tmp_path: Path):  # type: ignore[no-untyped-def]
    # torch/distributed/ in a frame's path is what marks a collective: a stand-in package at such a path
    package = tmp_path / "lib" / "torch" / "distributed"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "collectives.py").write_text("import time\n\ndef all_reduce():\n    time.sleep(600)\n")
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    board = tmp_path / "board"
    processes = []
    for rank, role in ((0, "collective"), (1, "odd")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env |= {"PYTHONPATH": os.pathsep.join((str(BOOTSTRAP), env.get("PYTHONPATH", ""))), "RANK": str(rank),
                "OTEL_FORGE_PROGRESS_BOARD": str(board)}  # fmt: skip
        processes.append(
            subprocess.Popen(
                [sys.executable, str(script), role, str(tmp_path / "lib")], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    try:
        for process in processes:
            assert process.stdout is not None and process.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        yield board
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_the_rank_not_in_a_collective_is_named_with_its_function_and_line(ranks: Path) -> None:
    board = read_board(ranks)
    dumps = take_stacks(board)
    assert [dump.rank.rank for dump in dumps] == [0, 1]
    assert dumps[0].waiting_in_collective and not dumps[1].waiting_in_collective
    odd = odd_one_out(dumps)
    assert odd is not None and odd.rank.rank == 1
    assert odd.where is not None and odd.where.function == "wait_for_the_disk"
    assert odd.where.line == 8 and odd.where.file.endswith("rank.py")
    assert "loader" not in str(odd.main_thread)  # the main thread's frames, not the loader's
    report = stacks_report(dumps, "headline")
    assert "wait_for_the_disk" in report and "all_reduce" in report and report.count("Thread 0x") >= 2


def test_a_rank_that_is_gone_gives_no_stack(ranks: Path, tmp_path: Path) -> None:
    board = read_board(ranks)
    gone = [rank for rank in board if rank.rank == 1]
    os.kill(gone[0].identity.pid, 9)
    time.sleep(0.2)
    assert [dump.rank.rank for dump in take_stacks(board, wait_s=1.0)] == [0]


def test_every_rank_in_a_collective_names_none() -> None:
    text = (
        'Current thread 0x0001 (most recent call first):\n  File "/x/torch/distributed/c10d.py", line 3 in all_reduce\n'
    )
    assert main_thread_frames(text)[0].function == "all_reduce"
