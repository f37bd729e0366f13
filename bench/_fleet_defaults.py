"""``bench.fleet --at-defaults``: K real agents of a ``--fleet``-node job at otel_forge's defaults, in real
time, measured minute by minute (see bench/fleet.py's docstring for what and how)."""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench._common import wait_until
from bench._fleet_parts import (
    DEFAULT_INTERVAL_S,
    CpuMeter,
    Deliveries,
    Fleet,
    Postgres,
    counting_proxy,
    cpu_delta_ms,
    error_answers,
    node_env,
    ours_command,
    reaped_cpu_s,
    server_messages,
    short_path,
    spooled,
    start_server,
    warm_up,
)
from bench._fleet_size import call_costs, old_layout_run, pages, projection, run_size
from testkit.mlflow_server import MlflowServer

MINUTE_S = 60.0
UPDATE_RUN = "/api/2.0/mlflow/runs/update"
JOB_EXPERIMENT = "0"  # MLflow's default experiment: the standalone case, no MLFLOW_EXPERIMENT_ID
PARENT_RUN_TAG, NODE_TAG = "mlflow.parentRunId", "otel_forge.node.id"
ISSUE_PHASE = (1, 4)  # the issue's figure: server CPU from minute 1 to minute 4
GOAL_MS_PER_NODE_MINUTE = 60.0  # ... at most this, on sqlite
START_GOAL_S, STOP_GOAL_S = 30.0, 90.0  # every node's first window after the start, last after the stop
STOP_SLACK_S = 2.0
# The ways a node's windows can fall short, each a list of nodes (see completeness()).
COMPLETENESS_CHECKS = (
    "no_run",
    "no_window",
    "not_contiguous",
    "delivered_not_stored",
    "ended_early",
    "not_finished",
)  # a node's last window may end this long before the stop, beyond one interval


@dataclass
class Mark:
    """The server's CPU, the requests that had arrived and the agents' CPU, ``t`` s after the agents' start."""

    t: float
    cpu: dict[str, float]
    calls: int
    wall: float  # time.time(), for the proxy's answers
    agents_cpu_s: float

    @classmethod
    def now(cls, started: float, meter: CpuMeter, deliveries: Deliveries, fleet: Fleet) -> Mark:
        cpu, calls, agents = meter.read(), deliveries.poll(), fleet.cpu_s()
        return cls(time.monotonic() - started, cpu, calls, time.time(), agents)


def measure_backend(args: argparse.Namespace, backend: str, postgres: Postgres | None, spw: int) -> dict[str, Any]:
    """One backend: a fresh server and job's run, the fleet for ``--minutes``, then the node runs read back,
    the runs' sizes and (``--pages``, on the first backend) the run pages."""
    from mlflow import MlflowClient

    with tempfile.TemporaryDirectory(prefix=f"fleet-defaults-{backend}-") as directory:
        tmp = Path(directory)
        server, meter = start_server(backend, tmp, "defaults", postgres, args.pg_workers)
        proxy = counting_proxy(server.uri)
        fleet = Fleet(tmp)
        try:
            client = MlflowClient(server.uri)
            # As a standalone `otel-forge monitor --run-id` meets it: a run in MLflow's default experiment.
            job_run = client.create_run(JOB_EXPERIMENT, run_name="fleet-job").info.run_id
            row = run_fleet(args, tmp, server, meter, proxy, fleet, job_run)
            row.update(backend=backend, samples_per_window=spw)
            row["completeness"] = completeness(client, job_run, args, row)
            row["sizes"] = sizes(args, client, server, job_run, row["completeness"])
            if args.pages and backend == args.backends[0]:
                row["pages"] = run_pages(args, server, job_run, row)
            if args.experiment_runs and row["sizes"]["node_keys"]:
                row["call_costs"] = call_costs(server.uri, meter, row["sizes"]["node_keys"], args.experiment_runs)
            return row
        finally:
            fleet.stop(5.0)
            proxy.close()
            server.stop()


def run_fleet(
    args: argparse.Namespace,
    tmp: Path,
    server: MlflowServer,
    meter: CpuMeter,
    proxy: Any,
    fleet: Fleet,
    job_run: str,
) -> dict[str, Any]:
    """The K agents, started together, for ``--minutes``; the server's CPU and calls read every minute;
    then SIGTERM and their drain."""
    from mlflow import MlflowClient

    k = args.nodes
    deliveries = Deliveries(proxy)
    warm_up(MlflowClient(server.uri), server.uri)
    idle_before, idle_at = meter.read(), time.monotonic()
    time.sleep(args.idle_seconds)
    idle_ms_per_s = cpu_delta_ms(meter.read(), idle_before)["total"] / (time.monotonic() - idle_at)

    load_at_start = os.getloadavg()[0]  # this machine's other work: 2 cores shared with the agents
    commands = [ours_command(job_run, proxy.uri, i, None) for i in range(k)]
    job_id = uuid.uuid4().hex[:8]
    # No MLFLOW_EXPERIMENT_ID (node_env is hermetic): each agent takes MLflow's default experiment.
    envs = [node_env(i, args, job_id, tmp) for i in range(k)]
    start_wall, started = time.time(), time.monotonic()
    marks = [Mark.now(started, meter, deliveries, fleet)]
    fleet.start(commands, envs)
    every_first_s: float | None = None  # when every node's first window had reached the server
    for minute in range(1, args.minutes + 1):
        while (left := started + minute * MINUTE_S - time.monotonic()) > 0:
            deliveries.poll()
            if every_first_s is None and deliveries.nodes_with(1) >= k:
                every_first_s = time.monotonic() - started
            if len(fleet.exited()) == k:
                raise RuntimeError(f"every node exited; node_0's output:\n{fleet.log_tail(0)}")
            time.sleep(min(0.5, left))
        marks.append(Mark.now(started, meter, deliveries, fleet))
    exited_early = fleet.exited()
    lags = [time.time() - log.newest_ms / 1e3 for log in deliveries.nodes.values()]

    stop_wall, stop_at, live_s, reaped_s = time.time(), time.monotonic(), fleet.cpu_s(), reaped_cpu_s()
    exit_codes = fleet.stop(args.stop_timeout)
    wait_until(lambda: sum(proxy.counts().values()) >= proxy.total(), 30)
    end = after_the_stop(args, tmp, proxy, job_id, stop_at)
    stopped = Mark.now(started, meter, deliveries, fleet)
    # The agents are gone: what they spent closing is their whole CPU, reaped, less what they had spent.
    stopped.agents_cpu_s = marks[-1].agents_cpu_s + (reaped_cpu_s() - reaped_s) - live_s
    marks.append(stopped)
    answers = proxy.log()
    return {
        "nodes": k,
        "fleet": args.fleet,
        "minutes": args.minutes,
        "idle_cpu_ms_per_s": idle_ms_per_s,
        "load_at_start": load_at_start,
        "every_first_window_s": every_first_s,
        "phases": phases(marks, deliveries, answers, k, every_first_s),
        "per_minute": [
            phase(marks[i], marks[i + 1], deliveries, answers, k, f"minute {i}-{i + 1}") for i in range(len(marks) - 2)
        ],
        "keys_per_node": deliveries.keys_per_node(),
        "gpus_seen": deliveries.gpus_seen(),
        "calls": deliveries.between(0)["calls"],
        "delivered": {node: sorted(log.steps) for node, log in deliveries.nodes.items()},
        "lag_at_stop_s": max(lags, default=None),
        "start_wall": start_wall,
        "stop_wall": stop_wall,
        "spooled_at_exit": end["left_by_the_agents"],
        "end": end,
        "error_answers": error_answers(proxy),
        "agent_messages": fleet.messages(),
        "server_messages": server_messages(server),
        "nodes_exited_early": exited_early,
        "nodes_killed_at_stop": fleet.killed,
        "nonzero_exit_codes": [code for code in exit_codes if code != 0],
        # Why a node ended early or badly: the end of its output (its traceback, if any).
        "failed_node_output": {
            f"node_{i}": fleet.log_tail(i) for i, code in enumerate(exit_codes) if code != 0 or i in exited_early
        },
    }


def after_the_stop(args: argparse.Namespace, tmp: Path, proxy: Any, job_id: str, stop_at: float) -> dict[str, Any]:
    """What the stopped agents left in their spools, then the next job's agent on this machine (node 0
    of a new job's run, the same spool root), as the next job on these nodes would start: it delivers
    what was left in the background. Until every node run is ended FINISHED and no window is left, or
    ``--stop-timeout`` after the stop."""
    from mlflow import MlflowClient

    left = spooled(tmp / "spool")
    result: dict[str, Any] = {"left_by_the_agents": left, "next_agent": left > 0}
    if left:
        next_run = MlflowClient(proxy.uri).create_run(JOB_EXPERIMENT, run_name="next-job").info.run_id
        env = node_env(0, args, f"{job_id}-next", tmp)
        with open(tmp / "next_agent.log", "wb") as log:
            agent = subprocess.Popen(
                ours_command(next_run, proxy.uri, 0, None), env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
    ended = wait_until(
        lambda: finished_node_runs(proxy) >= args.nodes and not spooled(tmp / "spool"),
        max(0.0, stop_at + args.stop_timeout - time.monotonic()),
        0.5,
    )
    result.update(
        every_last_window_in_s=time.monotonic() - stop_at if ended else None,
        node_runs_finished=finished_node_runs(proxy),
        left_at_the_end=spooled(tmp / "spool"),
    )
    if left:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(args.stop_timeout)
    return result


def finished_node_runs(proxy: Any) -> int:
    """Runs the server ended FINISHED (``runs/update``, answered): the node runs, at the stop."""
    return len({body["run_id"] for body in proxy.accepted(UPDATE_RUN) if body.get("status") == "FINISHED"})


def phase(before: Mark, after: Mark, deliveries: Deliveries, answers: list[Any], k: int, name: str) -> dict[str, Any]:
    """Server CPU between two marks, per node-minute, the calls by path that arrived meanwhile and the error
    answers given meanwhile (``answers``: the proxy's log)."""
    cpu = cpu_delta_ms(after.cpu, before.cpu)
    node_minutes = k * (after.t - before.t) / MINUTE_S
    return {
        "name": name,
        "from_s": before.t,
        "to_s": after.t,
        "cpu_ms": cpu,
        "ms_per_node_minute": cpu["total"] / node_minutes if node_minutes else None,
        "database_ms_per_node_minute": cpu["database"] / node_minutes if node_minutes else None,
        "agents_cpu_s": after.agents_cpu_s - before.agents_cpu_s,
        "calls": deliveries.between(before.calls, after.calls)["calls"],
        "error_answers": dict(
            Counter(
                f"{status} {short_path(path)}"
                for at, _, path, status in answers
                if status >= 400 and before.wall <= at < after.wall
            )
        ),
    }


def phases(
    marks: list[Mark], deliveries: Deliveries, answers: list[Any], k: int, every_first_s: float | None
) -> list[dict[str, Any]]:
    """Minute 0-1 (the start), minutes 1-4 (the issue's figure), the steady state (from the first whole
    minute after every node's first window reached the server to the end) and the stop (SIGTERM to the
    last answer). ``marks``: one per minute, then the stop's."""
    minutes = len(marks) - 2
    result = [phase(marks[0], marks[1], deliveries, answers, k, "minute 0-1 (start)")]
    first, last = ISSUE_PHASE[0], min(ISSUE_PHASE[1], minutes)
    if last > first:
        result.append(phase(marks[first], marks[last], deliveries, answers, k, f"minutes {first}-{last}"))
    steady = math.ceil(every_first_s / MINUTE_S) if every_first_s is not None else minutes
    if steady < minutes:
        steady_name = f"steady, minutes {steady}-{minutes}"
        result.append(phase(marks[steady], marks[minutes], deliveries, answers, k, steady_name))
    elif every_first_s is not None and minutes - 1 >= last:
        # The first windows took every minute but the last (long windows): that one, said so.
        last_name = f"last minute {minutes - 1}-{minutes} (first windows until {every_first_s:.0f} s)"
        result.append(phase(marks[minutes - 1], marks[minutes], deliveries, answers, k, last_name))
    result.append(phase(marks[minutes], marks[-1], deliveries, answers, k, "stop (SIGTERM, to the last window in)"))
    result.append(phase(marks[0], marks[-1], deliveries, answers, k, "whole run (start to the last window in)"))
    return result


# --- read back ------------------------------------------------------------------------------------------


def node_runs(client: Any, job_run: str) -> dict[str, Any]:
    """The job's node runs by node id, found as the issue says: by their parent tag."""
    found = client.search_runs([JOB_EXPERIMENT], f"tags.`{PARENT_RUN_TAG}` = '{job_run}'", max_results=5000)
    return {run.data.tags.get(NODE_TAG, run.info.run_name): run for run in found}


def completeness(client: Any, job_run: str, args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any]:
    """Every node's windows in its node run: the history of its anchor key (its smallest, in every window)
    holds steps 0..n-1, every step that reached the server, and a last window that ends within one
    interval (+ ``STOP_SLACK_S``) of the stop; the run ended FINISHED. Windows left in spools and error
    answers are in ``row``."""
    runs = node_runs(client, job_run)
    nodes: dict[str, dict[str, Any]] = {}
    for i in range(args.nodes):
        node = f"node_{i}"
        if (run := runs.get(node)) is None:
            nodes[node] = {"run": None}
            continue
        system = sorted(key for key in run.data.metrics if key.startswith("system/"))
        history = client.get_metric_history(run.info.run_id, system[0]) if system else []
        steps = sorted(m.step for m in history)
        last_ms = max((m.timestamp for m in history), default=None)
        nodes[node] = {
            "run": run.info.run_id,
            "status": run.info.status,
            "keys": len(system),
            "windows": len(steps),
            "contiguous": steps == list(range(len(steps))),
            "all_delivered_stored": set(row["delivered"].get(node, ())) <= set(steps),
            "last_window_before_stop_s": None if last_ms is None else row["stop_wall"] - last_ms / 1e3,
        }
    late_s = DEFAULT_INTERVAL_S + STOP_SLACK_S

    def which(test: Any) -> list[str]:
        return [node for node, n in nodes.items() if test(n)]

    ends = [n["last_window_before_stop_s"] for n in nodes.values() if n.get("last_window_before_stop_s") is not None]
    windows = [n["windows"] for n in nodes.values() if n["run"]]
    result = {
        "node_runs": len(runs),
        "windows_min": min(windows, default=0),
        "windows_max": max(windows, default=0),
        "windows": sum(windows),
        "finished_runs": len(which(lambda n: n["run"] and n["status"] == "FINISHED")),
        "last_window_before_stop_max_s": max(ends, default=None),
        "no_run": which(lambda n: not n["run"]),
        "no_window": which(lambda n: n["run"] and not n["windows"]),
        "not_contiguous": which(lambda n: n["run"] and not n["contiguous"]),
        "delivered_not_stored": which(lambda n: n["run"] and not n["all_delivered_stored"]),
        "ended_early": which(lambda n: (n.get("last_window_before_stop_s") or 0) > late_s),
        "not_finished": which(lambda n: n["run"] and n["status"] != "FINISHED"),
    }
    failing = set().union(*(result[name] for name in COMPLETENESS_CHECKS))
    return {**result, "complete_nodes": args.nodes - len(failing), "nodes": nodes}


def sizes(
    args: argparse.Namespace, client: Any, server: MlflowServer, job_run: str, complete: dict[str, Any]
) -> dict[str, Any]:
    """The job's run and a node run (the one with the most windows, node_0's of those), a run of the old
    layout built to ``--old-layout-keys`` keys, and the projection to ``--fleet`` nodes."""
    nodes = complete["nodes"]
    node_id = max(nodes, key=lambda node: (nodes[node].get("windows", -1), node == "node_0"))
    node_run = nodes[node_id]["run"]
    job = run_size(client, server.uri, job_run)
    node = {**run_size(client, server.uri, node_run), "node": node_id} if node_run else None
    keys = []
    if node_run:
        metrics = client.get_run(node_run).data.metrics
        keys = sorted(key.removeprefix("system/") for key in metrics if key.startswith("system/"))
    old = None
    if keys and args.old_layout_keys:
        old = old_layout_run(client, server.uri, keys, args.old_layout_keys, args.old_layout_steps)
    return {
        "node_keys": keys,
        "job_run": job,
        "node_run": node,
        "old_layout_run": old,
        "projection": projection(job, node, old, args.fleet) if node else None,
    }


def run_pages(args: argparse.Namespace, server: MlflowServer, job_run: str, row: dict[str, Any]) -> dict[str, Any]:
    """The job's run's Overview, the node run's System metrics tab, and both of the old layout's run."""
    s, tab = row["sizes"], "/system-metrics"
    runs = {"job's run, Overview": (JOB_EXPERIMENT, job_run, "", s["job_run"]["keys"])}
    if node := s["node_run"]:
        runs[f"{node['node']}'s run, System metrics"] = (JOB_EXPERIMENT, node["run_id"], tab, node["keys"])
    if old := s["old_layout_run"]:
        built, keys = (old["experiment_id"], old["run_id"]), old["keys"]
        runs[f"old layout ({keys:,} keys), Overview"] = (*built, "", keys)
        runs[f"old layout ({keys:,} keys), System metrics"] = (*built, tab, keys)
    return pages(server.uri, runs, args.page_timeout)


# --- output ---------------------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def calls_text(calls: dict[str, int]) -> str:
    return ", ".join(f"{path} {n}" for path, n in sorted(calls.items())) or "none"


def errors_text(errors: dict[str, int]) -> str:
    return f"; error answers: {calls_text(errors)}" if errors else ""


def render_markdown(result: dict[str, Any]) -> str:
    a, m = result["settings"], result["machine"]
    rows = [row for row in result["rows"] if "skipped" not in row]
    lines = [
        f"`{result['command']}`",
        "",
        (
            f"{a['nodes']} real `otel-forge monitor` agents of a {a['fleet']}-node SLURM job (node runs: the job has "
            f"more than node_runs_above = {result['node_runs_above']} nodes), {a['minutes']} min in real time at "
            f"the defaults: {DEFAULT_INTERVAL_S:g} s interval, {result['samples_per_window']} samples per window "
            f"({DEFAULT_INTERVAL_S * result['samples_per_window']:g} s windows); the job's run created in MLflow's "
            f"default experiment, no MLFLOW_EXPERIMENT_ID; 8 fake NVIDIA GPUs per node; a fresh `mlflow server` "
            f"per backend behind a counting proxy; {m['cpus']} CPUs shared by the server and the agents, Python "
            f"{m['python']}, mlflow {m['mlflow']}, otel_forge at {result.get('commit', 'unknown')}; 1-minute load "
            f"average before the start "
            f"{fmt(result['load_before'], 2)}. MLflow's own monitor is not run in this mode (the compressed mode, "
            f"without --at-defaults, compares with it)."
        ),
        "",
        "| backend | phase | server CPU, ms | ms per node | ms per node-minute | of which PostgreSQL | agents' CPU, s "
        "| calls |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        for p in row["phases"]:
            stop = p["name"].startswith("stop")  # seconds long: per node-minute says nothing
            per_minute = None if stop else p["ms_per_node_minute"]
            database = None if stop or row["backend"] != "postgresql" else p["database_ms_per_node_minute"]
            lines.append(
                f"| {row['backend']} | {p['name']} ({p['from_s']:.0f}-{p['to_s']:.0f} s) | {p['cpu_ms']['total']:,.0f} "
                f"| {p['cpu_ms']['total'] / row['nodes']:.1f} | {fmt(per_minute, 1)} | {fmt(database, 1)} "
                f"| {p['agents_cpu_s']:.1f} | {calls_text(p['calls'])}{errors_text(p['error_answers'])} |"
            )
    lines += [
        "",
        "| backend | node runs | complete nodes | windows per node | steps 0..n-1 | last window before the stop, max "
        "| runs FINISHED | left in spools | error answers | `runs/get` calls |",
        "|---|---:|---:|---|---|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        c = row["completeness"]
        lines.append(
            f"| {row['backend']} | {c['node_runs']} | {c['complete_nodes']} / {row['nodes']} "
            f"| {c['windows_min']}-{c['windows_max']} | {'yes' if not c['not_contiguous'] else c['not_contiguous']} "
            f"| {fmt(c['last_window_before_stop_max_s'], 1)} s | {c['finished_runs']} | {row['spooled_at_exit']} "
            f"| {calls_text(row['error_answers'])} | {row['calls'].get('runs/get', 0)} |"
        )
    lines += [
        "",
        "| backend | run | keys (system/) | params | tags | `runs/get` ms | `runs/get` bytes |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        s = row["sizes"]
        for label, run in (
            ("job's run", s["job_run"]),
            (f"{s['node_run']['node']}'s run" if s["node_run"] else "", s["node_run"]),
            ("old layout, built", s["old_layout_run"]),
        ):
            if run:
                lines.append(
                    f"| {row['backend']} | {label} | {run['keys']:,} ({run['system_keys']:,}) | {run['params']} "
                    f"| {run['tags']} | {run['get']['wall_ms']:.1f} | {run['get']['bytes']:,} |"
                )
        if (p := s["projection"]) and "old_layout_keys" in p:
            lines.append(
                f"| {row['backend']} | old layout at {p['fleet']:,} nodes (projected: {p['get_us_per_key']:.1f} µs, "
                f"{p['bytes_per_key']:.0f} bytes per key) | {p['old_layout_keys']:,} | | "
                f"| {p['old_layout_get_ms']:,.0f} | {p['old_layout_bytes']:,.0f} |"
            )
    lines += call_cost_lines(rows)
    lines += ["", *notes(result, rows)]
    return "\n".join(lines)


def call_cost_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each of a node's calls alone, and the fleet's minutes 1-4 they add up to (per node-minute)."""
    costed = [row for row in rows if row.get("call_costs")]
    if not costed:
        return []
    first = costed[0]["call_costs"]
    lines = [
        "",
        f"Each of a node's calls alone, after the fleet (10 new nodes in turn, in an experiment of "
        f"{first['runs_in_experiment']:,} runs: a job's run and its node runs):",
        "",
        "| backend | call | server CPU ms per call | wall ms |",
        "|---|---|---:|---:|",
    ]
    for row in costed:
        for name, cost in row["call_costs"]["costs"].items():
            lines.append(f"| {row['backend']} | {name} | {cost['cpu_ms']:.1f} | {cost['wall_ms']:.1f} |")
    return lines


def modelled_minutes_1_4(costs: dict[str, Any]) -> float:
    """Server CPU per node-minute over minutes 1-4 that the calls alone add up to: each node's search,
    create and first window, and two later windows, in 3 minutes (the server's idle CPU not included)."""
    c = [cost["cpu_ms"] for cost in costs["costs"].values()]
    search, create, first, later = c[0], c[1], c[2], c[3]
    return (search + create + first + 2 * later) / 3


def notes(result: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for row in rows:
        p = row["sizes"]["projection"]
        if p:
            lines.append(
                f"- {row['backend']}: the job's run holds {p['job_run_keys']} keys whatever the node count (each node "
                f"writes only its own run): at {p['fleet']:,} nodes its `runs/get` stays {p['job_run_get_ms']:.1f} ms "
                f"as measured with {row['nodes']} nodes."
            )
        minutes = "; ".join(f"{m['name']} {fmt(m['ms_per_node_minute'], 1)}" for m in row["per_minute"])
        lines.append(
            f"- {row['backend']}: ms per node-minute by minute: {minutes}; every node's first window in by "
            f"{fmt(row['every_first_window_s'], 0)} s; 1-minute load average {row['load_at_start']:.2f} as the "
            f"agents started; server idle {row['idle_cpu_ms_per_s']:.1f} ms CPU/s before the "
            f"start (included above); {row['keys_per_node']} keys per node, {row['gpus_seen']} GPUs seen; "
            f"{len(row['nodes_exited_early'])} node(s) exited early, {row['nodes_killed_at_stop']} killed at the stop, "
            f"other exit codes {row['nonzero_exit_codes'] or 'none'}."
        )
    for row in rows:
        if costs := row.get("call_costs"):
            lines.append(
                f"- {row['backend']}: the calls alone add up to {modelled_minutes_1_4(costs):.1f} ms per node-minute "
                f"over minutes 1-4 (each node's search, create and first window, then 2 later windows, in 3 "
                f"minutes; the server's idle CPU not included); the {costs['runs_in_experiment']:,}-run "
                f"experiment took {costs['built_s']:.0f} s to make."
            )
    for row in rows:
        for node, output in row["failed_node_output"].items():
            tail = " / ".join(output.strip().splitlines()[-6:])
            lines.append(f"- {row['backend']}: {node} ended early or badly; its output ends: `{tail}`")
    for row in rows:
        end = row["end"]
        by = (
            "the closing agents"
            if not end["next_agent"]
            else (
                f"the closing agents, and the next job's agent for the {end['left_by_the_agents']} window(s) they left"
            )
        )
        lines.append(
            f"- {row['backend']}: the stop: every node's last window in its node run "
            f"{fmt(end['every_last_window_in_s'], 1)} s after it (goal <= 90 s), from {by}; node runs ended FINISHED "
            f"{end['node_runs_finished']} / {row['nodes']}, windows left at the end {end['left_at_the_end']}."
        )
    for row in rows:
        c = row["completeness"]
        if short := {name: len(c[name]) for name in COMPLETENESS_CHECKS if c[name]}:
            lines.append(f"- {row['backend']}: nodes short of complete, by why: {short}.")
        if row["server_messages"]:
            said = "; ".join(f"{n} x `{text}`" for text, n in row["server_messages"].items())
            lines.append(f"- {row['backend']}: the server's errors (numbers and ids as #): {said}.")
        if row["agent_messages"]:
            said = "; ".join(f"{n} x `{text}`" for text, n in row["agent_messages"].items())
            lines.append(f"- {row['backend']}: the agents' warnings (numbers and ids as #): {said}.")
    for row in result["rows"]:
        if "skipped" in row:
            lines.append(f"- {row['backend']}: skipped: {row['skipped']}")
    for row in rows:
        for label, page in (row.get("pages") or {}).items():
            if label == "skipped":
                lines.append(f"- Run pages not opened: {page}")
                continue
            when = f" in {page['seconds']:.1f} s" if page["seconds"] is not None else ""
            drawn = f" ({page['drawn']}/{page['cards']} chart cards drawn)" if page["outcome"] == "charts" else ""
            lines.append(f"- {row['backend']}: {label}: {page['outcome']}{when}{drawn}.")
    lines.append(goal(rows))
    lines += start_and_stop_goals(rows)
    lines.append(f"\nWhole bench: {result['total_s']:.0f} s.")
    return lines


def start_and_stop_goals(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 32's: every node's first window within 30 s of the start, every last window within 90 s of
    the stop, the whole run's server CPU at most 60 ms per node-minute of the job (``job_share``)."""
    lines = []
    for row in rows:
        first, last = row["every_first_window_s"], row["end"]["every_last_window_in_s"]
        whole = next(p for p in row["phases"] if p["name"].startswith("whole run"))
        calls_ms, idle_ms = job_share(row, whole)
        checks = (
            f"first windows in {fmt(first, 1)} s ({_met(first is not None and first <= START_GOAL_S)})",
            f"last windows in {fmt(last, 1)} s ({_met(last is not None and last <= STOP_GOAL_S)})",
            f"whole run {calls_ms + idle_ms:.1f} ms per node-minute of the {row['fleet']:,}-node job "
            f"({_met(calls_ms + idle_ms <= GOAL_MS_PER_NODE_MINUTE)}: the nodes' calls {calls_ms:.1f}, the "
            f"server's idle {idle_ms:.1f}; {whole['ms_per_node_minute']:.1f} with its idle charged to the "
            f"{row['nodes']} agents alone)",
        )
        lines.append(f"- Goals (issue 32), {row['backend']}: {'; '.join(checks)}.")
    return lines


def job_share(row: dict[str, Any], phase_row: dict[str, Any]) -> tuple[float, float]:
    """``phase_row``'s server CPU per node-minute of the ``--fleet``-node job the K agents stand for: (what
    the nodes' calls cost it, above its idle; its idle, measured before the start, shared by every node of
    the job). The server idles alike for K nodes and for 2,048; charged to the K agents alone, a server
    sized for the job (4 workers: ~9 ms of CPU a second) would weigh 2,048 / K times what it does."""
    minutes = (phase_row["to_s"] - phase_row["from_s"]) / MINUTE_S
    idle_ms = row["idle_cpu_ms_per_s"] * MINUTE_S * minutes
    calls_ms = phase_row["cpu_ms"]["total"] - idle_ms
    return calls_ms / row["nodes"] / minutes, idle_ms / row["fleet"] / minutes


def _met(met: bool) -> str:
    return "met" if met else "NOT met"


def goal(rows: list[dict[str, Any]]) -> str:
    for row in rows:
        issue = next((p for p in row["phases"] if p["name"].startswith("minutes")), None)
        if row["backend"] == "sqlite" and issue:
            met = issue["ms_per_node_minute"] <= GOAL_MS_PER_NODE_MINUTE
            return (
                f"- Goal (issue 24): server CPU {issue['name']} on sqlite <= {GOAL_MS_PER_NODE_MINUTE:g} ms per "
                f"node-minute: {issue['ms_per_node_minute']:.1f}, {'met' if met else 'NOT met'}."
            )
    return "- Goal (issue 24): not measured (needs sqlite and at least 4 minutes)."
