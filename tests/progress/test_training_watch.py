"""TrainingWatch over a real rank process: what a stall writes into the run and says, stall_action
"end", and the goodput table at the job's end."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from otel_forge.cli.training_watch import GOODPUT_ARTIFACT, RunNotes, TrainingWatch
from otel_forge.config import ForgeConfig

BOOTSTRAP = Path(__file__).resolve().parents[2] / "otel_forge" / "cli" / "bootstrap"

RANK = """
import time
from otel_forge.progress import rank_hooks

def read_the_next_shard():
    time.sleep(600)

hooks = rank_hooks.installed()
for _ in range(20):
    time.sleep(0.02)
    hooks.step()
print("stepped", flush=True)
read_the_next_shard()
"""


class Run:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}
        self.texts: dict[str, str] = {}
        self.tables: dict[str, dict[str, object]] = {}
        self.said: list[str] = []

    def notes(self) -> RunNotes:
        return RunNotes(self.tags.update, self.texts.__setitem__, self.tables.__setitem__)


def _rank(tmp_path: Path, board: Path) -> subprocess.Popen[str]:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"PYTHONPATH": os.pathsep.join((str(BOOTSTRAP), env.get("PYTHONPATH", ""))), "RANK": "3",
            "OTEL_FORGE_PROGRESS_BOARD": str(board)}  # fmt: skip
    process = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "stepped"
    return process


def test_a_stall_is_said_tagged_with_its_stacks_and_ended_by_stall_action_end(tmp_path: Path) -> None:
    board, run = tmp_path / "board", Run()
    config = ForgeConfig.resolve({}, stall_floor_s=1.0, stall_factor=2.0, stall_action="end", stall_action_after_s=2.0)
    watch = TrainingWatch(board, config, "host-a", run.notes(), run.said.append, interval_s=0.1).start()
    process = _rank(tmp_path, board)
    try:
        process.wait(timeout=30)  # the stall action's SIGTERM ends it
    finally:
        process.kill()
        final = watch.stop()
    assert process.returncode == -15
    stalled = [line for line in run.said if "training stalled:" in line]
    assert len(stalled) == 1, run.said
    assert "rank 3 on host host-a at step 20 is not in a collective: in read_the_next_shard (rank.py:6)" in stalled[0]
    assert any("stopping its 1 rank(s) (stall_action=end)" in line for line in run.said)
    assert run.said[-1].startswith("otel-forge: the stalled ranks ended: the stall lasted")
    assert run.tags["otel_forge.stall.rank"] == "3" and run.tags["otel_forge.stall.host"] == "host-a"
    assert run.tags["otel_forge.stall.where"] == "read_the_next_shard (rank.py:6)"
    assert "read_the_next_shard" in run.texts["stalls/stall-1.txt"]
    # the job ended stalled: the rest is the stall's, then other; the table adds up
    assert final is not None
    table = run.tables[GOODPUT_ARTIFACT]
    rows = {row[0]: row[1] for row in table["data"]}  # type: ignore[index,union-attr]
    assert rows["stalled"] >= 2.0 and abs(sum(v for k, v in rows.items() if k != "total") - rows["total"]) < 0.01


def test_no_table_for_a_job_that_never_stepped(tmp_path: Path) -> None:
    run = Run()
    watch = TrainingWatch(tmp_path / "board", ForgeConfig.resolve({}), "h", run.notes(), run.said.append)
    watch.start()
    time.sleep(0.1)
    final = watch.stop()
    assert final is not None and final.activity.value == "startup"
    assert run.tables == {} and run.said == []
