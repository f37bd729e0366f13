"""How long ``with TrainingRun(config=<N flat entries>):`` takes to enter, against a real server.

Setup: a private ``mlflow server`` (testkit.mlflow_server.MlflowServer: sqlite, 127.0.0.1, one worker).
Each round is a fresh Python process (its imports of otel_forge and mlflow done before the clock
starts) that enters a ``TrainingRun`` with a config of N flat entries of every scalar kind, logs one
value and leaves the block. Reported, per round and as medians: the enter's wall time, when the
block's first MLflow call (a ``get_run``, as a framework's first call) returned and the params it saw,
and when every param was in the run (looked for every 0.5 s). One more round goes through a counting proxy
(testkit.proxy.MlflowProxy, which slows each call): the ``log-batch`` calls answered before the
enter returned, the params they carried and the server's time on them. Checked every round: the
run's params are the config's, exactly, and config.json is the config.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from bench._common import REPO_ROOT, private_server, wait_until
from testkit.hermetic import hermetic_environ
from testkit.mlflow_server import MlflowServer
from testkit.proxy import MlflowProxy

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"

CHILD = r"""
import json, sys, time
import mlflow  # imported before the clock starts, as a training script has
from otel_forge import TrainingRun

uri, experiment, entries = sys.argv[1], sys.argv[2], int(sys.argv[3])
kinds = (lambda i: i * 0.5, lambda i: i, lambda i: f"value-{i}", lambda i: i % 2 == 0, lambda i: None)
config = {f"param_{i:04d}": kinds[i % len(kinds)](i) for i in range(entries)}
run = TrainingRun(config, tracking_uri=uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"])
began = time.time()
with run:
    entered = time.time()
    # The block's first MLflow call (a framework's get_run, its log_params): the params it finds.
    seen = len(mlflow.MlflowClient(uri).get_run(run.run_id).data.params)
    answered = time.time()
    run.log({"loss": 1.0}, step=0)
left = time.time()
print(json.dumps({"run_id": run.run_id, "began": began, "entered": entered, "answered": answered,
                  "seen": seen, "left": left}), flush=True)
"""


def config_of(entries: int) -> dict[str, Any]:
    kinds = (lambda i: i * 0.5, lambda i: i, lambda i: f"value-{i}", lambda i: i % 2 == 0, lambda i: None)
    return {f"param_{i:04d}": kinds[i % len(kinds)](i) for i in range(entries)}


def one_round(server: MlflowServer, client: Any, entries: int, tmp: Path, counted: bool = False) -> dict[str, Any]:
    experiment = f"enter-{uuid.uuid4().hex[:8]}"
    spool = tmp / f"spool-{experiment}"
    with MlflowProxy(server.uri) as proxy:
        env = hermetic_environ(OTEL_FORGE_SPOOL_DIR=str(spool), PYTHONPATH=str(REPO_ROOT))
        done = subprocess.run(
            [sys.executable, "-c", CHILD, proxy.uri if counted else server.uri, experiment, str(entries)],
            env=env, capture_output=True, text=True, timeout=600, cwd=tmp,
        )  # fmt: skip
        if done.returncode != 0 or "{" not in done.stdout:
            raise RuntimeError(f"the training process exited {done.returncode}: {done.stderr[-3000:]}")
        child = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
        config = config_of(entries)
        expected = {key: str(value) for key, value in config.items() if value is not None}
        if not wait_until(lambda: len(client.get_run(child["run_id"]).data.params) >= len(expected), 300, 0.5):
            raise RuntimeError("the params did not all arrive")
        all_in = time.time()
        with proxy._lock:  # the proxy's own records: each call's arrival, answer and body together
            batches = [
                (r.arrived_at, r.answered_at, len((r.body or {}).get("params", ())))
                for r in proxy._requests
                if r.path == LOG_BATCH and r.answered_at is not None
            ]
    data = client.get_run(child["run_id"]).data
    if data.params != expected:
        raise RuntimeError(f"the run's params are not the config's: {len(data.params)} of {len(expected)}")
    config_json = json.loads(Path(client.download_artifacts(child["run_id"], "config.json", str(tmp))).read_text())
    if config_json != config:
        raise RuntimeError("config.json is not the config")
    before = [b for b in batches if b[1] <= child["entered"]]
    return {
        "enter_s": child["entered"] - child["began"],
        "first_call_s": child["answered"] - child["began"],
        "params_at_first_call": child["seen"],
        "batches_before_enter": len(before),
        "params_before_enter": sum(b[2] for b in before),
        "server_s_before_enter": sum(b[1] - b[0] for b in before),
        "params": len(expected),
        "param_batches": sum(1 for b in batches if b[2]),
        "all_params_in_s": all_in - child["began"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=5_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from mlflow import MlflowClient

    with private_server() as (tmp, server):
        client = MlflowClient(server.uri)
        one_round(server, client, 10, tmp)  # warm-up: the server's first calls import what they use
        rounds = [one_round(server, client, args.entries, tmp) for _ in range(args.rounds)]
        counted = one_round(server, client, args.entries, tmp, counted=True)
    timed = ("enter_s", "first_call_s", "params_at_first_call", "all_params_in_s")
    medians = {key: statistics.median(r[key] for r in rounds) for key in timed}
    if args.json:
        print(json.dumps({"rounds": rounds, "medians": medians, "through_the_proxy": counted}, indent=2))
        return 0
    print(f"`python -m bench.config_enter --entries {args.entries} --rounds {args.rounds}`\n")
    print("| round | enter (s) | block's first MLflow call answered (s) | params it saw | all params in (s) |")
    print("|---|---|---|---|---|")
    for name, row in [*((str(i + 1), r) for i, r in enumerate(rounds)), ("median", medians)]:
        print(
            f"| {name} | {row['enter_s']:.2f} | {row['first_call_s']:.2f} | {row['params_at_first_call']:g} | "
            f"{row['all_params_in_s']:.2f} |"
        )
    print(
        f"\nThrough the counting proxy: enter {counted['enter_s']:.2f} s; {counted['batches_before_enter']} "
        f"log-batch calls answered before it returned, carrying {counted['params_before_enter']} of the "
        f"{counted['params']} "
        f"params ({counted['param_batches']} calls of params in all), {counted['server_s_before_enter']:.2f} s "
        f"of the server's time; every param in at {counted['all_params_in_s']:.2f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
