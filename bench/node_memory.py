"""What a node of 8 ranks holds in memory: bare ranks, ranks in ``with TrainingRun()``, and ranks
with MLflow's own system-metrics monitor; or a node of 8 runs (a sweep's trials, each its own run).

Run:  python -m bench.node_memory [--ranks 8] [--runs] [--srun] [--backlog N] [--gpus N] [--seconds 30] [--json]

A private ``mlflow server`` (sqlite, one worker). Each variant starts ``--ranks`` Python processes at
once, each its own session, with torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID`` for the job's key) and the server in
``MLFLOW_TRACKING_URI``; with ``--runs``, without them: each process is a job of its own, with a
run of its own that it logs to and samples the node into. Every process runs the same script for
``--seconds`` and logs one value a second, as a training loop would:

- ``bare``: the loop alone (``time.sleep``);
- ``TrainingRun``: ``with otel_forge.TrainingRun() as run: run.log(...)`` (rank 0 logs; the others
  only enter the block); otel_forge starts what it starts (the node's companion);
- ``MLflow monitor``: every rank imports ``mlflow``, rank 0 logs in ``mlflow.start_run(
  log_system_metrics=True)`` (MLflow's own monitor, sampling every 10 s); with ``--runs``, every
  process.

At ``--seconds`` less 5 s, psutil reads each rank and every process below it: RSS and USS (the memory
only it holds: what the node gets back if it ends), summed. "Added" is a variant's USS less the bare
ranks', and whether ``mlflow`` is imported in each rank (``sys.modules``, printed by the rank at its
end). The companions among them are summed apart too (and the CPU they used so far): however many
processes it serves, a node has one, which samples the node once for all of them. ``--backlog N``
adds TrainingRun again once the server is gone, each process logging N values at its start: the
companion holds at most a bounded read-ahead of each journal. ``--gpus N``: the node's N GPUs are
the fake NVML of ``tests/fakes`` (a read costs what the fake costs; how often they are read is what
the companions' CPU shows).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from mlflow import MlflowClient

from bench._common import REPO_ROOT
from testkit.gpu_fakes import fake_gpu_env
from testkit.hermetic import hermetic_environ
from testkit.mlflow_server import MlflowServer

GOAL_MB = 250.0
COMPANION = "otel_forge.cli.companion"
MB = 1024 * 1024

LOOP = """
import json, sys, time
{setup}
{burst}
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
        "if os.environ.get('RANK', '0') == '0':\n"
        "    with mlflow.start_run(log_system_metrics=True):\n{body}\n"
        "else:\n{plain}",
        {
            "setup": "import mlflow",
            "log": "mlflow.log_metric('loss', 1.0 / (step + 1), step=step) if mlflow.active_run() else None",
        },
    ),
}


def script(variant: str, seconds: int, backlog: int = 0) -> str:
    template, parts = VARIANTS[variant]
    burst = f"for step in range({backlog}):\n    run.log({{'burst': 1.0}}, step=step)" if backlog else ""
    loop = LOOP.format(seconds=seconds, burst=burst, **parts)
    if variant == "bare":
        return loop
    body = "\n".join("    " + line if line else line for line in loop.splitlines())
    if variant == "TrainingRun":
        return template.format(body=body)
    nested = "\n".join("        " + line if line else line for line in loop.splitlines())
    return template.format(body=nested, plain=body)


def _launcher(rank: int, ranks: int, job_key: str) -> dict[str, str]:
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks),
        "GROUP_RANK": "0", "TORCHELASTIC_RUN_ID": job_key,
    }  # fmt: skip


def _srun_task(rank: int, ranks: int, job_key: str) -> dict[str, str]:
    """What ``srun --ntasks-per-node=N`` gives each task of one node."""
    job_id = str(int(job_key[:7], 16))
    return {
        "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0", "SLURM_NTASKS": str(ranks), "SLURM_JOB_NUM_NODES": "1",
        "SLURM_NTASKS_PER_NODE": str(ranks),
    }  # fmt: skip


def job(
    variant: str,
    ranks: int,
    seconds: int,
    uri: str,
    workdir: Path,
    runs: bool,
    backlog: int = 0,
    gpus: int = 0,
    srun: bool = False,
) -> dict[str, object]:
    """``srun``: each rank is ``otel-forge run -- python ...`` with SLURM's variables, as ``srun
    otel-forge run`` starts one per task."""
    run_id = uuid.uuid4().hex
    code = script(variant, seconds, backlog)
    # Made here: MLflow's fluent API in 8 processes at once races to create it, and all but one fail.
    MlflowClient(uri).create_experiment(f"node-memory-{run_id}")
    processes = []
    for rank in range(ranks):
        env = hermetic_environ(
            PYTHONPATH=str(REPO_ROOT),
            MLFLOW_TRACKING_URI=uri,
            MLFLOW_EXPERIMENT_NAME=f"node-memory-{run_id}",
            OTEL_FORGE_SPOOL_DIR=str(workdir / "spool"),
            **({} if runs else (_srun_task if srun else _launcher)(rank, ranks, run_id)),
        )
        if gpus:
            env = fake_gpu_env({"count": gpus}, base=env)
        command = [sys.executable, "-c", code]
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", "otel_forge.cli", "run", "--", *command] if srun else command,
                env=env,
                cwd=workdir,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )  # fmt: skip
        )
    time.sleep(max(1, seconds - 5))
    rss = uss = count = companions = companion_uss = 0
    companion_cpu_s = 0.0
    for process in processes:
        try:
            tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in tree:
            try:
                info, argv = member.memory_full_info(), member.cmdline()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss, uss, count = rss + info.rss, uss + info.uss, count + 1
            if COMPANION in argv:
                companions, companion_uss = companions + 1, companion_uss + info.uss
                with contextlib.suppress(psutil.NoSuchProcess):
                    cpu = member.cpu_times()
                    companion_cpu_s += cpu.user + cpu.system
    imported = []
    for process in processes:
        out, err = process.communicate(timeout=120)
        if process.returncode != 0:
            raise SystemExit(f"{variant}: a rank failed: {err[-2000:]}")
        # (MLflow prints its run's address after the rank's own line)
        imported.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1])["mlflow"])
    return {
        "processes": count, "rss_mb": rss / MB, "uss_mb": uss / MB, "ranks_with_mlflow": sum(imported),
        "companions": companions, "companion_uss_mb": companion_uss / MB, "companion_cpu_s": companion_cpu_s,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--runs", action="store_true", help="each process a job and a run of its own")
    parser.add_argument("--seconds", type=int, default=30)
    parser.add_argument(
        "--backlog", type=int, default=0, metavar="N",
        help="and TrainingRun again, each process logging N values at once to a server that is down",
    )  # fmt: skip
    parser.add_argument(
        "--gpus", type=int, default=0, metavar="N",
        help="the node has N GPUs, the fake NVML of tests/fakes: what counts is how often they are read",
    )  # fmt: skip
    parser.add_argument(
        "--srun", action="store_true", help="and TrainingRun again, each rank under its own `otel-forge run` (srun)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-node-memory-") as tmp:
        workdir = Path(tmp)
        (workdir / "server").mkdir()
        with MlflowServer(workdir / "server") as server:
            results = {
                variant: job(variant, args.ranks, args.seconds, server.uri, workdir, args.runs, gpus=args.gpus)
                for variant in VARIANTS
            }
            if args.srun:
                results["TrainingRun, each rank under srun otel-forge run"] = job(
                    "TrainingRun", args.ranks, args.seconds, server.uri, workdir, args.runs, gpus=args.gpus, srun=True
                )
        if args.backlog:  # the server is gone: the journals' delivery waits, reading ahead as far as it may
            down = f"TrainingRun, {args.backlog:,} values each, server down"
            results[down] = job(
                "TrainingRun", args.ranks, args.seconds, server.uri, workdir, args.runs, args.backlog, args.gpus
            )
    bare = results["bare"]["uss_mb"]
    for result in results.values():
        result["added_uss_mb"] = result["uss_mb"] - bare  # type: ignore[operator]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    shape = "runs (each its own job)" if args.runs else "ranks"
    print(f"A node of {args.ranks} {shape}, read at {max(1, args.seconds - 5)} s, each process and what it started.\n")
    print(
        "| processes | all | RSS MB | USS MB | added USS MB | of it, companions (USS MB) | companions' CPU s "
        "| that imported mlflow |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|"
    )
    for variant, r in results.items():
        print(
            f"| {variant} | {r['processes']} | {r['rss_mb']:,.0f} | {r['uss_mb']:,.0f} | {r['added_uss_mb']:+,.0f} | "
            f"{r['companions']} ({r['companion_uss_mb']:,.0f}) | {r['companion_cpu_s']:.1f} | "
            f"{r['ranks_with_mlflow']} of {args.ranks} |"
        )
    added = results["TrainingRun"]["added_uss_mb"]
    print(f"\nWhat otel_forge adds to the node: {added:+,.0f} MB USS (goal at most {GOAL_MB:.0f} MB).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
