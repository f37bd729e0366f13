"""``bench.fleet --at-defaults``: the size of the job's run and of a node run, what ``runs/get`` of each costs,
the same for the job's run of the old layout (every node's keys in it) projected to ``--fleet`` nodes; what
each of a node's calls costs the server, its node run's search in an experiment of ``--fleet`` node runs;
the run pages in MLflow's UI (headless Chromium, bench/run_page.py's probe)."""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from bench._fleet_parts import LOG_BATCH, CpuMeter, call

SEARCH = "/api/2.0/mlflow/runs/search"
CREATE = "/api/2.0/mlflow/runs/create"
PARENT_RUN_TAG, NODE_TAG = "mlflow.parentRunId", "otel_forge.node.id"

GET_RUN = "/api/2.0/mlflow/runs/get"
BATCH = 1000  # MLflow's limit of metrics per log_batch call
STEP_MS = 10_000


def get_run_timed(uri: str, run_id: str, repeats: int = 3) -> dict[str, float]:
    """``runs/get`` of the run on a new connection, one unmeasured call then ``repeats``: the median wall
    time (ms) and the answer's size (bytes)."""
    url = f"{uri}{GET_RUN}?run_id={run_id}"
    call(url)
    walls, size = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        size = len(call(url))
        walls.append(time.perf_counter() - started)
    return {"wall_ms": statistics.median(walls) * 1000, "bytes": size}


def run_size(client: Any, uri: str, run_id: str) -> dict[str, Any]:
    """Keys (``system/`` ones apart), params and tags of a run, and its ``runs/get``."""
    run = client.get_run(run_id)
    metrics = run.data.metrics
    return {
        "run_id": run_id,
        "keys": len(metrics),
        "system_keys": sum(1 for key in metrics if key.startswith("system/")),
        "params": len(run.data.params),
        "tags": len(run.data.tags),
        "get": get_run_timed(uri, run_id),
    }


def old_layout_run(client: Any, uri: str, node_keys: list[str], keys: int, steps: int) -> dict[str, Any]:
    """A run of the layout before node runs, built to ``keys`` keys: ``system/node_<n>/<key>`` with a node
    run's own keys, node after node, ``steps`` steps each (``log_batch`` calls of 1,000); its size and
    ``runs/get``, and the seconds the build took."""
    from mlflow.entities import Metric

    experiment_id = client.create_experiment(f"fleet-old-layout-{keys}-{time.time_ns()}")
    run_id = client.create_run(experiment_id, run_name=f"old-layout-{keys}-keys").info.run_id
    names = [f"system/node_{i // len(node_keys)}/{node_keys[i % len(node_keys)]}" for i in range(keys)]
    started, base_ms = time.monotonic(), int(time.time() * 1000) - steps * STEP_MS
    metrics = [
        Metric(key, float(i % 97 + step), base_ms + step * STEP_MS, step)
        for step in range(steps)
        for i, key in enumerate(names)
    ]
    for start in range(0, len(metrics), BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + BATCH])
    built_s = time.monotonic() - started
    return {**run_size(client, uri, run_id), "experiment_id": experiment_id, "steps": steps, "built_s": built_s}


def projection(job: dict[str, Any], node: dict[str, Any], old: dict[str, Any] | None, fleet: int) -> dict[str, Any]:
    """The job's run at ``fleet`` nodes: as measured in the node-run layout (it holds no node's keys); in the
    old layout ``fleet`` x a node's keys, its ``runs/get`` extrapolated along the line through the node
    run and the old-layout run (cost per key = the slope between them)."""
    result: dict[str, Any] = {"fleet": fleet, "job_run_keys": job["keys"], "job_run_get_ms": job["get"]["wall_ms"]}
    if old is None or old["keys"] <= node["keys"]:
        return result
    per_key_ms = (old["get"]["wall_ms"] - node["get"]["wall_ms"]) / (old["keys"] - node["keys"])
    per_key_bytes = (old["get"]["bytes"] - node["get"]["bytes"]) / (old["keys"] - node["keys"])
    keys = fleet * node["system_keys"]
    return {
        **result,
        "old_layout_keys": keys,
        "get_us_per_key": per_key_ms * 1000,
        "bytes_per_key": per_key_bytes,
        "old_layout_get_ms": old["get"]["wall_ms"] + per_key_ms * (keys - old["keys"]),
        "old_layout_bytes": old["get"]["bytes"] + per_key_bytes * (keys - old["keys"]),
    }


def node_search(experiment_id: str, parent: str, node: str) -> dict[str, Any]:
    """The body of the agent's one ``runs/search`` for its node run (node_run.open_node_run)."""
    return {
        "experiment_ids": [experiment_id],
        "filter": f"tags.`{PARENT_RUN_TAG}` = '{parent}' AND tags.`{NODE_TAG}` = '{node}'",
        "run_view_type": "ACTIVE_ONLY",
        "max_results": 1,
    }


def server_cost(meter: CpuMeter, calls: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, float], list[bytes]]:
    """The calls (url, body), one after the other on a new connection each: the server's CPU (its tree, +
    PostgreSQL's) per call (psutil's 10 ms ticks over them all) and the median wall time, in ms; the
    answers."""
    walls, answers, before = [], [], meter.read()["total"]
    for url, body in calls:
        started = time.perf_counter()
        answers.append(call(url, body))
        walls.append(time.perf_counter() - started)
    cpu_ms = (meter.read()["total"] - before) * 1000 / len(calls)
    return {"calls": len(calls), "cpu_ms": cpu_ms, "wall_ms": statistics.median(walls) * 1000}, answers


def call_costs(uri: str, meter: CpuMeter, node_keys: list[str], node_runs: int, repeats: int = 10) -> dict[str, Any]:
    """What each of a node's calls costs the server alone (after the fleet, no agent running). In a fresh
    experiment, a job's run and ``node_runs`` node runs under it (their tags only); then ``repeats`` new
    nodes each make an agent's calls in turn: the node run's ``runs/search`` (none yet), ``runs/create``,
    the first window (every key, new to the run, and the node's host tag), a later window (the first
    half of the keys, as changed values); then the search of nodes whose run exists."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    experiment_id = client.create_experiment(f"fleet-calls-{node_runs}-{time.time_ns()}")
    parent = client.create_run(experiment_id, run_name="job").info.run_id
    started = time.monotonic()
    for i in range(node_runs):
        client.create_run(experiment_id, run_name=f"node_{i}", tags={PARENT_RUN_TAG: parent, NODE_TAG: f"node_{i}"})
    built_s = time.monotonic() - started
    nodes = [f"new_{i}" for i in range(repeats)]
    search, _ = server_cost(meter, [(uri + SEARCH, node_search(experiment_id, parent, node)) for node in nodes])
    create, answers = server_cost(meter, [(uri + CREATE, create_body(experiment_id, parent, node)) for node in nodes])
    run_ids = [json.loads(answer)["run"]["info"]["run_id"] for answer in answers]
    half = node_keys[: len(node_keys) // 2]
    pairs = list(zip(run_ids, nodes, strict=True))
    first, _ = server_cost(meter, [(uri + LOG_BATCH, window(r, n, 0, node_keys)) for r, n in pairs])
    later, _ = server_cost(meter, [(uri + LOG_BATCH, window(r, n, 1, half)) for r, n in pairs])
    found, _ = server_cost(
        meter, [(uri + SEARCH, node_search(experiment_id, parent, f"node_{i}")) for i in range(repeats)]
    )
    return {
        "runs_in_experiment": node_runs + repeats + 1,
        "built_s": built_s,
        "first_window_keys": len(node_keys),
        "later_window_keys": len(half),
        "costs": {
            "runs/search (no node run yet)": search,
            "runs/create (the node run)": create,
            f"runs/log-batch, first window ({len(node_keys)} new keys)": first,
            f"runs/log-batch, later window ({len(half)} values)": later,
            "runs/search (the node run exists)": found,
        },
    }


def create_body(experiment_id: str, parent: str, node: str) -> dict[str, Any]:
    tags = [{"key": PARENT_RUN_TAG, "value": parent}, {"key": NODE_TAG, "value": node}]
    return {"experiment_id": experiment_id, "run_name": node, "start_time": int(time.time() * 1000), "tags": tags}


def window(run_id: str, node: str, step: int, keys: list[str]) -> dict[str, Any]:
    """A node's window as its agent sends it: ``system/<key>``; the first carries the node's host tag."""
    now = int(time.time() * 1000)
    metrics = [
        {"key": f"system/{key}", "value": float(i + step), "timestamp": now, "step": step} for i, key in enumerate(keys)
    ]
    tags = [{"key": f"otel_forge.node.{node}.host", "value": "bench"}] if step == 0 else []
    return {"run_id": run_id, "metrics": metrics, "tags": tags}


def pages(uri: str, runs: dict[str, tuple[str, str, str, int]], timeout_s: float) -> dict[str, Any]:
    """Each run page in headless Chromium (bench/run_page.py's browser and probe): ``runs`` maps a label
    to (experiment id, run id, tab, keys). Tab ``""``: the Overview, shown once it heads its metrics table
    "Metrics (<keys>)"; ``"/system-metrics"``: drawn once a chart card has a plotly line. The outcome, and
    the seconds from the navigation's start (the page's load included)."""
    from dataclasses import asdict

    from bench.run_page import chromium, chromium_available, probe

    if not chromium_available():
        return {"skipped": "/usr/bin/chromium or /usr/bin/chromedriver missing"}
    shown: dict[str, Any] = {}
    with chromium() as driver:
        for label, (experiment_id, run_id, tab, keys) in runs.items():
            url = f"{uri}/#/experiments/{experiment_id}/runs/{run_id}{tab}?workflowType=machine_learning"
            marker = None if tab else rf"Metrics\s*\(\s*{keys}\s*\)"
            shown[label] = {**asdict(probe(driver, url, timeout_s, marker=marker)), "keys": keys}
    return shown
