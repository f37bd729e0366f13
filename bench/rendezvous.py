"""Rendezvous cost: how long the last node of a job takes to attach to the job's run, and how many
tracking-server calls each node makes to get there, for 2, 8 and 32 simulated nodes.

Run:  python -m bench.rendezvous [--nodes 2 8 32] [--json]

Setup: a private ``mlflow server`` (testkit.mlflow_server.MlflowServer: sqlite, 127.0.0.1, one worker).
Each simulated node is one process with SLURM's variables (job id and step shared, ``SLURM_PROCID`` =
node index, local rank 0) talking to the server through a counting proxy of its own
(testkit.proxy.MlflowProxy), so every node's calls are counted by REST path. Every process imports
mlflow and otel_forge first, then waits on one start file, so the figures are the rendezvous's,
not the imports': "attached" is the time from the start file to ``TrainingRun.start()`` returning
with the run id (``system_metrics=False``: the node's exporter, which reads the run once to resume
its steps, is not part of the rendezvous).

Anchor, in the same run: the plain MLflow way, a run created beforehand and its id handed to every
node, which attaches with ``mlflow.start_run(run_id=...)`` (MLflow reads the whole run to do so).
Before each anchor attach, the run is grown to the size a job of that many nodes has after one
hour at 10 s windows with 8 GPUs (262 keys per node-window, latest values: ``--keys-per-node``),
so the anchor's read is shown at the size it really has; the rendezvous never reads the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import REPO_ROOT, percentile
from testkit.mlflow_server import MlflowServer
from testkit.proxy import MlflowProxy

NODE = r"""
import json, os, sys, time
import mlflow
from otel_forge import TrainingRun
gate, mode = sys.argv[1], sys.argv[2]
while not os.path.exists(gate):
    time.sleep(0.002)
started = time.time()
if mode == "forge":
    run = TrainingRun(system_metrics=False, launch_argv=["train.py"], init_deadline_s=120)
    run.start()
    run_id = run.run_id
else:
    mlflow.start_run(run_id=os.environ["BENCH_RUN_ID"])
    run_id = mlflow.active_run().info.run_id
attached = time.time() - started
print(json.dumps({"attached_s": attached, "run_id": run_id}), flush=True)
if mode == "forge":
    run.close()
"""


def _environ(proxy_uri: str, experiment: str, job_id: str, rank: int, nodes: int, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MLFLOW_", "OTEL_"))}
    env.update(
        {
            "MLFLOW_TRACKING_URI": proxy_uri,
            "MLFLOW_EXPERIMENT_NAME": experiment,
            "SLURM_JOB_ID": job_id,
            "SLURM_STEP_ID": "0",
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(rank),
            "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NTASKS": str(nodes),
            "TMPDIR": str(tmp),
            "PYTHONPATH": str(REPO_ROOT),
            "OTEL_FORGE_PROMETHEUS": "false",
        }
    )
    return env


def _job(server_uri: str, nodes: int, mode: str, tmp: Path, extra: dict[str, str]) -> dict[str, Any]:
    """Start ``nodes`` processes together; their attach times and per-node calls by path."""
    proxy_class = MlflowProxy
    experiment, job_id = f"bench-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex[:8]
    gate = tmp / f"gate-{job_id}"
    proxies = [proxy_class(server_uri) for _ in range(nodes)]
    processes = []
    try:
        for rank, proxy in enumerate(proxies):
            env = {**_environ(proxy.uri, experiment, job_id, rank, nodes, tmp), **extra}
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-c", NODE, str(gate), mode],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        time.sleep(3.0 + nodes * 0.25)  # every node has imported mlflow and waits at the gate
        gate.touch()
        outputs = [process.communicate(timeout=300) for process in processes]
        calls = [proxy.counts() for proxy in proxies]
    finally:
        for proxy in proxies:
            proxy.close()
    results = []
    for process, (out, err) in zip(processes, outputs, strict=False):
        if process.returncode != 0 or "{" not in out:
            raise RuntimeError(f"node exited {process.returncode}: {err[-2000:]}")
        # MLflow prints its run URL at exit: the node's figures are the JSON line.
        results.append(json.loads(next(line for line in out.splitlines() if line.startswith("{"))))
    run_ids = {r["run_id"] for r in results}
    return {"attached_s": [r["attached_s"] for r in results], "calls": calls, "runs": len(run_ids)}


def _grow_run(client: Any, run_id: str, nodes: int, keys_per_node: int) -> None:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    metrics = [Metric(f"system/node_{n}/key_{k}", 1.0, now, 360) for n in range(nodes) for k in range(keys_per_node)]
    for start in range(0, len(metrics), 1000):
        client.log_batch(run_id, metrics=metrics[start : start + 1000])


def _summary(job: dict[str, Any]) -> dict[str, Any]:
    per_node = [sum(calls.values()) for calls in job["calls"]]
    others = per_node[1:] or [0]
    paths: dict[str, int] = {}
    for calls in job["calls"][1:]:
        for path, count in calls.items():
            paths[path.rsplit("/mlflow/", 1)[-1]] = paths.get(path.rsplit("/mlflow/", 1)[-1], 0) + count
    return {
        "runs": job["runs"],
        "last_attached_s": max(job["attached_s"]),
        "p50_attached_s": percentile(job["attached_s"], 0.5),
        "rank0_calls": per_node[0],
        "other_calls_mean": sum(others) / len(others),
        "other_calls_max": max(others),
        "other_paths": dict(sorted(paths.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8, 32])
    parser.add_argument("--keys-per-node", type=int, default=262)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    server_class = MlflowServer
    from mlflow import MlflowClient

    rows = []
    with tempfile.TemporaryDirectory() as directory:
        tmp = Path(directory)
        (tmp / "server").mkdir()
        with server_class(tmp / "server") as server:
            client = MlflowClient(server.uri)
            for nodes in args.nodes:
                forge = _summary(_job(server.uri, nodes, "forge", tmp, {}))
                experiment_id = client.create_experiment(f"anchor-{uuid.uuid4().hex[:8]}")
                run_id = client.create_run(experiment_id).info.run_id
                _grow_run(client, run_id, nodes, args.keys_per_node)
                anchor = _summary(_job(server.uri, nodes, "mlflow", tmp, {"BENCH_RUN_ID": run_id}))
                rows.append({"nodes": nodes, "otel_forge": forge, "mlflow_run_id": anchor})
    print(json.dumps(rows, indent=2) if args.json else render_markdown(rows, args), flush=True)
    return 0


def render_markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines = [
        f"`python -m bench.rendezvous --nodes {' '.join(map(str, args.nodes))}` "
        f"(anchor run grown to {args.keys_per_node} keys per node)",
        "",
        "| nodes | runs | last node attached (s) | rank 0 calls | calls per other node (mean / max) | "
        "other nodes' calls by path | MLflow `start_run(run_id)`: last attached (s) / calls per node |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        forge, anchor = row["otel_forge"], row["mlflow_run_id"]
        paths = ", ".join(f"{path} {count}" for path, count in forge["other_paths"].items())
        lines.append(
            f"| {row['nodes']} | {forge['runs']} | {forge['last_attached_s']:.2f} | {forge['rank0_calls']} | "
            f"{forge['other_calls_mean']:.1f} / {forge['other_calls_max']} | {paths} | "
            f"{anchor['last_attached_s']:.2f} / {anchor['other_calls_mean']:.1f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
