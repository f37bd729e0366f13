"""What a node of 8 ranks holds in memory: bare ranks, ranks in ``with TrainingRun()``, and ranks
with MLflow's own system-metrics monitor.

Run:  python -m bench.node_memory [--ranks 8] [--seconds 30] [--json]   (~2 min)

A private ``mlflow server`` (sqlite, one worker). Each variant starts ``--ranks`` Python processes at
once, each its own session, with torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID`` for the job's key) and the server in
``MLFLOW_TRACKING_URI``; every rank runs the same script for ``--seconds`` and logs one value a
second, as a training loop would:

- ``bare``: the loop alone (``time.sleep``);
- ``TrainingRun``: ``with otel_forge.TrainingRun() as run: run.log(...)`` (rank 0 logs; the others
  only enter the block); otel_forge starts what it starts (the node's companion);
- ``MLflow monitor``: every rank imports ``mlflow``, rank 0 logs in ``mlflow.start_run(
  log_system_metrics=True)`` (MLflow's own monitor, sampling every 10 s).

At ``--seconds`` less 5 s, psutil reads each rank and every process below it: RSS and USS (the memory
only it holds: what the node gets back if it ends), summed. "Added" is a variant's USS less the bare
ranks', and whether ``mlflow`` is imported in each rank (``sys.modules``, printed by the rank at its
end).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

from bench._common import REPO_ROOT
from testkit.hermetic import hermetic_environ
from testkit.mlflow_server import MlflowServer

GOAL_MB = 250.0
MB = 1024 * 1024

LOOP = """
import json, sys, time
{setup}
for step in range({seconds}):
    {log}
    time.sleep(1)
print(json.dumps({{"mlflow": "mlflow" in sys.modules}}))
"""

VARIANTS = {
    "bare": (LOOP, {"setup": "", "log": "pass"}),
    "TrainingRun": (
        "from otel_forge import TrainingRun\nwith TrainingRun() as run:\n{body}",
        {"setup": "", "log": "run.log({'loss': 1.0 / (step + 1)}, step=step)"},
    ),
    "MLflow monitor": (
        "import mlflow, os\n"
        "if os.environ['RANK'] == '0':\n"
        "    with mlflow.start_run(log_system_metrics=True):\n{body}\n"
        "else:\n{plain}",
        {
            "setup": "import mlflow",
            "log": "mlflow.log_metric('loss', 1.0 / (step + 1), step=step) if mlflow.active_run() else None",
        },
    ),
}


def script(variant: str, seconds: int) -> str:
    template, parts = VARIANTS[variant]
    loop = LOOP.format(seconds=seconds, **parts)
    if variant == "bare":
        return loop
    body = "\n".join("    " + line if line else line for line in loop.splitlines())
    if variant == "TrainingRun":
        return template.format(body=body)
    nested = "\n".join("        " + line if line else line for line in loop.splitlines())
    return template.format(body=nested, plain=body)


def job(variant: str, ranks: int, seconds: int, uri: str, workdir: Path) -> dict[str, object]:
    run_id = uuid.uuid4().hex
    code = script(variant, seconds)
    processes = []
    for rank in range(ranks):
        env = hermetic_environ(
            PYTHONPATH=str(REPO_ROOT), MLFLOW_TRACKING_URI=uri, MLFLOW_EXPERIMENT_NAME=f"node-memory-{run_id}",
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
            GROUP_RANK="0", TORCHELASTIC_RUN_ID=run_id, OTEL_FORGE_SPOOL_DIR=str(workdir / "spool"),
        )  # fmt: skip
        processes.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                cwd=workdir,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # fmt: skip
        )
    time.sleep(max(1, seconds - 5))
    rss = uss = count = 0
    for process in processes:
        try:
            tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in tree:
            try:
                info = member.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss, uss, count = rss + info.rss, uss + info.uss, count + 1
    imported = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        if process.returncode != 0:
            raise SystemExit(f"{variant}: a rank failed: {err[-2000:]}")
        # (MLflow prints its run's address after the rank's own line)
        imported.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["mlflow"])
    return {"processes": count, "rss_mb": rss / MB, "uss_mb": uss / MB, "ranks_with_mlflow": sum(imported)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-node-memory-") as tmp:
        workdir = Path(tmp)
        (workdir / "server").mkdir()
        with MlflowServer(workdir / "server") as server:
            results = {variant: job(variant, args.ranks, args.seconds, server.uri, workdir) for variant in VARIANTS}
    bare = results["bare"]["uss_mb"]
    for result in results.values():
        result["added_uss_mb"] = result["uss_mb"] - bare  # type: ignore[operator]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"A node of {args.ranks} ranks, read at {max(1, args.seconds - 5)} s, each rank and what it started.\n")
    print("| ranks | processes | RSS MB | USS MB | added USS MB | ranks that imported mlflow |")
    print("|---|---:|---:|---:|---:|---:|")
    for variant, r in results.items():
        print(
            f"| {variant} | {r['processes']} | {r['rss_mb']:,.0f} | {r['uss_mb']:,.0f} | "
            f"{r['added_uss_mb']:+,.0f} | {r['ranks_with_mlflow']} of {args.ranks} |"
        )
    added = results["TrainingRun"]["added_uss_mb"]
    print(f"\nWhat otel_forge adds to the node: {added:+,.0f} MB USS (goal at most {GOAL_MB:.0f} MB).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
