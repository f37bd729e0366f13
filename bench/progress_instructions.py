"""What the per-rank progress hook adds to a training step, in instructions (valgrind's callgrind): a
count that the machine's other load does not move, where a shared machine's wall clock wanders by
more than the hook costs.

Run:  python -m bench.progress_instructions [--steps 500 4500] [--json]   (~8 min)

The ``train`` loop of ``bench.progress_step`` (SGD on a ``Linear(8, 1)``: forward, MSE loss,
``backward()``, ``step()``; one thread), each variant as ``bench.progress_step`` starts it
(``bare``, ``hooked`` a lone process, ``hooked-rank`` a rank of a job of 2; ``noop-hook``, a no-op
registered with ``register_optimizer_step_post_hook``: torch's own dispatch to a global hook, which
any hook pays), each under ``valgrind --tool=callgrind`` twice, for the two step counts:
instructions per step is the difference of the two totals over the difference of the steps (the
start, torch's import and the first steps cancel out; ``PYTHONHASHSEED=0`` and no address
randomisation (``setarch -R``), as either moves the count by more than the hook's; ``gc.freeze()``
after the first steps, as a collection of the import's whole heap comes at a different step in each
variant). Only the main thread's instructions are counted (``--separate-threads=yes``): the loop
and the hook run there, while another thread of torch's spins for as long as the run takes, by a
count that differed by 4.5 million between two identical runs (the main thread's by 1,790 in 9.1
billion). "Added" is a variant's per-step count less the bare one's; its time is estimated at the
bare loop's own pace (its native ns per step over its instructions per step, measured in the same
run): the hook's instructions run as fast as the training's. The hooked children are checked to have
written one board file with every step in it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.progress_step import GOAL_US, environ
from otel_forge.progress.board import read_board

VARIANTS = {"bare": (False, 1), "noop-hook": (False, 1), "hooked": (True, 1), "hooked-rank": (True, 2)}

TRAIN_CHILD = r"""
import gc, sys, time
import torch

steps, variant = int(sys.argv[1]), sys.argv[2]
if variant == "noop-hook":  # torch's own dispatch to a global step hook: what any such hook costs
    from torch.optim.optimizer import register_optimizer_step_post_hook
    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: None)
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 8), torch.randn(32, 1)
mse = torch.nn.functional.mse_loss

def run(n):
    for _ in range(n):
        optimizer.zero_grad()
        mse(model(x), y).backward()
        optimizer.step()

run(2)  # the hook's first step (its board made) before the heap is frozen
gc.freeze()  # the collector scans the loop's garbage, not the import's heap (a variant's collections vary)
began = time.perf_counter_ns()
run(steps)
print((time.perf_counter_ns() - began) / steps)
"""


def instructions(steps: int, variant: str, workdir: Path) -> tuple[int, int]:
    """The child's instruction counts under callgrind: its main thread's (the loop's, where the hook
    runs) and its other threads' together (``summary:`` of each thread's file)."""
    hooked, world = VARIANTS[variant]
    board = workdir / f"board-{variant}-{steps}" if hooked else None
    out = workdir / f"callgrind-{variant}-{steps}.out"
    done = subprocess.run(
        [
            "setarch",
            platform.machine(),
            "-R",
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",  # torch's other threads spin for as long as the run takes: not counted
            f"--callgrind-out-file={out}",
            sys.executable,
            "-c",
            TRAIN_CHILD,
            str(steps),
            variant,
        ],  # fmt: skip
        env={**environ(board, world), "PYTHONHASHSEED": "0"},  # one dict layout: the two runs differ by steps alone
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"{variant} under callgrind failed: {done.stderr[-2000:]}")
    if board is not None:
        (rank,) = read_board(board)
        if rank.steps != steps + 2:  # (and the 2 before the count)
            raise SystemExit(f"{variant}: the board holds {rank.steps} steps of {steps + 2}")
    counts = []
    for thread in sorted(workdir.glob(f"{out.name}-*")):  # -01 is the main thread
        summary = re.search(r"^summary: (\d+)", thread.read_text(), re.MULTILINE)
        assert summary is not None, thread
        counts.append(int(summary.group(1)))
    return counts[0], sum(counts[1:])


def native_ns_per_step(steps: int, workdir: Path, rounds: int = 5) -> float:
    """The bare loop's fastest pace of ``rounds`` native runs (the machine's load only adds time)."""
    paces = []
    for _ in range(rounds):
        done = subprocess.run(
            [sys.executable, "-c", TRAIN_CHILD, str(steps), "bare"],
            env=environ(None),
            cwd=workdir,
            capture_output=True,
            text=True,
            check=True,
            timeout=600,
        )
        paces.append(float(done.stdout.split()[-1]))
    return min(paces)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs=2, default=(500, 4500), metavar=("FEW", "MANY"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    few, many = args.steps
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-progress-instructions-") as tmp:
        workdir = Path(tmp)
        jobs = [(steps, variant) for variant in VARIANTS for steps in (few, many)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:  # the machine's 2 cores
            counts = dict(zip(jobs, pool.map(lambda job: instructions(*job, workdir), jobs), strict=True))
        pace_ns = native_ns_per_step(many, workdir)
    per_step = {v: (counts[(many, v)][0] - counts[(few, v)][0]) / (many - few) for v in VARIANTS}
    other_threads = {v: (counts[(many, v)][1] - counts[(few, v)][1]) / (many - few) for v in VARIANTS}
    ns_per_instruction = pace_ns / per_step["bare"]
    result = {
        "steps": [few, many],
        "instructions_per_step": per_step,
        "other_threads_instructions_per_step": other_threads,
        "bare_ns_per_step": pace_ns,
        "added_instructions_per_step": {v: per_step[v] - per_step["bare"] for v in VARIANTS if v != "bare"},
        "ours_instructions_per_step": {
            v: per_step[v] - per_step["noop-hook"] for v in VARIANTS if v.startswith("hooked")
        },
        "added_us_per_step": {
            v: (per_step[v] - per_step["bare"]) * ns_per_instruction / 1000 for v in VARIANTS if v != "bare"
        },
        "seconds": round(time.monotonic() - began),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"Progress hook in instructions (callgrind), {few} and {many} `train` steps per variant; the bare loop "
        f"natively {pace_ns / 1000:.2f} µs/step ({per_step['bare']:,.0f} instructions: "
        f"{ns_per_instruction:.3f} ns each). {result['seconds']} s.\n"
    )
    print(
        "| variant | instructions/step (main thread) | added | added, at the bare loop's pace "
        "| ours (less torch's dispatch) | other threads' instructions/step (not counted) |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for variant in VARIANTS:
        added = per_step[variant] - per_step["bare"]
        ours = per_step[variant] - per_step["noop-hook"]
        cells = (
            ["", "", ""]
            if variant == "bare"
            else [f"{added:+,.0f}", f"{added * ns_per_instruction / 1000:+.2f} µs", ""]
        )
        if variant.startswith("hooked"):
            cells[2] = f"{ours:+,.0f} ({ours * ns_per_instruction / 1000:+.2f} µs)"
        print(f"| {variant} | {per_step[variant]:,.0f} | {' | '.join(cells)} | {other_threads[variant]:,.0f} |")
    print(f"\nGoal: at most {GOAL_US:.0f} µs a step.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
