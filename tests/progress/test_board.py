"""The progress board and the rank hook, in real processes: what a rank writes is what the node reads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from otel_forge.progress.board import Phase, RankBoard, RankIdentity, read_board, read_rank, start_ticks
from otel_forge.progress.import_hooks import when_imported
from testkit.hermetic import hermetic_environ

REPO = Path(__file__).resolve().parents[2]
BOOTSTRAP = REPO / "otel_forge" / "cli" / "bootstrap"


def _identity(rank: int = 0) -> RankIdentity:
    return RankIdentity(os.getpid(), rank, rank, 2, 0, start_ticks())


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


def test_steps_phases_and_step_times_are_read_back(tmp_path: Path) -> None:
    clock = FakeClock()
    board = RankBoard(tmp_path / "rank-0-1.bin", _identity(), clock)
    for _ in range(5):
        clock.now += 100_000_000
        board.enter_sync()
        clock.now += 40_000_000  # 40 ms of the 140 ms step waits for the peers
        board.leave_sync()
        board.step()
    back = board.enter(Phase.CHECKPOINTING)
    clock.now += 2_000_000_000
    board.leave(back)
    board.logged(17)
    rank = read_rank(board.path)
    assert rank is not None
    assert (rank.steps, rank.logged_step, rank.phase) == (5, 17, Phase.TRAINING)
    assert rank.durations_ns == (140_000_000,) * 4  # the first step has no duration
    assert rank.work_ns == (100_000_000,) * 4
    assert rank.checkpoint_ns == 2_000_000_000
    assert rank.checkpoint_end_ns == clock.now
    assert rank.last_progress_ns == clock.now


def test_the_ring_keeps_the_last_128_steps_oldest_first(tmp_path: Path) -> None:
    clock = FakeClock()
    board = RankBoard(tmp_path / "rank-0-1.bin", _identity(), clock)
    for step in range(200):
        clock.now += (step + 1) * 1000
        board.step()
    rank = read_rank(board.path)
    assert rank is not None and len(rank.durations_ns) == 128
    assert rank.durations_ns == tuple((step + 1) * 1000 for step in range(72, 200))


def test_a_reader_never_sees_a_torn_write(tmp_path: Path) -> None:
    # The writer is another process, as a rank is: it steps and logs the same number, a few µs apart,
    # as fast as it can; a torn read would show the two apart.
    path = tmp_path / "rank-0-1.bin"
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            f"""
            import os, time
            from pathlib import Path
            from otel_forge.progress.board import STEPS, RankBoard, RankIdentity
            board = RankBoard(Path({str(path)!r}), RankIdentity(os.getpid(), 0, 0, 2, 0, 0))
            ends = time.monotonic() + 60
            while time.monotonic() < ends:
                board.step()
                board.logged(board._q[STEPS])
                for _ in range(20):  # a few µs between writes, as between a rank's steps and logs
                    pass
            """
        )],
        env=hermetic_environ(PYTHONPATH=str(REPO)),
    )  # fmt: skip
    try:
        read, steps = 0, set()
        while (read < 300 or len(steps) < 20) and writer.poll() is None:  # the writer moved meanwhile
            if (rank := read_rank(path)) is not None:
                read, steps = read + 1, steps | {rank.steps}
                assert rank.logged_step in (rank.steps, rank.steps - 1), rank
        assert read >= 300 and len(steps) >= 20
    finally:
        writer.kill()
        writer.wait()


def test_a_file_that_is_not_a_board_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "rank-0-1.bin").write_bytes(b"nonsense")
    assert read_board(tmp_path) == []
    assert read_board(tmp_path / "absent") == []


def test_a_post_import_hook_runs_once_the_module_is_imported_and_not_before() -> None:
    code = textwrap.dedent(
        """
        import sys
        from otel_forge.progress.import_hooks import when_imported
        seen = []
        when_imported("tabnanny", lambda module: seen.append(module.__name__))
        assert "tabnanny" not in sys.modules and seen == []
        import tabnanny
        assert seen == ["tabnanny"], seen
        when_imported("tabnanny", lambda module: seen.append("again"))  # already imported: at once
        assert seen == ["tabnanny", "again"], seen
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_failing_hook_never_fails_the_import() -> None:
    when_imported("colorsys", lambda module: 1 / 0)
    import colorsys  # noqa: F401 - the import is the test

    assert "colorsys" in sys.modules


TRAIN = """
import json, sys, time, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(STEPS):
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
torch.save(model.state_dict(), sys.argv[1])
from safetensors.torch import save_file
assert getattr(save_file, "__otel_forge_progress__", False)  # a checkpoint phase around it
save_file(model.state_dict(), sys.argv[1] + ".safetensors")
import torch.nn
assert type(torch.__spec__.loader).__name__ != "_HookedLoader"  # the module keeps its own loader
"""


def _hooked(board: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BOOTSTRAP), env.get("PYTHONPATH", "")) if p)
    return {**env, "OTEL_FORGE_PROGRESS_BOARD": str(board), **extra}


@pytest.mark.slow
def test_a_torch_loop_under_the_hook_counts_each_optimizer_step_once(tmp_path: Path) -> None:
    board = tmp_path / "board"
    script = tmp_path / "train.py"
    script.write_text(TRAIN.replace("STEPS", "25"))
    subprocess.run(
        [sys.executable, str(script), str(tmp_path / "model.pt")],
        env=_hooked(board, RANK="1", LOCAL_RANK="1", WORLD_SIZE="2"),
        check=True,
        timeout=120,
    )
    (rank,) = read_board(board)
    assert (rank.rank, rank.identity.local_rank, rank.identity.world_size) == (1, 1, 2)
    assert rank.steps == 25
    assert len(rank.durations_ns) == 24
    assert rank.checkpoint_ns > 0 and rank.phase is Phase.TRAINING  # torch.save and save_file were checkpoints
    assert rank.checkpoint_end_ns > rank.last_step_ns


def test_a_process_that_never_steps_writes_no_board(tmp_path: Path) -> None:
    board = tmp_path / "board"
    subprocess.run([sys.executable, "-c", "import json"], env=_hooked(board), check=True, timeout=60)
    assert not board.exists()


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    env = _hooked(tmp_path / "board")
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], str(theirs)))
    code = (
        "import os; from otel_forge.progress import rank_hooks; "
        "print(os.environ.get('THEIRS_RAN'), rank_hooks.installed() is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "True"], out


FORKED = """
import os, sys, torch
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
timed = []  # the steps after which the next backward is timed as a wait for the peers
for step in range(1, 34):
    model(torch.randn(8, 4)).sum().backward(); opt.step()
    if getattr(torch.autograd.backward, "__otel_forge_progress__", False):
        timed.append(step)
pid = os.fork()
if pid == 0:  # a forked DataLoader worker that steps (it should not): the parent's board is not its
    for _ in range(3):
        opt.step()
    os._exit(0)
os.waitpid(pid, 0)
print(timed)
"""


@pytest.mark.parametrize(("world", "timed"), [("1", "[]"), ("2", "[16, 32]")])
def test_a_forked_child_writes_nothing_and_only_a_distributed_rank_times_its_backward_one_step_in_16(
    tmp_path: Path, world: str, timed: str
) -> None:
    board = tmp_path / "board"
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    out = subprocess.run(
        [sys.executable, str(script)],
        env=_hooked(board, RANK="0", WORLD_SIZE=world),
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    (rank,) = read_board(board)
    assert rank.steps == 33
    # a lone process waits for no peer: its backward is left as it is (no cost on its hot path)
    assert out.stdout.strip() == timed
