"""What the per-rank progress hook costs the training process: per optimizer step, and per process start.

Run:  python -m bench.progress_step [--rounds 5] [--steps 20000] [--json] [--quick]

"Hooked" is what ``otel-forge run`` makes of a training process: ``otel_forge/cli/bootstrap``
first on ``PYTHONPATH`` and ``OTEL_FORGE_PROGRESS_BOARD=<a fresh directory>``, so that its
``sitecustomize`` installs ``otel_forge.progress.rank_hooks`` before the script runs. Every measurement
is a fresh child process (``sys.executable``, the hermetic environment of the tests, the repository on
``PYTHONPATH`` for both variants), the variants interleaved round by round; medians over the rounds.

1. Per optimizer step. Two tiny CPU loops (``torch.set_num_threads(1)``), each run ``--warmup`` steps,
   then ``--steps`` steps timed (``perf_counter_ns``) in ``--blocks`` blocks: ``step``, an
   ``optimizer.step()`` of SGD on one parameter of 8 values whose gradient is set once (no forward,
   no backward: the hook's cost against the smallest step torch has), and ``train``, SGD on a
   ``Linear(8, 1)`` with a forward, an MSE loss, ``backward()`` and ``step()`` (the hook times each
   backward of one step in 16 as the rank's wait for its peers). Variants: ``bare``; ``noop-hook``,
   a no-op registered with ``register_optimizer_step_post_hook`` (torch's own dispatch to a global
   hook, the part no hook avoids); ``hooked`` (a lone process: the step hook alone); and in the
   ``train`` loop ``hooked-rank``, a rank of a job of 2 (``WORLD_SIZE=2``: its backward is timed
   too). A child's figure is its fastest block's mean per step (the machine's other load only ever
   adds time); "hooked - bare process" is the median over rounds of (hooked - bare) of the same
   round. Then each hooked child runs ``--blocks`` more pairs of blocks, its hook taken off (the
   global hook removed, the original ``backward`` back) then put back: "same process" is its
   fastest block with the hook on less its fastest with it off, per step, the median over rounds
   (one process: no two memory layouts). Checked in every hooked child: one board file, its
   ``steps`` (``read_board``) equal to the optimizer steps made with the hook on.
   The floors, in one child without torch: ``RankBoard.step()`` alone, ``RankHooks.step()`` (what torch
   calls) and the backward wrapper (around a function that does nothing), per call in a hot loop, less an
   empty loop's; the fastest of 7 runs.
2. Per process start: ``python -c pass``, bare and hooked, wall time of the whole process and its CPU
   (``RUSAGE_CHILDREN``), ``--starts`` rounds. The hook's own import: ``-X importtime``'s cumulative
   time of ``sitecustomize``, and the modules it adds (``sys.modules`` at the start of ``-c``, hooked
   less bare), checked for torch, mlflow, opentelemetry, numpy and psutil: the hook imports none.
3. Where nothing steps, nothing is written: hooked children that never import torch, that cannot
   (``sys.modules['torch'] = None``), and that import torch and make an optimizer but never step;
   the board directory must stay absent or empty.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import REPO_ROOT, percentile
from testkit.hermetic import hermetic_environ

BOOTSTRAP = REPO_ROOT / "otel_forge" / "cli" / "bootstrap"
BOARD_ENV = "OTEL_FORGE_PROGRESS_BOARD"
LOOPS = ("step", "train")
VARIANTS = {"step": ("bare", "noop-hook", "hooked"), "train": ("bare", "noop-hook", "hooked", "hooked-rank")}
HEAVY = ("torch", "mlflow", "opentelemetry", "numpy", "psutil")
GOAL_US = 2.0

LOOP_CHILD = r"""
import json, sys, time
loop, variant, steps, warmup, blocks = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
import torch
import torch.optim.optimizer as optimizer_module

torch.set_num_threads(1)
torch.manual_seed(0)
if variant == "noop-hook":
    optimizer_module.register_optimizer_step_post_hook(lambda optimizer, args, kwargs: None)
if loop == "step":
    param = torch.nn.Parameter(torch.zeros(8))
    param.grad = torch.full((8,), 1e-3)
    optimizer = torch.optim.SGD([param], lr=0.01)

    def run(n):
        step = optimizer.step
        for _ in range(n):
            step()
else:
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    mse = torch.nn.functional.mse_loss

    def run(n):
        for _ in range(n):
            optimizer.zero_grad()
            mse(model(x), y).backward()
            optimizer.step()

run(warmup)
size = steps // blocks
block_ns = []
for _ in range(blocks):
    began = time.perf_counter_ns()
    run(size)
    block_ns.append(time.perf_counter_ns() - began)
made = warmup + size * blocks
# Hooked: the same process with its hook taken off and put back, block by block (off, on): pairs.
off_ns, on_ns = [], []
if variant.startswith("hooked"):
    # A rank's step hook puts the backward's timing wrapper in place for one step in 16: off, the bare one.
    saved_hooks = dict(optimizer_module._global_optimizer_post_hooks)
    bare_backward = getattr(torch.autograd.backward, "__wrapped__", torch.autograd.backward)
    for _ in range(blocks):
        optimizer_module._global_optimizer_post_hooks.clear()
        torch.autograd.backward = bare_backward
        began = time.perf_counter_ns()
        run(size)
        off_ns.append(time.perf_counter_ns() - began)
        optimizer_module._global_optimizer_post_hooks.update(saved_hooks)
        began = time.perf_counter_ns()
        run(size)
        on_ns.append(time.perf_counter_ns() - began)
        made += size
hooks = sys.modules.get("otel_forge.progress.rank_hooks")
installed = hooks.installed() if hooks is not None else None
print(json.dumps({
    "pid": __import__("os").getpid(), "block_ns": block_ns, "block_steps": size, "made": made,
    "off_ns": off_ns, "on_ns": on_ns,
    "global_hooks": len(optimizer_module._global_optimizer_post_hooks),
    "otel_forge_imported": "otel_forge" in sys.modules,
    "otel_forge_file": getattr(sys.modules.get("otel_forge"), "__file__", None),
    "board": str(installed.board.path) if installed is not None and installed.board is not None else None,
}))
"""

FLOOR_CHILD = r"""
import json, os, sys, time
from pathlib import Path
from otel_forge.progress import rank_hooks
from otel_forge.progress.board import RankBoard, RankIdentity

calls, rounds, directory = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
board = RankBoard(directory / "rank-0-0.bin", RankIdentity(os.getpid(), 0, 0, 1, 0, 0))
hooks = rank_hooks.install({"OTEL_FORGE_PROGRESS_BOARD": str(directory / "hooked")})
hooks.step()  # makes its board: what follows is a step like every other

def empty(n):
    for _ in range(n):
        pass

def board_step(n, step=board.step):
    for _ in range(n):
        step()

def hooks_step(n, step=hooks.step, optimizer=object(), no=()):
    for _ in range(n):
        step(optimizer, no, {})

def backward_wrapper(n, backward=rank_hooks._waiting(hooks, lambda: None)):
    for _ in range(n):
        backward()

subjects = {"empty": empty, "board.step": board_step, "hooks.step": hooks_step, "backward wrapper": backward_wrapper}
ns = {name: [] for name in subjects}
for _ in range(rounds):
    for name, subject in subjects.items():
        began = time.perf_counter_ns()
        subject(calls)
        ns[name].append((time.perf_counter_ns() - began) / calls)
print(json.dumps(ns))
"""

MODULES_CHILD = "import sys; m = sorted(sys.modules); import json; print(json.dumps(m))"

NO_STEP_CHILDREN = {
    "never imports torch (`python -c pass`)": "pass",
    "cannot import torch (`sys.modules['torch'] = None`)": (
        "import sys\nsys.modules['torch'] = None\ntry:\n    import torch\nexcept ImportError:\n    pass\n"
        "from otel_forge.progress.rank_hooks import installed\nassert installed() is not None"
    ),
    "imports torch, makes an optimizer, never steps": (
        "import torch, torch.optim.optimizer as o\np = torch.nn.Parameter(torch.zeros(8))\n"
        "opt = torch.optim.SGD([p], lr=0.1)\nassert len(o._global_optimizer_post_hooks) == 1"
    ),
}


def environ(board: Path | None, world_size: int = 1) -> dict[str, str]:
    """The child's environment: bare (the repository on PYTHONPATH) or hooked (the bootstrap first);
    ``world_size`` 2: a rank of a distributed job (its backward and collectives are timed as waits)."""
    paths = [str(REPO_ROOT)] if board is None else [str(BOOTSTRAP), str(REPO_ROOT)]
    env = hermetic_environ(PYTHONPATH=os.pathsep.join(paths), WORLD_SIZE=str(world_size), RANK="0")
    env.pop("PYTHONUNBUFFERED", None)  # as a training script starts: nothing the variants do not share
    if board is not None:
        env[BOARD_ENV] = str(board)
    return env


def child(args: list[str], board: Path | None, cwd: Path, world_size: int = 1) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, *args], env=environ(board, world_size), cwd=cwd, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        what = " ".join(a if len(a) < 40 else a[:37] + "..." for a in args)
        raise RuntimeError(f"{what!r} exited {done.returncode}: {done.stderr[-3000:]}")
    return done


def loop_round(loop: str, variant: str, options: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from otel_forge.progress.board import read_board

    board = Path(tempfile.mkdtemp(dir=tmp)) / "board" if variant.startswith("hooked") else None
    args = ["-c", LOOP_CHILD, loop, variant, str(options.steps), str(options.warmup), str(options.blocks)]
    out = json.loads(child(args, board, tmp, 2 if variant == "hooked-rank" else 1).stdout.strip().splitlines()[-1])
    per_step_ns = min(out["block_ns"]) / out["block_steps"]  # what other load on the machine adds least
    result: dict[str, Any] = {
        "per_step_ns": per_step_ns,
        "total_per_step_ns": sum(out["block_ns"]) / (out["block_steps"] * options.blocks),
        "made": out["made"],
        # the fastest block with the hook on less the fastest with it off, in one process
        "in_process_added_ns": (min(out["on_ns"]) - min(out["off_ns"])) / out["block_steps"] if out["on_ns"] else None,
        "global_hooks": out["global_hooks"],
        "otel_forge_imported": out["otel_forge_imported"],
    }
    if board is not None:
        ranks = read_board(board)
        files = sorted(p.name for p in board.glob("rank-*.bin"))
        result.update(
            board_files=files,
            board_steps=ranks[0].steps if len(ranks) == 1 else None,
            board_pid=ranks[0].identity.pid if len(ranks) == 1 else None,
            child_pid=out["pid"],
        )
        one_a_step = len(ranks) == 1 and ranks[0].steps == out["made"]
        if not one_a_step or ranks[0].identity.pid != out["pid"]:
            raise RuntimeError(f"{loop}: the board does not count every step, once: {result}")
    elif out["otel_forge_imported"] or out["global_hooks"] != (variant == "noop-hook"):
        raise RuntimeError(f"{loop}/{variant}: the child is not {variant}: {out}")
    if variant.startswith("hooked") and (out["global_hooks"] != 1 or not out["otel_forge_imported"]):
        raise RuntimeError(f"{loop}: the hook was not installed: {out}")
    if variant.startswith("hooked") and not Path(out["otel_forge_file"]).is_relative_to(REPO_ROOT):
        raise RuntimeError(f"{loop}: the hook came from {out['otel_forge_file']}, not this checkout")
    return result


def per_step(options: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    rounds: dict[str, dict[str, list[dict[str, Any]]]] = {
        loop: {v: [] for v in VARIANTS[loop]} for loop in options.loops
    }
    for index in range(options.rounds):
        for loop in options.loops:
            order = VARIANTS[loop] if index % 2 == 0 else VARIANTS[loop][::-1]  # neither variant always first
            for variant in order:
                rounds[loop][variant].append(loop_round(loop, variant, options, tmp))
    summary: dict[str, Any] = {}
    for loop, by_variant in rounds.items():
        ns = {v: [r["per_step_ns"] for r in rs] for v, rs in by_variant.items()}
        added = [h - b for h, b in zip(ns["hooked"], ns["bare"], strict=True)]
        dispatch = [n - b for n, b in zip(ns["noop-hook"], ns["bare"], strict=True)]
        hooked = [r for v, rs in by_variant.items() if v.startswith("hooked") for r in rs]
        pairs = {
            v: statistics.median(r["in_process_added_ns"] for r in rs) for v, rs in by_variant.items() if v[0] == "h"
        }
        # A lone process has the step hook alone; a rank of a distributed job the backward's wrapper too.
        share = {"step_hook_ns": statistics.median(added), "in_process_step_hook_ns": pairs["hooked"]}
        if "hooked-rank" in ns:
            rank_added = [n - b for n, b in zip(ns["hooked-rank"], ns["bare"], strict=True)]
            share |= {
                "rank_added_ns": statistics.median(rank_added),
                "in_process_rank_added_ns": pairs["hooked-rank"],
                "in_process_backward_wrapper_ns": pairs["hooked-rank"] - pairs["hooked"],
            }
        summary[loop] = {
            "in_process_backward_wrapper_ns": None,
            **share,
            "in_process_added_ns": pairs["hooked"],
            **{f"{v}_ns": statistics.median(values) for v, values in ns.items()},
            "added_ns": statistics.median(added),
            "added_p25_ns": percentile(added, 0.25),
            "added_p75_ns": percentile(added, 0.75),
            "dispatch_ns": statistics.median(dispatch),
            "board_steps_match": all(r["board_steps"] == r["made"] for r in hooked),
            "rounds": {v: rs for v, rs in by_variant.items()},
        }
    return summary


def floors(options: argparse.Namespace, tmp: Path) -> dict[str, float]:
    directory = tempfile.mkdtemp(dir=tmp)
    out = json.loads(child(["-c", FLOOR_CHILD, str(options.floor_calls), "7", directory], None, tmp).stdout)
    empty = min(out.pop("empty"))
    return {name: min(values) - empty for name, values in out.items()}  # the fastest of 7: the least disturbed


def starts(options: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    wall: dict[str, list[float]] = {"bare": [], "hooked": []}
    cpu: dict[str, list[float]] = {"bare": [], "hooked": []}
    board = tmp / "start-board"
    for index in range(options.starts):
        for variant in ("bare", "hooked") if index % 2 == 0 else ("hooked", "bare"):
            before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
            child(["-c", "pass"], board if variant == "hooked" else None, tmp)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            wall[variant].append((time.perf_counter() - began) * 1000)
            cpu[variant].append((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000)
    importtime = []
    for _ in range(max(3, options.starts // 4)):
        stderr = child(["-X", "importtime", "-c", "pass"], board, tmp).stderr
        found = re.search(r"^import time:\s+\d+ \|\s+(\d+) \|\s+sitecustomize$", stderr, re.MULTILINE)
        if found is None:
            raise RuntimeError(f"no sitecustomize in -X importtime: {stderr[-2000:]}")
        importtime.append(int(found.group(1)) / 1000)
    bare_modules = set(json.loads(child(["-c", MODULES_CHILD], None, tmp).stdout))
    hooked_modules = set(json.loads(child(["-c", MODULES_CHILD], board, tmp).stdout))
    added = sorted(hooked_modules - bare_modules)
    heavy = [m for m in added if m.split(".")[0] in HEAVY]
    return {
        "bare_ms": statistics.median(wall["bare"]),
        "hooked_ms": statistics.median(wall["hooked"]),
        "added_ms": statistics.median([h - b for h, b in zip(wall["hooked"], wall["bare"], strict=True)]),
        "bare_cpu_ms": statistics.median(cpu["bare"]),
        "hooked_cpu_ms": statistics.median(cpu["hooked"]),
        "added_cpu_ms": statistics.median([h - b for h, b in zip(cpu["hooked"], cpu["bare"], strict=True)]),
        "sitecustomize_import_ms": statistics.median(importtime),
        "modules_added": len(added),
        "otel_forge_modules": [m for m in added if m.split(".")[0] in ("otel_forge", "sitecustomize")],
        "other_modules": [m for m in added if m.split(".")[0] not in ("otel_forge", "sitecustomize")],
        "heavy_modules": heavy,
        "board_files": sorted(p.name for p in board.iterdir()) if board.exists() else [],
        "wall_ms": wall,
    }


def no_step(tmp: Path) -> dict[str, list[str]]:
    results = {}
    for name, code in NO_STEP_CHILDREN.items():
        board = Path(tempfile.mkdtemp(dir=tmp)) / "board"
        child(["-c", code], board, tmp)
        results[name] = sorted(p.name for p in board.iterdir()) if board.exists() else []
    return results


def report(results: dict[str, Any], options: argparse.Namespace) -> str:
    lines = [
        f"Progress hook, {options.rounds} interleaved rounds of {options.steps:,} steps (+{options.warmup:,} warmup) "
        f"per loop and variant, each a fresh process; medians. {os.cpu_count()} CPUs, Python "
        f"{sys.version.split()[0]}, torch {results['torch']}.",
        "",
        "| loop | bare µs/step | hooked µs/step | added: hooked - bare process (p25-p75) | added: same process, "
        "hook off/on | of which the step hook | the backward's wrapper | torch's dispatch to a no-op hook "
        "| goal ≤ 2 µs |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for loop, s in results["per_step"].items():
        worst = max(s["added_ns"], s["in_process_added_ns"])
        met = "met" if worst <= GOAL_US * 1000 else "**not met**"
        wrapper = (
            "" if s["in_process_backward_wrapper_ns"] is None else f"{s['in_process_backward_wrapper_ns'] / 1000:+.2f}"
        )
        lines.append(
            f"| `{loop}` | {s['bare_ns'] / 1000:.2f} | {s['hooked_ns'] / 1000:.2f} "
            f"| {s['added_ns'] / 1000:+.2f} ({s['added_p25_ns'] / 1000:+.2f} to {s['added_p75_ns'] / 1000:+.2f}) "
            f"| {s['in_process_added_ns'] / 1000:+.2f} | {s['in_process_step_hook_ns'] / 1000:+.2f} "
            f"| | {s['dispatch_ns'] / 1000:+.2f} | {met} |"
        )
        if "rank_added_ns" in s:
            worst = max(s["rank_added_ns"], s["in_process_rank_added_ns"])
            met = "met" if worst <= GOAL_US * 1000 else "**not met**"
            lines.append(
                f"| `{loop}`, a rank of 2 | {s['bare_ns'] / 1000:.2f} | {s['hooked-rank_ns'] / 1000:.2f} "
                f"| {s['rank_added_ns'] / 1000:+.2f} | {s['in_process_rank_added_ns'] / 1000:+.2f} "
                f"| {s['in_process_step_hook_ns'] / 1000:+.2f} | {wrapper} | {s['dispatch_ns'] / 1000:+.2f} "
                f"| {met} |"
            )
    f = results["floors"]
    lines += [
        "",
        "| floor (one child, no torch, a hot loop of calls, an empty loop's cost taken off) | ns per call |",
        "|---|---:|",
        f"| `RankBoard.step()` | {f['board.step']:.0f} |",
        f"| `RankHooks.step()`, the hook torch calls (the board's step included) | {f['hooks.step']:.0f} |",
        f"| the backward wrapper, around nothing | {f['backward wrapper']:.0f} |",
    ]
    s = results["starts"]
    heavy = ", ".join(s["heavy_modules"]) or "none"
    lines += [
        "",
        f"| process start (`python -c pass`, {options.starts} rounds) | wall | CPU |",
        "|---|---:|---:|",
        f"| bare | {s['bare_ms']:.1f} ms | {s['bare_cpu_ms']:.1f} ms |",
        f"| hooked | {s['hooked_ms']:.1f} ms | {s['hooked_cpu_ms']:.1f} ms |",
        f"| added | {s['added_ms']:+.1f} ms | {s['added_cpu_ms']:+.1f} ms |",
        f"| `sitecustomize`'s import (`-X importtime`, cumulative) | {s['sitecustomize_import_ms']:.1f} ms | |",
        f"| modules it adds: otel_forge's / others | {len(s['otel_forge_modules'])} / {len(s['other_modules'])} | |",
        f"| of which torch, mlflow, opentelemetry, numpy, psutil | {heavy} | |",
        f"| board files written | {len(s['board_files'])} | |",
        "",
        "| a hooked process that does not step | board files |",
        "|---|---:|",
        *(f"| {name} | {len(files)} |" for name, files in results["no_step"].items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20_000, help="timed optimizer steps per child")
    parser.add_argument("--warmup", type=int, default=2_000)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--loops", nargs="+", choices=LOOPS, help="both unless --quick (step)")
    parser.add_argument("--starts", type=int, default=20, help="rounds of `python -c pass`, bare and hooked")
    parser.add_argument("--floor-calls", type=int, default=200_000)
    parser.add_argument(
        "--quick", action="store_true", help="1 round of 2,000 steps, the `step` loop unless --loops: ~10 s"
    )
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args(argv)
    if options.quick:
        options.rounds, options.steps, options.warmup, options.loops = 1, 2_000, 200, options.loops or ["step"]
        options.starts, options.floor_calls = 4, 20_000
    options.loops = options.loops or list(LOOPS)
    if options.steps < options.blocks:
        parser.error("--steps must be at least --blocks")

    with tempfile.TemporaryDirectory(prefix="bench-progress-") as directory:
        tmp = Path(directory)
        torch_version = child(["-c", "import torch; print(torch.__version__)"], None, tmp).stdout.strip()
        results: dict[str, Any] = {
            "torch": torch_version,
            "per_step": per_step(options, tmp),
            "floors": floors(options, tmp),
            "starts": starts(options, tmp),
            "no_step": no_step(tmp),
        }
    failures = [name for name, files in results["no_step"].items() if files]
    if results["starts"]["heavy_modules"] or results["starts"]["board_files"]:
        failures.append("process start")
    if options.json:
        print(json.dumps(results, indent=2))
    else:
        print(report(results, options))
    if failures:
        print(f"FAILED: a board written or a heavy module imported where none should be: {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
