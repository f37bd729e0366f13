"""Every query of every dashboard, evaluated by a real Prometheus on real agents.

One Prometheus (the Debian package) scrapes, every second:

- job ``otel-forge``: two real ``otel-forge monitor`` agents, directly (the agent's own names);
  both attached to one run on a real MLflow server, so ``otel_forge_run_info`` joins them to it.
  They are started the plain way of docs/fleet.md: ``--run-id`` and the run's experiment in
  ``MLFLOW_EXPERIMENT_ID`` (no agent reads the run), so the info series names the experiment and
  has no run name (only TrainingRun and ``otel-forge run`` know it);
- job ``otelcol`` (``honor_labels``): the same two agents as a Collector's Prometheus exporter
  writes them (``collector_form.py``: ``_ratio`` on unit-1 gauges, job = service.name
  ``llm-pretrain``, instance = service.instance.id ``gpu-node-0`` / ``gpu-node-1``, resource
  attributes as labels), as collector-config/gateway.yaml and prometheus.yml set it up.

The GPUs are the fake NVML (tests/fakes/pynvml.py), H100s with NVML GPM; the InfiniBand and RoCE
ports a sysfs tree of each node's own (testkit/infiniband_sysfs.py). Node ``node_0`` is healthy;
node ``node_1`` is not: its GPUs idle (a straggler: low utilization and SM activity), run hot
(thermal throttling, temperature outliers), count ECC errors and had an XID 79, one of its
InfiniBand ports is down, and its agent watches a job throttled and near its memory limit in a real
cgroup (``testkit/cgroups.py``, where root can make one). So on the fleet and
run dashboards every panel but the training progress ones has data, and on the node dashboard of the
healthy node only the panels listed in ``EMPTY_ON_A_HEALTHY_NODE`` may be empty.

Training progress comes from ``otel-forge run`` only: a third node, ``node_2``, is an ``otel-forge run``
(healthy fake GPUs) around ``progress_trainer.py``, four ranks stepping on the progress board it hands
its command, rank 3 doing three times the others' own work (the node names it the slow rank). It serves
a run of its own, scraped directly as job ``otel-forge-training`` and through the same Collector form as
``llm-finetune`` (its service.name). The progress panels of the run and fleet dashboards have data there,
in both name forms, and show nothing (no data, or zeros) for the two ``otel-forge monitor`` nodes, which
follow no training.

Each panel query is interpolated as Grafana would (grafana_queries.py) and sent to Prometheus's
HTTP API: a range query (30 s, step 2 s) for a range target, an instant query for an instant one.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from collector_form import CollectorForm
from grafana_queries import (
    ALL,
    Target,
    annotation_queries,
    interpolate,
    label_values,
    load,
    load_builder,
    targets,
    variables,
)
from progress_trainer import LOADER_RATE, start_training_node

from testkit.cgroups import CONTROLLERS, limited_job, v1_writable
from testkit.infiniband_sysfs import training_node
from testkit.servers import (
    AgentProcess,
    PrometheusServer,
    fake_gpu_env,
    free_port,
    http_get,
    start_agent,
    start_prometheus,
    wait_for,
)

DIRECT_JOB = "otel-forge"
COLLECTOR_JOB = "llm-pretrain"  # the agents' service.name: the job a Collector gives them
TRAINING_DIRECT_JOB = "otel-forge-training"  # node_2, the otel-forge run that follows a training
TRAINING_COLLECTOR_JOB = "llm-finetune"  # ... and its service.name
# What the training node is told of its job: samples and tokens per second, MFU (its fake H100s' peak).
TRAINING_SETTINGS = {
    "OTEL_FORGE_SAMPLES_PER_STEP": "256",
    "OTEL_FORGE_TOKENS_PER_STEP": "4096",
    "OTEL_FORGE_MODEL_PARAMETERS": "1e9",
    "OTEL_FORGE_SLOW_RANK_AFTER": "5",  # named after 5 s the slowest (30 s by default)
}
SLOW_RANK_TIMEOUT_S = 60.0
RANGE_S, STEP_S = 30, 2
SETTLED_S = 2.0  # past the scrape timeout and the rules' evaluation
READY_TIMEOUT_S = 60.0

# Both nodes' H100s have NVML GPM (SM, tensor and DRAM activity): the faulty node's SMs idle too.
HEALTHY = {
    "count": 2,
    "amd": False,
    "gpm": True,
    "sequences": {
        "0": {"utilization": [90, 95, 85], "temperature": [60, 61], "ecc_corrected": [0], "sm_activity": [70, 75]},
        "1": {"utilization": [88, 92], "temperature": [62, 63], "ecc_corrected": [0], "sm_activity": [72, 68]},
    },
}
# Idle GPUs, hot (thermal throttle bits set), ECC corrected errors growing (the fake's default), an XID 79,
# and degraded: row remapping failed and pending, PCIe replays and NVLink CRC errors growing.
FAULTY = {
    "count": 2,
    "amd": False,
    "hot": True,
    "degraded": True,
    "xid_events": [[1, 79]],
    "gpm": True,
    "sequences": {
        "0": {"utilization": [10, 15], "sm_activity": [6, 9]},
        "1": {"utilization": [5, 12], "sm_activity": [3, 7]},
    },
}

# The container row: node_1's agent watches a job (``--pid``) in a real cgroup v1 group with a CPU quota
# and a memory limit, where root can make one; node_0's watches itself, with no limit.
CGROUPS = v1_writable(*CONTROLLERS)
CONTAINER_PANELS = ("CPU against the limit", "CPU throttling", "Memory against the limit", "OOM kills")
NO_LIMIT = "the watched process's cgroup has no limit: the node reads as the machine"

# Panels of the node dashboard that show nothing on a healthy node, and why.
EMPTY_ON_A_HEALTHY_NODE = {
    "XID events": "lists only GPUs that had an XID critical-error event; a healthy GPU has none",
    **dict.fromkeys(CONTAINER_PANELS, NO_LIMIT),
}
# ... and on the faulty one: none, unless this machine cannot make the cgroup.
EMPTY_ON_THE_FAULTY_NODE = {} if CGROUPS else dict.fromkeys(CONTAINER_PANELS, NO_LIMIT)

builder = load_builder()

# NVML GPM metrics (Hopper and later): optional series. Where the agents export none (the fake NVML
# has no GPM), the queries that name them must still evaluate, and return nothing.
GPM_NAMES = {builder.prometheus_name(spec) for spec in builder.GPM_METRICS}


@dataclass
class Stack:
    prometheus: PrometheusServer
    agents: dict[str, AgentProcess]  # node id -> agent
    instances: dict[str, dict[str, str]]  # job -> node id -> instance label
    run_id: str
    experiment_id: str
    idle_run_id: str  # a run of the same server that no agent serves
    tracking_uri: str
    trainer: AgentProcess  # node_2: otel-forge run around progress_trainer.py
    training_run_id: str  # node_2's run
    gpm: bool = False  # the agents export NVML GPM metrics


def _agent_args(node_id: str, run_id: str, tracking_uri: str) -> list[str]:
    return [
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
        "--interval",
        "1",
        "--node-id",
        node_id,
        "--run-id",
        run_id,
        "--tracking-uri",
        tracking_uri,
    ]


def _scrape_config(direct: Sequence[str], collector: str, training: str) -> str:
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "scrape_configs": [
            {"job_name": DIRECT_JOB, "static_configs": [{"targets": list(direct)}]},
            {"job_name": TRAINING_DIRECT_JOB, "static_configs": [{"targets": [training]}]},
            {"job_name": "otelcol", "honor_labels": True, "static_configs": [{"targets": [collector]}]},
        ],
    }
    return json.dumps(config, indent=2)


def _start_training_node(tmp_path: Path, run_id: str, experiment_id: str, tracking_uri: str) -> AgentProcess:
    """node_2: ``otel-forge run --run-id RUN -- python progress_trainer.py``, serving Prometheus."""
    env = {
        **fake_gpu_env(HEALTHY),
        **TRAINING_SETTINGS,
        "OTEL_SERVICE_NAME": TRAINING_COLLECTOR_JOB,
        "OTEL_RESOURCE_ATTRIBUTES": "service.instance.id=gpu-node-2,host.name=gpu-node-2",
        "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool-node_2"),
        "MLFLOW_EXPERIMENT_ID": experiment_id,
        # Its command sends a gauge over OTLP (progress_trainer.py --otlp): the run's otlp/ keys.
        "OTEL_FORGE_OTLP_RECEIVER": "true",
        "OTEL_FORGE_OTLP_RECEIVER_GRPC_PORT": str(free_port()),
        "OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT": str(free_port()),
    }
    args = _agent_args("node_2", run_id, tracking_uri)
    return start_training_node(args, env, tmp_path, trainer_args=["--otlp"], timeout_s=READY_TIMEOUT_S)


def _ratio_gauges() -> set[str]:
    return {
        builder.prometheus_name(spec)
        for spec in builder.SPECS.values()
        if spec.unit == "1" and spec.kind.value == "gauge"
    }


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, mlflow_server: Any) -> Iterator[Stack]:
    from mlflow import MlflowClient

    tmp_path = tmp_path_factory.mktemp("dashboards")
    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment(f"dashboards-{time.time_ns()}")
    run = client.create_run(experiment_id, run_name="dashboard-run")
    idle_run = client.create_run(experiment_id, run_name="nobody-serves-me")
    training_run = client.create_run(experiment_id, run_name="training-run")

    agents: dict[str, AgentProcess] = {}
    trainer: AgentProcess | None = None
    collector: CollectorForm | None = None
    prometheus: PrometheusServer | None = None
    watched = contextlib.ExitStack()
    try:
        # First: its slow rank is named 5 s after its ranks have stepped, while the rest starts.
        trainer = _start_training_node(tmp_path, training_run.info.run_id, experiment_id, mlflow_server.uri)
        for node_id, scenario in (("node_0", HEALTHY), ("node_1", FAULTY)):
            # Two agents on one machine stand for two hosts: each its own host name and instance id
            # (service.instance.id defaults to the host name, which would make them one node).
            host = f"gpu-{node_id.replace('_', '-')}"
            env = {
                **fake_gpu_env(scenario),
                "OTEL_SERVICE_NAME": COLLECTOR_JOB,
                "OTEL_RESOURCE_ATTRIBUTES": f"service.instance.id={host},host.name={host}",
                "OTEL_FORGE_SPOOL_DIR": str(tmp_path / f"spool-{node_id}"),
                "MLFLOW_EXPERIMENT_ID": experiment_id,  # docs/fleet.md's plain way: the run's id and experiment
                "OTEL_FORGE_INFINIBAND_ROOT": str(
                    training_node(tmp_path / f"infiniband-{node_id}", healthy=scenario is HEALTHY)
                ),
            }
            args = _agent_args(node_id, run.info.run_id, mlflow_server.uri)
            if scenario is FAULTY and CGROUPS:  # a job pressed against its limits
                _, job = watched.enter_context(limited_job(cpus=0.2, memory_bytes=200 * 2**20, hold_bytes=150 * 2**20))
                args += ["--pid", str(job.pid)]
            agents[node_id] = start_agent(args, env)
        collector = CollectorForm(
            [*(agent.metrics_url for agent in agents.values()), trainer.metrics_url], _ratio_gauges()
        )
        collector_target = collector.serve()
        prometheus = start_prometheus(tmp_path, [agent.scrape_target for agent in agents.values()])
        # start_prometheus knows one job; give it both, then reload (it runs with --web.enable-lifecycle).
        (prometheus.directory / "prometheus.yml").write_text(
            _scrape_config([agent.scrape_target for agent in agents.values()], collector_target, trainer.scrape_target)
        )
        request = urllib.request.Request(f"{prometheus.url}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200

        instances = {DIRECT_JOB: {node: agent.scrape_target for node, agent in agents.items()}}
        collector_ids = {}
        for node in agents:
            (info,) = prometheus.wait_for_series(
                f'target_info{{job="{COLLECTOR_JOB}", otel_forge_node_id="{node}"}}', READY_TIMEOUT_S
            )
            collector_ids[node] = info["metric"]["instance"]
        instances[COLLECTOR_JOB] = collector_ids
        instances[TRAINING_DIRECT_JOB] = {"node_2": trainer.scrape_target}
        (info,) = prometheus.wait_for_series(
            f'target_info{{job="{TRAINING_COLLECTOR_JOB}", otel_forge_node_id="node_2"}}', READY_TIMEOUT_S
        )
        instances[TRAINING_COLLECTOR_JOB] = {"node_2": info["metric"]["instance"]}

        # Enough history for rate() and the 30 s range: 10 samples of every GPU in both forms, the run's
        # info series and MLflow deliveries from both agents.
        for job in (DIRECT_JOB, COLLECTOR_JOB):
            prometheus.wait_for_series(
                f'count_over_time(hw_power_watts{{job="{job}"}}[{RANGE_S}s]) >= 10', READY_TIMEOUT_S, min_series=4
            )
            prometheus.wait_for_series(
                f'otel_forge_delivery_windows_total{{job="{job}"}}', READY_TIMEOUT_S, min_series=2
            )
            prometheus.wait_for_series(
                f'otel_forge_run_info{{job="{job}", mlflow_run_id="{run.info.run_id}"}}', READY_TIMEOUT_S, min_series=2
            )
            prometheus.wait_for_series(f'otel_forge_gpu_xid_errors_total{{job="{job}"}}', READY_TIMEOUT_S)
        # The training node: its run's info, 10 samples of its throughput, its slow rank named.
        for job in TRAINING_FORMS:
            prometheus.wait_for_series(
                f'otel_forge_run_info{{job="{job}", mlflow_run_id="{training_run.info.run_id}"}}', READY_TIMEOUT_S
            )
            prometheus.wait_for_series(
                f'count_over_time(otel_forge_training_steps_per_second{{job="{job}"}}[{RANGE_S}s]) >= 10',
                READY_TIMEOUT_S,
            )
            prometheus.wait_for_series(
                f'{{__name__=~"otel_forge_training_slow_rank(_ratio)?", job="{job}"}} == 1', SLOW_RANK_TIMEOUT_S
            )
        exposition = agents["node_0"].scrape()
        gpm = any(f"# TYPE {name} " in exposition for name in GPM_NAMES)
        yield Stack(
            prometheus,
            agents,
            instances,
            run.info.run_id,
            experiment_id,
            idle_run.info.run_id,
            mlflow_server.uri,
            trainer,
            training_run.info.run_id,
            gpm,
        )
    finally:
        if prometheus is not None:
            prometheus.stop()
        if collector is not None:
            collector.close()
        for agent in agents.values():
            agent.stop()
        if trainer is not None:
            trainer.stop()
        watched.close()


# --- evaluation -----------------------------------------------------------------------------------------


def _query(stack: Stack, expr: str, instant: bool, now: float) -> list[dict[str, Any]]:
    """The result of ``expr`` as Grafana asks for it: instant at ``now``, or over the 30 s before."""
    if instant:
        path, params = "query", {"query": expr, "time": f"{now:.3f}"}
    else:
        path, params = (
            "query_range",
            {"query": expr, "start": f"{now - RANGE_S:.3f}", "end": f"{now:.3f}", "step": str(STEP_S)},
        )
    status, body = http_get(f"{stack.prometheus.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
    reply = json.loads(body)
    if status != 200 or reply.get("status") != "success":
        raise AssertionError(f"Prometheus rejected the query ({status}): {reply.get('error', body)}\n{expr}")
    return reply["data"]["result"]


def _has_data(result: list[dict[str, Any]]) -> bool:
    values = [
        value
        for series in result
        for _, value in (series.get("values") or ([series["value"]] if "value" in series else []))
    ]
    return any(not math.isnan(float(value)) for value in values)


def _series_api(stack: Stack, selector: str) -> list[dict[str, str]]:
    now = time.time()
    params = {"match[]": selector, "start": f"{now - RANGE_S:.3f}", "end": f"{now:.3f}"}
    status, body = http_get(f"{stack.prometheus.url}/api/v1/series?{urllib.parse.urlencode(params)}")
    reply = json.loads(body)
    assert status == 200 and reply["status"] == "success", f"{selector}: {reply.get('error', body)}"
    return reply["data"]


@dataclass
class Outcome:
    target: Target
    expr: str
    result: list[dict[str, Any]]

    @property
    def has_data(self) -> bool:
        return _has_data(self.result)


def evaluate(stack: Stack, dashboard: Mapping[str, Any], values: Mapping[str, Any]) -> list[Outcome]:
    outcomes = []
    # One refresh of the dashboard: every panel at the same instant, as Grafana asks; an instant whose
    # scrapes have all landed (a scrape stamped before it may still be in flight for its 1 s timeout),
    # so that two panels read the same samples.
    now = time.time() - SETTLED_S
    for target in targets(dashboard):
        expr = interpolate(target.expr, dashboard, values)
        outcomes.append(Outcome(target, expr, _query(stack, expr, target.instant, now)))
    return outcomes


def gpm_only(outcome: Outcome) -> bool:
    """The query reads GPM metrics and nothing to fall back on (GPU activity falls back on utilization)."""
    return (
        any(re.search(rf"\b{name}\b", outcome.expr) for name in GPM_NAMES) and "hw_gpu_utilization" not in outcome.expr
    )


def without_gpm(stack: Stack, outcomes: Sequence[Outcome]) -> list[Outcome]:
    """``outcomes`` less the GPM-only queries when the agents export no GPM, which must then be empty."""
    if stack.gpm:
        return list(outcomes)
    for outcome in outcomes:
        if gpm_only(outcome):
            assert not outcome.has_data, f"{outcome.target.panel}: GPM data without GPM: {outcome.result}"
    return [outcome for outcome in outcomes if not gpm_only(outcome)]


NETWORK_RATIO = ("Nodes of this job, slowest first", "C")  # network bytes / the run's median: none at 0


def without_idle_network(stack: Stack, job: str, outcomes: Sequence[Outcome]) -> list[Outcome]:
    """A ratio to a zero median is no ratio: where the nodes' interfaces moved no byte, that query is empty."""
    moved = stack.prometheus.query(f'sum(increase(system_network_io_bytes_total{{job="{job}"}}[{RANGE_S}s])) > 0')
    if moved:
        return list(outcomes)
    return [o for o in outcomes if (o.target.panel, o.target.ref_id) != NETWORK_RATIO or o.has_data]


# What only the training node (otel-forge run around progress_trainer.py) has: its ranks' progress, and
# the keys its command's OTLP feeds.
PROGRESS_NAMES = {
    builder.prometheus_name(spec) for spec in builder.SPECS.values() if spec.source in ("progress", "received")
}


def progress_only(outcome: Outcome) -> bool:
    """The query reads the training's progress (otel-forge run's ranks) only."""
    return any(re.search(rf"\b{name}\b", outcome.expr) for name in PROGRESS_NAMES)


def without_progress(outcomes: Sequence[Outcome]) -> list[Outcome]:
    """``outcomes`` less the progress queries, which for agents that follow no training show nothing but
    zeros (``count(...) or vector(0)``: no node stalled, no slow rank)."""
    for outcome in outcomes:
        if progress_only(outcome):
            values = [float(v) for s in outcome.result for _, v in s.get("values") or [s["value"]]]
            assert not any(values), f"{outcome.target.panel}: progress without a training: {outcome.result}"
    return [outcome for outcome in outcomes if not progress_only(outcome)]


def row_panels(dashboard: Mapping[str, Any], title: str) -> list[str]:
    """The titles of the panels of row ``title`` (rows are expanded: the panels that follow it)."""
    found: list[str] | None = None
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            if found is not None:
                break
            found = [] if panel["title"] == title else None
        elif found is not None:
            found.append(panel["title"])
    assert found, f"no row {title!r}"
    return found


def assert_all_have_data(outcomes: Sequence[Outcome], exempt: Mapping[str, str] = {}) -> None:
    empty = [
        f"{o.target.panel} [{o.target.ref_id}]: {o.expr}"
        for o in outcomes
        if not o.has_data and o.target.panel not in exempt
    ]
    assert not empty, "panels without data:\n" + "\n".join(empty)


def _values(dashboard_name: str, stack: Stack, job: str, **chosen: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"job": job, "node": ALL, "gpu": ALL}
    if dashboard_name == "otel-forge-node.json":
        base["node"] = stack.instances[job]["node_1"]  # one node in depth: no All
    if dashboard_name == "otel-forge-fleet.json":
        base["straggler_ratio"] = "0.8"
    if dashboard_name == "otel-forge-run.json":
        base.update(run=stack.run_id, run_name="", tracking_uri=stack.tracking_uri)
    return {**base, **chosen}


FORMS = [DIRECT_JOB, COLLECTOR_JOB]
TRAINING_FORMS = [TRAINING_DIRECT_JOB, TRAINING_COLLECTOR_JOB]


# --- the tests ------------------------------------------------------------------------------------------


def test_collector_form_is_what_the_dashboards_meet_through_a_collector(stack: Stack) -> None:
    """The second job really is in the Collector's naming, and the agents' own is not."""
    query = stack.prometheus.query
    # 2 nodes x 2 GPUs, each its utilization (general) and its video encoder's and decoder's
    assert len(query(f'hw_gpu_utilization_ratio{{job="{COLLECTOR_JOB}", hw_gpu_task="general"}}')) == 4
    assert len(query(f'hw_gpu_utilization_ratio{{job="{COLLECTOR_JOB}"}}')) == 12
    assert query(f'hw_gpu_utilization{{job="{COLLECTOR_JOB}"}}') == []
    assert len(query(f'hw_gpu_utilization{{job="{DIRECT_JOB}", hw_gpu_task="general"}}')) == 4
    assert query(f'{{__name__=~".+_ratio", job="{DIRECT_JOB}"}}') == []
    through = query(f'hw_power_watts{{job="{COLLECTOR_JOB}"}}')
    assert {series["metric"]["instance"] for series in through} == set(stack.instances[COLLECTOR_JOB].values())
    assert all("host_name" in series["metric"] and "service_name" in series["metric"] for series in through)
    assert query(f'up{{job="{COLLECTOR_JOB}"}}') == []  # up is the Collector's own, under its scrape job


@pytest.mark.parametrize("job", FORMS)
def test_every_variable_query_finds_its_values(stack: Stack, job: str) -> None:
    nodes = stack.instances[job]
    expected = {
        "job": {job},
        "node": set(nodes.values()),
        "gpu": {"0", "1"},
        "run": {stack.run_id},
        "run_name": set(),  # standalone agents: no run name (Prometheus keeps no empty label value)
    }
    for name in ("otel-forge-node.json", "otel-forge-fleet.json", "otel-forge-run.json"):
        dashboard = load(name)
        values = _values(name, stack, job)
        for variable in variables(dashboard).values():
            if variable["type"] != "query":
                continue
            selector, label = label_values(variable["query"])
            found = {
                series[label]
                for series in _series_api(stack, interpolate(selector, dashboard, values))
                if label in series
            }
            if expected[variable["name"]]:
                assert expected[variable["name"]] <= found, (name, variable["name"], found)
            else:
                assert found == set(), (name, variable["name"], found)


@pytest.mark.parametrize("job", FORMS)
def test_node_dashboard_every_panel_has_data_on_a_faulty_node(stack: Stack, job: str) -> None:
    dashboard = load("otel-forge-node.json")
    values = _values("otel-forge-node.json", stack, job, node=stack.instances[job]["node_1"])
    outcomes = evaluate(stack, dashboard, values)
    assert len(outcomes) >= 40
    assert_all_have_data(without_gpm(stack, outcomes), exempt=EMPTY_ON_THE_FAULTY_NODE)
    # Only the chosen node answers.
    for outcome in outcomes:
        for series in outcome.result:
            assert series["metric"].get("instance", stack.instances[job]["node_1"]) == stack.instances[job]["node_1"], (
                outcome.target.panel
            )


@pytest.mark.parametrize("job", FORMS)
def test_node_dashboard_on_a_healthy_node_is_empty_only_where_listed(stack: Stack, job: str) -> None:
    dashboard = load("otel-forge-node.json")
    values = _values("otel-forge-node.json", stack, job, node=stack.instances[job]["node_0"], gpu=["0", "1"])
    outcomes = evaluate(stack, dashboard, values)
    assert_all_have_data(without_gpm(stack, outcomes), exempt=EMPTY_ON_A_HEALTHY_NODE)
    for outcome in outcomes:
        if outcome.target.panel in EMPTY_ON_A_HEALTHY_NODE:
            assert not outcome.has_data, f"{outcome.target.panel} shows events on a healthy node: {outcome.result}"
    assert set(EMPTY_ON_A_HEALTHY_NODE) <= {outcome.target.panel for outcome in outcomes}


@pytest.mark.parametrize("job", FORMS)
def test_fleet_dashboard_every_panel_has_data_and_finds_the_faulty_node(stack: Stack, job: str) -> None:
    dashboard = load("otel-forge-fleet.json")
    outcomes = evaluate(stack, dashboard, _values("otel-forge-fleet.json", stack, job))
    assert_all_have_data(without_progress(without_gpm(stack, outcomes)))
    by_panel: dict[str, list[Outcome]] = {}
    for outcome in outcomes:
        by_panel.setdefault(outcome.target.panel, []).append(outcome)
    faulty, healthy = stack.instances[job]["node_1"], stack.instances[job]["node_0"]

    def instances(panel: str, ref: int = 0) -> set[str]:
        return {series["metric"]["instance"] for series in by_panel[panel][ref].result}

    assert instances("Stragglers") == {faulty}
    assert instances("Temperature outliers") == {faulty}
    assert instances("XID and ECC events", 0) == {faulty} == instances("XID and ECC events", 1)
    (xid,) = by_panel["XID and ECC events"][0].result
    assert xid["metric"]["otel_forge_gpu_xid"] == "79" and xid["metric"]["hw_id"] == "1"
    assert instances("Agents") == {faulty, healthy}
    assert all(float(series["value"][1]) == 1 for series in by_panel["Agents"][0].result)
    assert float(by_panel["Agents up"][0].result[0]["value"][1]) == 2
    assert float(by_panel["Agents down"][0].result[0]["value"][1]) == 0
    heatmap = by_panel["GPU utilization by node and GPU"][0].result
    assert len(heatmap) == 4  # one row per node and GPU


@pytest.mark.parametrize("job", FORMS)
def test_run_dashboard_every_panel_has_data_for_the_run(stack: Stack, job: str) -> None:
    dashboard = load("otel-forge-run.json")
    outcomes = evaluate(stack, dashboard, _values("otel-forge-run.json", stack, job))
    assert_all_have_data(without_progress(without_idle_network(stack, job, without_gpm(stack, outcomes))))
    # The joins at the top of an expression (not under a sum) label every series with the node id.
    joined = [o for o in outcomes if o.expr.startswith("(") and "group_left (otel_forge_node_id)" in o.expr]
    assert len(joined) >= 12
    for outcome in joined:
        assert {series["metric"].get("otel_forge_node_id") for series in outcome.result} <= {"node_0", "node_1"}
    nodes = next(o for o in outcomes if o.target.panel == "Run and its nodes" and o.target.ref_id == "A")
    # The experiment from MLFLOW_EXPERIMENT_ID; no run name (standalone agents cannot know it).
    assert {
        (
            s["metric"]["otel_forge_node_id"],
            s["metric"].get("mlflow_experiment_id", ""),
            s["metric"]["mlflow_run_id"],
            s["metric"].get("mlflow_run_name", ""),
        )
        for s in nodes.result
    } == {("node_0", stack.experiment_id, stack.run_id, ""), ("node_1", stack.experiment_id, stack.run_id, "")}
    # The run's start and end: one annotation region per run while its agents serve it.
    (annotation,) = annotation_queries(dashboard)
    values = _values("otel-forge-run.json", stack, job)
    result = _query(stack, interpolate(annotation["expr"], dashboard, values), instant=False, now=time.time())
    assert [series["metric"]["mlflow_run_id"] for series in result] == [stack.run_id]
    assert all(float(value) >= 1 for _, value in result[0]["values"])  # Grafana: >= 1 is "active"


@pytest.mark.parametrize("job", FORMS)
def test_run_dashboard_nodes_of_this_job_puts_the_slow_node_first(stack: Stack, job: str) -> None:
    """node_1's GPUs idle (10-15%) beside node_0's (85-95%): it is below 0.8 x the run's median, node_0 above."""
    dashboard = load("otel-forge-run.json")
    outcomes = evaluate(stack, dashboard, _values("otel-forge-run.json", stack, job))
    table = {o.target.ref_id: o.result for o in outcomes if o.target.panel == "Nodes of this job, slowest first"}
    assert set(table) == {"A", "B", "C"}
    if not without_idle_network(
        stack, job, [o for o in outcomes if (o.target.panel, o.target.ref_id) == NETWORK_RATIO]
    ):
        del table["C"]  # no byte moved on these nodes' interfaces: no median to compare with
    for ref, result in table.items():
        assert {s["metric"]["otel_forge_node_id"] for s in result} == {"node_0", "node_1"}, ref
        assert all(set(s["metric"]) == {"job", "instance", "otel_forge_node_id"} for s in result), ref  # one row a node
    ratio = {s["metric"]["otel_forge_node_id"]: float(s["value"][1]) for s in table["A"]}
    assert ratio["node_1"] < 0.8 < 1 < ratio["node_0"], ratio
    # Two nodes: the median is their mean, so the two ratios add up to 2.
    assert abs(ratio["node_0"] + ratio["node_1"] - 2) < 1e-9
    power = {s["metric"]["otel_forge_node_id"]: float(s["value"][1]) for s in table["B"]}
    assert abs(power["node_0"] + power["node_1"] - 2) < 1e-9, power
    (stat,) = [o for o in outcomes if o.target.panel == "GPU activity / job median"]
    assert {s["metric"]["otel_forge_node_id"]: float(s["value"][1]) for s in stat.result} == ratio
    lines = [o for o in outcomes if o.target.panel == "Node GPU activity vs the job's median"]
    signal = "sm_activity" if stack.gpm else "utilization"
    assert {s["metric"]["otel_forge_gpu_activity_signal"] for o in lines for s in o.result} == {signal}
    (panel,) = [p for row in dashboard["panels"] for p in [row] if p.get("title") == "Nodes of this job, slowest first"]
    assert panel["options"]["sortBy"] == [{"displayName": "GPU activity / median", "desc": False}]


@pytest.mark.parametrize("job", FORMS)
def test_run_dashboard_shows_nothing_for_a_run_no_agent_served(stack: Stack, job: str) -> None:
    """The group_left join restricts every run panel to the run's nodes: another run has none."""
    dashboard = load("otel-forge-run.json")
    values = _values("otel-forge-run.json", stack, job, run=stack.idle_run_id)
    for outcome in evaluate(stack, dashboard, values):
        assert not outcome.has_data, f"{outcome.target.panel} has data for a run nobody served: {outcome.expr}"


@pytest.mark.parametrize("job", FORMS)
def test_node_dashboard_shows_the_infiniband_port_that_is_down(stack: Stack, job: str) -> None:
    dashboard = load("otel-forge-node.json")
    ports: dict[str, dict[str, str]] = {}
    active: dict[str, dict[str, float]] = {}
    for node in ("node_0", "node_1"):
        outcomes = evaluate(
            stack, dashboard, _values("otel-forge-node.json", stack, job, node=stack.instances[job][node])
        )
        (table,) = [o.result for o in outcomes if o.target.panel == "InfiniBand ports"]
        ports[node] = {
            s["metric"]["otel_forge_infiniband_device"]: s["metric"]["otel_forge_infiniband_state"] for s in table
        }
        (lines,) = [o.result for o in outcomes if o.target.panel == "InfiniBand ports active"]
        active[node] = {s["metric"]["otel_forge_infiniband_device"]: float(s["values"][-1][1]) for s in lines}
    assert ports == {
        "node_0": {"mlx5_0": "active", "mlx5_1": "active", "mlx5_2": "active"},
        "node_1": {"mlx5_0": "active", "mlx5_1": "down", "mlx5_2": "active"},
    }
    assert active == {
        "node_0": {"mlx5_0": 1, "mlx5_1": 1, "mlx5_2": 1},
        "node_1": {"mlx5_0": 1, "mlx5_1": 0, "mlx5_2": 1},
    }


def test_run_links_open_the_run_in_the_mlflow_ui(stack: Stack) -> None:
    dashboard = load("otel-forge-run.json")
    values = _values("otel-forge-run.json", stack, DIRECT_JOB)
    urls = {
        entry["title"]: interpolate(entry["url"], dashboard, values)
        for entry in dashboard["links"]
        if entry["type"] == "link"
    }
    assert set(urls) == {"Run in MLflow"}
    run_url = urls["Run in MLflow"]
    # MLflow's direct run page (route /runs/:runUuid): it finds the run's experiment itself.
    assert run_url == f"{stack.tracking_uri}/#/runs/{stack.run_id}"
    status, page = http_get(run_url.split("#")[0])
    assert status == 200 and "<html" in page.lower()  # the MLflow UI; the fragment is its client-side route
    # The route is MLflow's runPageDirect: its UI, given the run id alone, asks the server for the run
    # (as here) and opens it under its experiment.
    import mlflow

    bundles = (Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js").glob("main.*.js")
    assert any('"/runs/:runUuid"' in bundle.read_text(errors="replace") for bundle in bundles)
    status, body = http_get(f"{stack.tracking_uri}/api/2.0/mlflow/runs/get?run_id={stack.run_id}")
    assert status == 200 and json.loads(body)["run"]["info"]["experiment_id"] == stack.experiment_id
    # The table's data link is built from the columns its query A returns.
    (panel,) = [p for p in dashboard["panels"] if p.get("title") == "Run and its nodes"]
    (data_link,) = panel["fieldConfig"]["defaults"]["links"]
    fields = set(re.findall(r"__data\.fields\.(\w+)", data_link["url"]))
    (query_a,) = [
        o
        for o in evaluate(stack, {"panels": [panel], "templating": dashboard["templating"]}, values)
        if o.target.ref_id == "A"
    ]
    assert all(fields <= set(series["metric"]) for series in query_a.result) and query_a.result


def test_the_agents_exposition_has_every_metric_the_dashboards_name(stack: Stack) -> None:
    """Guard for the name mapping: what the builder derives is what the real exporter writes."""
    text = stack.agents["node_1"].scrape()
    exported = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    training = set(re.findall(r"^# TYPE (\S+)", stack.trainer.scrape(), re.M))
    assert training >= PROGRESS_NAMES, PROGRESS_NAMES - training  # every progress metric, as the builder names it
    assert not PROGRESS_NAMES & exported  # otel-forge monitor follows no training
    exported |= training
    named = set()
    for name in ("otel-forge-node.json", "otel-forge-fleet.json", "otel-forge-run.json"):
        for target in targets(load(name)):
            named |= set(re.findall(r"(?<![\w\"])([a-z][a-z0-9_]*)\{", target.expr))
            named |= {
                pattern.removesuffix("(_ratio)?")
                for pattern in re.findall(r'__name__=~"([^"]+)"', target.expr)
                if pattern.endswith("(_ratio)?")
            }
    named -= {"up"}
    if not stack.gpm:
        named -= GPM_NAMES  # optional: NVML GPM (Hopper and later), which the fake NVML does not have
    assert named and named <= exported, named - exported


def _by_panel(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Outcome]]:
    found: dict[str, dict[str, Outcome]] = {}
    for outcome in outcomes:
        found.setdefault(outcome.target.panel, {})[outcome.target.ref_id] = outcome
    return found


def _last(outcome: Outcome) -> list[tuple[dict[str, str], float]]:
    """Each series' labels and its value (instant) or last value (range)."""
    return [
        (series["metric"], float((series["values"][-1] if "values" in series else series["value"])[1]))
        for series in outcome.result
    ]


def _row(stack: Stack, name: str, row: str, values: Mapping[str, Any]) -> dict[str, dict[str, Outcome]]:
    """The outcomes of row ``row``'s panels, every one with data and reading only the training's series."""
    dashboard = load(name)
    titles = set(row_panels(dashboard, row))
    outcomes = [o for o in evaluate(stack, dashboard, values) if o.target.panel in titles]
    assert {o.target.panel for o in outcomes} == titles
    assert all(progress_only(o) for o in outcomes), [o.expr for o in outcomes if not progress_only(o)]
    assert_all_have_data(outcomes)
    return _by_panel(outcomes)


@pytest.mark.parametrize("job", TRAINING_FORMS)
def test_run_dashboard_progress_row_follows_the_training(stack: Stack, job: str) -> None:
    """node_2's run: every progress query has data, the four ranks, rank 3 the slow one, no stall."""
    values = _values("otel-forge-run.json", stack, job, run=stack.training_run_id)
    row = _row(stack, "otel-forge-run.json", "Progress", values)
    for outcomes in row.values():
        for outcome in outcomes.values():
            assert {s["metric"].get("otel_forge_node_id", "node_2") for s in outcome.result} == {"node_2"}

    def tile(title: str) -> float:
        ((_, value),) = _last(row[title]["A"])
        return value

    steps = tile("Steps per second")
    assert 5 < steps < 1 / (0.04 * 0.9), steps  # a step takes 40 ms (and the threads' scheduling)
    assert tile("Samples per second") == pytest.approx(256 * steps)
    assert tile("Tokens per second") == pytest.approx(4096 * steps)
    # 6 x parameters x tokens per step x steps per second / (4 GPUs of the job x an H100's dense BF16 peak)
    assert tile("MFU") == pytest.approx(6 * 1e9 * 4096 * steps / (4 * 989e12))
    assert 0.5 < tile("Goodput") <= 1
    assert tile("Nodes stalled") == 0 and tile("Slow ranks") == 1
    assert tile("Energy per step") > 0
    ranks = {labels["otel_forge_training_rank"] for labels, _ in _last(row["Step, per rank"]["A"])}
    assert ranks == {"0", "1", "2", "3"}
    quantiles = {
        (labels["otel_forge_training_rank"], labels["otel_forge_training_quantile"])
        for labels, _ in _last(row["Step time, per rank (p50, p95)"]["A"])
    }
    assert quantiles == {(rank, q) for rank in ranks for q in ("p50", "p95")}
    ratios = {labels["otel_forge_training_rank"]: value for labels, value in _last(row["Ranks, slowest first"]["A"])}
    assert max(ratios, key=ratios.__getitem__) == "3" and ratios["3"] > 2, ratios  # 3 x the others' own work
    (stalled,) = row["Stalled"]["A"].result  # one band: node_2, training, no rank named
    assert stalled["metric"]["otel_forge_training_rank"] == "none"
    assert {float(value) for _, value in stalled["values"]} == {0}
    shares = {labels["otel_forge_training_activity"]: value for labels, value in _last(row["Time by activity"]["A"])}
    # Each interval's share (rate() over a few scrapes: near 1, not exactly), all of it productive.
    assert max(shares, key=shares.__getitem__) == "productive" and shares["productive"] > 0.5, shares
    assert shares["stalled"] == shares["restart_lost"] == 0, shares


@pytest.mark.parametrize("job", TRAINING_FORMS)
def test_run_dashboard_shows_the_keys_its_commands_otlp_feeds(stack: Stack, job: str) -> None:
    """node_2's command sends a gauge over OTLP to otel-forge run's receiver: the run dashboard's
    "Received over OTLP" row shows its MLflow key and value, for that run only."""
    values = _values("otel-forge-run.json", stack, job, run=stack.training_run_id)
    dashboard = load("otel-forge-run.json")
    titles = set(row_panels(dashboard, "Received over OTLP"))

    def received() -> dict[str, dict[str, Outcome]] | None:
        outcomes = [o for o in evaluate(stack, dashboard, values) if o.target.panel in titles]
        return _by_panel(outcomes) if all(o.has_data for o in outcomes) else None

    row = wait_for(received, SLOW_RANK_TIMEOUT_S, interval_s=1.0, message="the run's otlp/ keys on the dashboard")
    assert set(row) == titles
    [(labels, value)] = _last(row["The run's otlp/ keys now"]["A"])
    assert (labels["otel_forge_mlflow_key"], value) == ("otlp/loader.samples_per_second", LOADER_RATE)
    other = _values("otel-forge-run.json", stack, job, run=stack.run_id)
    assert not any(o.result for o in evaluate(stack, dashboard, other) if o.target.panel in titles)


@pytest.mark.parametrize("job", TRAINING_FORMS)
def test_fleet_dashboard_training_progress_row_names_the_slow_rank(stack: Stack, job: str) -> None:
    row = _row(stack, "otel-forge-fleet.json", "Training progress", _values("otel-forge-fleet.json", stack, job))
    node = stack.instances[job]["node_2"]
    ((_, stalled),) = _last(row["Nodes stalled"]["A"])
    ((_, slow),) = _last(row["Slow ranks"]["A"])
    assert (stalled, slow) == (0, 1)
    ((labels, ratio),) = _last(row["Ranks named slow"]["A"])
    assert (labels["instance"], labels["otel_forge_training_rank"]) == (node, "3") and ratio > 2
    for title in ("Steps per second by node", "Goodput by node", "Stalled, by node"):
        assert {labels["instance"] for labels, _ in _last(row[title]["A"])} == {node}, title
