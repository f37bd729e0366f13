"""The shipped alert rules on a real Prometheus that scrapes a real ``otel-forge monitor``.

One stack for the module: a real MLflow server (the session's) with a run, one agent with 2 fake
NVIDIA GPUs into that run (hot and throttling, an XID, uncorrectable ECC errors on GPU 0, GPU 1
idle) and the InfiniBand and RoCE ports of a sysfs tree (testkit/infiniband_sysfs.py), started the
plain way of docs/fleet.md (a standalone ``otel-forge monitor --run-id`` with the run's experiment in
``MLFLOW_EXPERIMENT_ID``: it knows the experiment, not the run's name), and one Prometheus whose
config is the shipped ``prometheus.yml`` with test targets:

- job ``otel-forge``: its static target is a port nothing listens on (an agent that is down), its
  file-based discovery file (from the shipped example) names the live agent;
- job ``otel-forge-gateway``: discovery names the live agent too, with metric relabeling that gives
  unit-1 gauges the ``_ratio`` suffix an OpenTelemetry Collector gives them (no Collector can be
  installed here; this emulates its naming only, not its job/instance labels).

Both jobs also scrape a training node: an ``otel-forge run`` (CPU and memory collectors only: no GPU
of its own) into a second run of the experiment, around ``tests/dashboards/progress_trainer.py``,
whose four ranks take a few steps on the progress board and then hang: with a stall floor of 1 s the
node says its training stalled (no rank named: no rank left stacks to read), and
``OtelForgeTrainingStalled`` fires with the host and that run; no rank is named slow (the slow-rank
ratio is set out of reach), so ``OtelForgeSlowRank`` stays quiet (its firing: rules.test.yml).

So every rule is evaluated against both name forms. Once Prometheus has seen the InfiniBand ports
active and their error counters, one port goes down and another counts symbol errors. The rules are
the shipped ones with each ``for:`` cut to 1s (the expressions are identical, which a test asserts),
beside the shipped recording rules (recording-rules.yml), which the straggler alert reads. The fake
GPUs have no NVML GPM: the busy-but-idle alert's SM-activity series is absent, so that rule is checked
to evaluate and stay quiet; its firing is covered by the promtool unit tests (rules.test.yml).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.cgroups import CONTROLLERS, limited_job, oom_kill_in, v1_writable
from testkit.infiniband_sysfs import set_file, training_node
from testkit.servers import (
    PROMETHEUS_BINARY,
    PrometheusServer,
    fake_gpu_env,
    free_port,
    http_get,
    start_agent,
    wait_for,
)

CONFIG_DIR = Path(__file__).resolve().parents[2] / "collector-config"
RULES = CONFIG_DIR / "alert-rules.yml"
RECORDING_RULES = CONFIG_DIR / "recording-rules.yml"
SHORT_FOR = "1s"

SCENARIO = {
    "count": 2,
    "amd": False,
    "gpm": True,  # the H100s have GPM: SM activity is there for the busy-but-idle rule
    "hot": True,
    "degraded": True,  # row remapping failed and pending, PCIe replays growing
    "xid_events": [[0, 79]],
    "sequences": {"0": {"utilization": [95], "ecc_uncorrected": [2]}, "1": {"utilization": [0]}},
}

# For each rule, a selector that must find series on the live stack: the rule's metrics exist
# under the names it uses, so a rule that does not fire is quiet for the right reason.
WITNESSES = {
    "OtelForgeGpuTemperatureHigh": 'hw_temperature_celsius{hw_type="gpu", hw_sensor_location="gpu"}',
    "OtelForgeGpuThermalThrottling": '{__name__=~"otel_forge_gpu_throttle(_ratio)?", '
    'otel_forge_gpu_throttle_reason="hw_thermal_slowdown"}',
    "OtelForgeGpuXidError": "otel_forge_gpu_xid_errors_total",
    "OtelForgeGpuUncorrectableEccErrors": 'hw_errors_total{hw_type="gpu", error_type="uncorrected"}',
    "OtelForgeGpuLost": 'hw_status{hw_type="gpu", hw_state="failed"}',
    "OtelForgeGpuRowRemapFailure": '{__name__=~"otel_forge_gpu_memory_remap_failed(_ratio)?"}',
    "OtelForgeGpuRowRemapPending": '{__name__=~"otel_forge_gpu_memory_remap_pending(_ratio)?"}',
    "OtelForgeGpuPcieReplaysGrowing": "otel_forge_gpu_pcie_replays_total",
    "OtelForgeGpuBusyButIdle": '{__name__=~"otel_forge_gpu_sm_activity(_ratio)?"}',
    "OtelForgeGpuIdleDuringRun": "otel_forge_run_info == 1",
    "OtelForgeInfinibandPortDown": 'otel_forge_infiniband_status{otel_forge_infiniband_state="active"}',
    "OtelForgeInfinibandErrorsRising": 'otel_forge_infiniband_errors_total{error_type="symbol_error"}',
    "OtelForgeStragglerNode": "run_node:otel_forge_gpu_activity:ratio_to_median5m",
    "OtelForgeMlflowDeliverySpooling": 'otel_forge_delivery_windows_total{otel_forge_delivery_outcome="spooled"}',
    "OtelForgeMlflowDeliveryDropping": 'otel_forge_delivery_windows_total{otel_forge_delivery_outcome="dropped"}',
    "OtelForgeAgentDown": 'up{job="otel-forge"}',
    "OtelForgeGatewayDown": 'up{job="otel-forge-gateway"}',
    "OtelForgeAgentStoppedReporting": "otel_forge_collector_reads_total",
    "OtelForgeCpuThrottled": "otel_forge_container_cpu_throttled_periods_total",
    "OtelForgeMemoryNearLimit": '{__name__=~"otel_forge_container_memory_utilization(_ratio)?"}',
    "OtelForgeOomKill": "otel_forge_container_memory_oom_kills_total",
    "OtelForgeTrainingStalled": '{__name__=~"otel_forge_training_stalled(_ratio)?"}',
    "OtelForgeSlowRank": '{__name__=~"otel_forge_training_slow_rank(_ratio)?"}',
}
TRAINER = Path(__file__).resolve().parents[1] / "dashboards" / "progress_trainer.py"
# The training node: its ranks hang after 20 steps (about a second), a stall 1 s later; no slow rank.
TRAINING_SETTINGS = {
    "OTEL_FORGE_STALL_FLOOR": "1",
    "OTEL_FORGE_STALL_FACTOR": "2",
    "OTEL_FORGE_SLOW_RANK_RATIO": "100",
}
# The container rules fire on a real cgroup v1 group (a busy job near its memory limit, then an OOM
# kill), where root can make one; elsewhere their series are absent and they are checked to stay quiet.
CONTAINER_ALERTS = ("OtelForgeCpuThrottled", "OtelForgeMemoryNearLimit", "OtelForgeOomKill")
CGROUPS = v1_writable(*CONTROLLERS)
BOTH_JOBS = {"otel-forge", "otel-forge-gateway"}
# (alert, job) pairs the scenario must fire.
EXPECTED_FIRING = {
    *(
        (alert, job)
        for job in BOTH_JOBS
        for alert in (
            "OtelForgeGpuTemperatureHigh",
            "OtelForgeGpuThermalThrottling",
            "OtelForgeGpuXidError",
            "OtelForgeGpuUncorrectableEccErrors",
            "OtelForgeGpuIdleDuringRun",
            "OtelForgeGpuRowRemapFailure",
            "OtelForgeGpuRowRemapPending",
            "OtelForgeGpuPcieReplaysGrowing",
            "OtelForgeInfinibandPortDown",
            "OtelForgeInfinibandErrorsRising",
            "OtelForgeTrainingStalled",
            *(CONTAINER_ALERTS if CGROUPS else ()),
        )
    ),
    ("OtelForgeAgentDown", "otel-forge"),
}
# Witnesses that may find nothing, and why: the rule is then checked to evaluate and stay quiet.
NEVER_FIRING = {
    "OtelForgeGpuLost",
    "OtelForgeGpuBusyButIdle",  # GPU 0 is busy and its SMs too
    "OtelForgeStragglerNode",  # one node: a run needs 3
    "OtelForgeMlflowDeliverySpooling",
    "OtelForgeMlflowDeliveryDropping",
    "OtelForgeGatewayDown",
    "OtelForgeAgentStoppedReporting",
    "OtelForgeSlowRank",  # the slow-rank ratio is out of reach
    *(() if CGROUPS else CONTAINER_ALERTS),
}


RECORDING = [rule for group in yaml.safe_load(RECORDING_RULES.read_text())["groups"] for rule in group["rules"]]


def shipped_rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def short_for_rules(path: Path) -> Path:
    """The shipped rules with every ``for:`` cut to SHORT_FOR."""
    document = yaml.safe_load(RULES.read_text())
    for group in document["groups"]:
        for rule in group["rules"]:
            rule["for"] = SHORT_FOR
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def unit_one_gauges() -> list[str]:
    """Prometheus names of otel_forge's unit-1 gauges: the ones a Collector suffixes with _ratio."""
    from otel_forge.names import METRICS, Kind

    return sorted({spec.name.replace(".", "_") for spec in METRICS if spec.kind == Kind.GAUGE and spec.unit == "1"})


def prometheus_test_config(directory: Path, agent_targets: list[str], dead_target: str, rules: Path) -> Path:
    """The shipped prometheus.yml, pointed at this test's targets and rules."""
    config = yaml.safe_load((CONFIG_DIR / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(rules), str(RECORDING_RULES)]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    jobs["otel-forge"]["static_configs"] = [{"targets": [dead_target]}]
    examples = {"otel-forge": "nodes.yml.example", "otel-forge-gateway": "gateway.yml.example"}
    for job_name, example in examples.items():
        targets = directory / "targets" / job_name
        targets.mkdir(parents=True)
        groups = yaml.safe_load((CONFIG_DIR / "targets" / job_name / example).read_text())
        groups = [{**groups[0], "targets": agent_targets}]
        (targets / example.removesuffix(".example")).write_text(yaml.safe_dump(groups))
        for sd in jobs[job_name]["file_sd_configs"]:
            sd["files"] = [str(directory / pattern) for pattern in sd["files"]]
    jobs["otel-forge-gateway"]["metric_relabel_configs"] = [
        {
            "source_labels": ["__name__"],
            "regex": f"({'|'.join(unit_one_gauges())})",
            "target_label": "__name__",
            "replacement": "${1}_ratio",
        }
    ]
    path = directory / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_prometheus_with(config_path: Path, directory: Path) -> PrometheusServer:
    port = free_port()
    log = open(directory / "prometheus.log", "wb")  # noqa: SIM115 - Prometheus's stdout until it stops
    process = subprocess.Popen(
        [
            PROMETHEUS_BINARY,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=directory,
    )
    log.close()
    server = PrometheusServer(process, f"http://127.0.0.1:{port}", directory)
    try:

        def ready() -> bool:
            assert process.poll() is None, f"prometheus exited with {process.returncode}:\n{server.log}"
            return http_get(f"{server.url}/-/ready", timeout_s=1.0)[0] == 200

        wait_for(ready, 30.0, message=lambda: f"prometheus ready\n{server.log[-3000:]}")
    except BaseException:
        server.kill()
        raise
    return server


@pytest.fixture(scope="module")
def mlflow_run(mlflow_server):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment("collector-config-alerts")
    run = client.create_run(experiment_id, run_name="stalled-run")
    training = client.create_run(experiment_id, run_name="training-run")
    yield {
        "uri": mlflow_server.uri,
        "run_id": run.info.run_id,
        "experiment_id": experiment_id,
        "run_name": "stalled-run",
        "training_run_id": training.info.run_id,
    }


@pytest.fixture(scope="module")
def job():
    """The job the agent watches (``--pid``): a busy process near its memory limit, in a cgroup of a
    0.2-CPU quota, where root can make one; else none (the agent watches itself)."""
    if not CGROUPS:
        yield None
        return
    with limited_job(cpus=0.2, memory_bytes=200 * 2**20, hold_bytes=180 * 2**20) as found:
        yield found


def start_trainer(directory: Path, mlflow_run: dict[str, str]) -> Any:
    """``otel-forge run`` into the training run around the trainer, whose ranks hang after 20 steps."""
    spec = importlib.util.spec_from_file_location("progress_trainer", TRAINER)
    assert spec is not None and spec.loader is not None
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    forge_args = [
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
        *("--interval", "1", "--collectors", "cpu,memory", "--node-id", "node_t"),
        *("--run-id", mlflow_run["training_run_id"], "--tracking-uri", mlflow_run["uri"]),
    ]
    env = {
        **TRAINING_SETTINGS,
        "MLFLOW_EXPERIMENT_ID": mlflow_run["experiment_id"],
        "OTEL_FORGE_SPOOL_DIR": str(directory / "spool-training"),
    }
    return trainer.start_training_node(forge_args, env, directory, trainer_args=["--steps", "20"])


@pytest.fixture(scope="module")
def stack(mlflow_run, job, tmp_path_factory):
    watched = job  # the loops below name scrape jobs `job`
    directory = tmp_path_factory.mktemp("collector-config-live")
    infiniband = training_node(directory / "infiniband")
    agent = start_agent(
        [
            *(["--pid", str(watched[1].pid)] if watched else []),
            "--prometheus-port",
            "0",
            "--interval",
            "1",
            # MLflow windows of 3 samples: the shared test server answers a window's call well within
            # its window even on a loaded machine, so the delivery never queues (the Spooling rule is quiet).
            "--samples-per-window",
            "3",
            "--node-id",
            "node_0",
            "--run-id",
            mlflow_run["run_id"],
            "--tracking-uri",
            mlflow_run["uri"],
        ],
        env={
            **fake_gpu_env(SCENARIO),
            "MLFLOW_EXPERIMENT_ID": mlflow_run["experiment_id"],
            "OTEL_FORGE_INFINIBAND_ROOT": str(infiniband),
        },
    )
    trainer = None
    try:
        rules = short_for_rules(directory / "alert-rules.yml")
        trainer = start_trainer(directory, mlflow_run)
        targets = [agent.scrape_target, trainer.scrape_target]
        config = prometheus_test_config(directory, targets, f"127.0.0.1:{free_port()}", rules)
        with start_prometheus_with(config, directory) as prometheus:
            prometheus.wait_for_series('otel_forge_run_info{job="otel-forge-gateway"}', timeout_s=30)
            prometheus.wait_for_series('otel_forge_run_info{job="otel-forge"}', timeout_s=30)
            # The ports as Prometheus first sees them (active, no symbol error), then mlx5_1 goes down and
            # mlx5_0 counts symbol errors.
            for job in ("otel-forge", "otel-forge-gateway"):
                port = f'job="{job}", otel_forge_infiniband_device'
                prometheus.wait_for_series(
                    f'otel_forge_infiniband_status{{{port}="mlx5_1", otel_forge_infiniband_state="active"}} == 1', 30
                )
                prometheus.wait_for_series(
                    f'otel_forge_infiniband_errors_total{{{port}="mlx5_0", error_type="symbol_error"}}', 30
                )
            set_file(infiniband, "mlx5_1", 1, "state", "1: DOWN")
            set_file(infiniband, "mlx5_1", 1, "phys_state", "2: Polling")
            set_file(infiniband, "mlx5_0", 1, "counters/symbol_error", 5)
            if watched:  # the OOM kill, once Prometheus has seen the count at 0
                for scrape_job in ("otel-forge", "otel-forge-gateway"):
                    prometheus.wait_for_series(
                        f'otel_forge_container_memory_oom_kills_total{{job="{scrape_job}"}} == 0', 30
                    )
                oom_kill_in(watched[0])
            yield {"prometheus": prometheus, "agent": agent, "run": mlflow_run, "trainer": trainer}
    finally:
        agent.stop()
        if trainer is not None:
            trainer.stop()


def alerts(prometheus: PrometheusServer) -> list[dict[str, Any]]:
    status, body = http_get(f"{prometheus.url}/api/v1/alerts")
    assert status == 200, body
    return json.loads(body)["data"]["alerts"]


def alert_summary(prometheus: PrometheusServer) -> list[tuple[str, str, str, str]]:
    """(alert, job, GPU, state) of every active alert, for failure messages."""
    return sorted(
        {
            (a["labels"]["alertname"], a["labels"].get("job", ""), a["labels"].get("hw_id", ""), a["state"])
            for a in alerts(prometheus)
        }
    )


def test_the_test_rules_differ_from_the_shipped_ones_only_in_for(tmp_path):
    shortened = yaml.safe_load(short_for_rules(tmp_path / "rules.yml").read_text())
    shipped = yaml.safe_load(RULES.read_text())
    for group in shortened["groups"]:
        for rule in group["rules"]:
            rule.pop("for")
    for group in shipped["groups"]:
        for rule in group["rules"]:
            rule.pop("for", None)
    assert shortened == shipped


def test_every_rule_has_a_witness():
    assert {rule["alert"] for rule in shipped_rules()} == set(WITNESSES)


def test_both_name_forms_are_scraped(stack):
    prometheus = stack["prometheus"]
    assert {s["metric"]["job"] for s in prometheus.query("hw_gpu_utilization")} == {"otel-forge"}
    assert {s["metric"]["job"] for s in prometheus.query("hw_gpu_utilization_ratio")} == {"otel-forge-gateway"}
    assert {s["metric"]["job"] for s in prometheus.query("otel_forge_gpu_throttle_ratio")} == {"otel-forge-gateway"}


@pytest.mark.parametrize("alert", sorted(WITNESSES))
def test_rule_metrics_exist(stack, alert):
    prometheus = stack["prometheus"]
    assert prometheus.wait_for_series(WITNESSES[alert], timeout_s=15), alert


def test_straggler_rules_join_the_run_onto_the_node(stack):
    """The recorded per-node series carry the run's labels (from otel_forge_run_info), in both forms."""
    prometheus, run = stack["prometheus"], stack["run"]
    found = prometheus.wait_for_series("run_node:otel_forge_gpu_activity:ratio_to_median5m", timeout_s=15, min_series=2)
    assert {s["metric"]["job"] for s in found} == BOTH_JOBS
    for series in found:
        labels = series["metric"]
        assert labels["mlflow_run_id"] == run["run_id"] and labels["otel_forge_node_id"] == "node_0"
        assert labels["otel_forge_gpu_activity_signal"] == "sm_activity"  # GPM there: SM activity, not utilization
    # One node scraped by two jobs: its two series straddle their median (equal when both scrapes read
    # the same samples), so the two ratios sum to exactly 2 and each is near 1.
    ratios = [float(series["value"][1]) for series in found]
    assert sum(ratios) == pytest.approx(2.0) and all(ratio == pytest.approx(1.0, rel=0.1) for ratio in ratios)
    # The run is in two scrape jobs here (the same agent twice), so its median counts 2 nodes.
    (count,) = prometheus.query("run:otel_forge_gpu_activity_nodes:count")
    assert count["metric"]["mlflow_run_id"] == run["run_id"] and float(count["value"][1]) == 2


@pytest.mark.parametrize("rule", shipped_rules(), ids=lambda rule: rule["alert"])
def test_rule_expression_evaluates(stack, rule):
    # The shipped expression, as an instant query: a parse or evaluation error raises here.
    result = stack["prometheus"].query(rule["expr"])
    assert isinstance(result, list)


def test_every_rule_evaluates_healthy(stack):
    prometheus = stack["prometheus"]

    def evaluated() -> list[dict[str, Any]] | None:
        status, body = http_get(f"{prometheus.url}/api/v1/rules")
        assert status == 200, body
        rules = [rule for group in json.loads(body)["data"]["groups"] for rule in group["rules"]]
        done = len(rules) == len(WITNESSES) + len(RECORDING) and all(rule["health"] != "unknown" for rule in rules)
        return rules if done else None

    rules = wait_for(evaluated, 15.0, message="every rule evaluated once")
    unhealthy = {rule["name"]: rule.get("lastError") for rule in rules if rule["health"] != "ok"}
    assert unhealthy == {}


def test_scenario_fires_the_expected_alerts(stack):
    prometheus = stack["prometheus"]

    def firing() -> set[tuple[str, str]] | None:
        now = {(a["labels"]["alertname"], a["labels"]["job"]) for a in alerts(prometheus) if a["state"] == "firing"}
        return now if now >= EXPECTED_FIRING else None

    fired = wait_for(
        firing,
        45.0,
        interval_s=0.5,
        message=lambda: f"alerts {sorted(EXPECTED_FIRING)}; have {alert_summary(prometheus)}",
    )
    wrongly_firing = {name for name, _ in fired} & NEVER_FIRING
    assert not wrongly_firing, [a for a in alert_summary(prometheus) if a[0] in wrongly_firing]


def test_stalled_training_alert_names_the_run_and_the_idle_gpu(stack):
    prometheus, run = stack["prometheus"], stack["run"]

    def idle() -> list[dict[str, Any]] | None:
        found = [
            a
            for a in alerts(prometheus)
            if a["labels"]["alertname"] == "OtelForgeGpuIdleDuringRun" and a["state"] == "firing"
        ]
        return found if len(found) == 2 else None

    found = wait_for(
        idle, 45.0, interval_s=0.5, message=lambda: f"GPU-idle alert of both jobs; have {alert_summary(prometheus)}"
    )
    for alert in found:
        labels = alert["labels"]
        assert labels["hw_id"] == "1", labels  # GPU 0 runs at 95%
        assert labels["mlflow_run_id"] == run["run_id"]
        # A standalone agent cannot know the run's name: the label is empty (Prometheus drops it) ...
        assert labels.get("mlflow_run_name", "") == "", labels
        assert labels["mlflow_experiment_id"] == run["experiment_id"]  # ... but was told the experiment
        assert labels["otel_forge_node_id"] == "node_0"
        assert labels["severity"] == "warning"
        # ... so the alert names the run by its id, and never as "Run  (id)".
        annotations = alert["annotations"]
        assert annotations["summary"] == (f"Run {run['run_id']}: GPU 1 on {labels['instance']} idle for 15 minutes"), (
            annotations
        )
        assert run["run_name"] not in annotations["summary"]
        assert f"MLflow run {run['run_id']} (experiment {run['experiment_id']}):" in annotations["description"]


def test_infiniband_alerts_name_the_port_and_the_run(stack):
    prometheus, run = stack["prometheus"], stack["run"]
    names = {"OtelForgeInfinibandPortDown", "OtelForgeInfinibandErrorsRising"}

    def firing() -> list[dict[str, Any]] | None:
        found = [a for a in alerts(prometheus) if a["labels"]["alertname"] in names and a["state"] == "firing"]
        return found if len(found) == 4 else None

    found = wait_for(
        firing, 45.0, interval_s=0.5, message=lambda: f"InfiniBand alerts; have {alert_summary(prometheus)}"
    )
    ports = {(a["labels"]["alertname"], a["labels"]["job"], a["labels"]["otel_forge_infiniband_device"]) for a in found}
    assert ports == {
        (name, job, device)
        for job in BOTH_JOBS
        for name, device in (("OtelForgeInfinibandPortDown", "mlx5_1"), ("OtelForgeInfinibandErrorsRising", "mlx5_0"))
    }
    for alert in found:
        labels = alert["labels"]
        if labels["alertname"] == "OtelForgeInfinibandPortDown":
            assert labels["otel_forge_infiniband_state"] == "down" and labels["mlflow_run_id"] == run["run_id"]
            assert labels["otel_forge_node_id"] == "node_0" and labels["severity"] == "critical"
            assert alert["annotations"]["summary"] == (
                f"Run {run['run_id']}: InfiniBand port mlx5_1/1 on {labels['instance']} is down"
            )
        else:
            assert labels["error_type"] == "symbol_error" and labels["severity"] == "warning"


def test_gpu_alerts_name_the_right_gpus(stack):
    prometheus = stack["prometheus"]
    wait_for(
        lambda: (
            {a["labels"]["alertname"] for a in alerts(prometheus) if a["state"] == "firing"}
            >= {"OtelForgeGpuXidError", "OtelForgeGpuUncorrectableEccErrors", "OtelForgeGpuTemperatureHigh"}
        ),
        45.0,
        interval_s=0.5,
        message=lambda: f"GPU alerts firing; have {alert_summary(prometheus)}",
    )
    by_name: dict[str, set[tuple[str, str]]] = {}
    for alert in alerts(prometheus):
        if alert["state"] == "firing":
            labels = alert["labels"]
            by_name.setdefault(labels["alertname"], set()).add((labels["job"], labels.get("hw_id", "")))
    both_gpus = {(job, gpu) for job in BOTH_JOBS for gpu in ("0", "1")}
    assert by_name["OtelForgeGpuTemperatureHigh"] == both_gpus
    assert by_name["OtelForgeGpuThermalThrottling"] == both_gpus
    assert by_name["OtelForgeGpuXidError"] == {(job, "0") for job in BOTH_JOBS}
    assert by_name["OtelForgeGpuUncorrectableEccErrors"] == {(job, "0") for job in BOTH_JOBS}
    xid = next(a for a in alerts(prometheus) if a["labels"]["alertname"] == "OtelForgeGpuXidError")
    assert xid["labels"]["otel_forge_gpu_xid"] == "79" and xid["labels"]["severity"] == "critical"


def test_training_stall_alert_names_the_host_and_the_run(stack):
    prometheus, run = stack["prometheus"], stack["run"]

    def stalled() -> list[dict[str, Any]] | None:
        found = [
            a
            for a in alerts(prometheus)
            if a["labels"]["alertname"] == "OtelForgeTrainingStalled" and a["state"] == "firing"
        ]
        return found if len(found) == 2 else None

    found = wait_for(
        stalled, 45.0, interval_s=0.5, message=lambda: f"training-stall alerts; have {alert_summary(prometheus)}"
    )
    assert {a["labels"]["job"] for a in found} == BOTH_JOBS
    for alert in found:
        labels = alert["labels"]
        assert labels["instance"] == stack["trainer"].scrape_target and labels["severity"] == "critical"
        assert labels["otel_forge_training_rank"] == "none", labels  # no rank left stacks: none named
        assert labels["mlflow_run_id"] == run["training_run_id"] and labels["otel_forge_node_id"] == "node_t"
        host = labels["host_name"]
        assert host, labels
        summary = alert["annotations"]["summary"]
        assert summary.startswith("Run ") and run["training_run_id"] in summary, summary
        assert summary.endswith(f": training stalled on {host} ({labels['instance']})"), summary
        description = alert["annotations"]["description"]
        assert "No single rank is named" in description and "stalls/" in description
