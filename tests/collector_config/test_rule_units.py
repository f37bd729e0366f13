"""The slow node of a job, the busy-but-idle GPU and the InfiniBand ports, evaluated by Prometheus's own
engine (promtool).

``rules.test.yml`` feeds the shipped recording and alert rules an 8-node job with one slow node
(through a Collector, with GPM), another one scraped directly without GPM, a 2-node job, and a node
with a GPU busy but idle; in a second test, a node of a run whose InfiniBand port goes down and whose
RoCE port counts symbol errors; then a job's cgroup at its limits; then two trainings that stall, one of
them with a slow rank. It asserts the recorded values and exactly which alerts fire.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

HERE = Path(__file__).resolve().parent
CONFIG_DIR = HERE.parents[1] / "collector-config"
UNIT_TESTS = HERE / "rules.test.yml"
RECORDING = CONFIG_DIR / "recording-rules.yml"
ALERTS = CONFIG_DIR / "alert-rules.yml"
PROMTOOL = shutil.which("promtool")

needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)")
RUN_LABELS = ("mlflow_run_id", "mlflow_experiment_id", "mlflow_run_name", "otel_forge_node_id")


def recording_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RECORDING.read_text())["groups"] for rule in group["rules"]]


def alert(name: str) -> dict:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    (rule,) = [rule for group in groups for rule in group["rules"] if rule.get("alert") == name]
    return rule


def promtool_test(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120, cwd=path.parent
    )


@needs_promtool
def test_the_unit_tests_pass():
    result = promtool_test(UNIT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def _copy(tmp_path: Path, alerts_text: str | None = None, recording_text: str | None = None) -> Path:
    """The unit tests and the shipped rules laid out as in the checkout, optionally with changed rules."""
    (tmp_path / "collector-config").mkdir()
    (tmp_path / "tests" / "collector_config").mkdir(parents=True)
    (tmp_path / "collector-config" / "alert-rules.yml").write_text(alerts_text or ALERTS.read_text())
    (tmp_path / "collector-config" / "recording-rules.yml").write_text(recording_text or RECORDING.read_text())
    copy = tmp_path / "tests" / "collector_config" / "rules.test.yml"
    copy.write_text(UNIT_TESTS.read_text())
    return copy


@needs_promtool
@pytest.mark.parametrize(
    "change",
    [
        # A looser threshold: the slow nodes (at 0.5 of the median) no longer alert.
        ("ratio_to_median5m < 0.8", "ratio_to_median5m < 0.4"),
        # No minimum job size: the 2-node job's slower node alerts too.
        ("count >= 3", "count >= 1"),
        # SM activity ignored: the busy-but-idle GPU goes unnoticed.
        ("< 0.2)", "< 0.1)"),
        # A port that was never active (no cable) alerts too.
        ("[1h]) == 1)", "[1h]) >= 0)"),
        # Discards (congestion) count as link errors.
        ('error_type=~"symbol_error|', 'error_type=~"port_xmit_discards|symbol_error|'),
        # A node that serves a run alerts twice (with and without the run's labels).
        ("or on (job, instance)", "or"),
        # Every rank alerts, not the one flagged slow.
        ('otel_forge_training_slow_rank(_ratio)?"} == 1)', 'otel_forge_training_slow_rank(_ratio)?"} >= 0)'),
    ],
    ids=["threshold", "job-size", "busy-but-idle", "never-active-port", "discards", "run-join", "slow-flag"],
)
def test_the_unit_tests_catch_a_changed_alert(tmp_path, change):
    old, new = change
    text = ALERTS.read_text()
    assert old in text
    result = promtool_test(_copy(tmp_path, alerts_text=text.replace(old, new)))
    assert result.returncode != 0, result.stdout


@needs_promtool
def test_the_unit_tests_catch_a_median_over_all_runs(tmp_path):
    text = RECORDING.read_text()
    old = "quantile by (mlflow_run_id, otel_forge_gpu_activity_signal) (0.5,"
    assert old in text
    result = promtool_test(
        _copy(tmp_path, recording_text=text.replace(old, "quantile by (otel_forge_gpu_activity_signal) (0.5,"))
    )
    assert result.returncode != 0, result.stdout


def test_every_recording_rule_and_the_alerts_are_asserted():
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    assert tests["rule_files"] == [
        "../../collector-config/recording-rules.yml",
        "../../collector-config/alert-rules.yml",
    ]
    group, infiniband, containers, training = tests["tests"]
    asserted = " ".join(test["expr"] for test in group["promql_expr_test"])
    for rule in recording_rules():
        assert rule["record"] in asserted, rule["record"]
    alerted = {test["alertname"]: test for test in group["alert_rule_test"] if test["exp_alerts"]}
    assert set(alerted) == {"OtelForgeStragglerNode", "OtelForgeGpuBusyButIdle"}
    fired = {test["alertname"] for test in infiniband["alert_rule_test"] if test["exp_alerts"]}
    assert fired == {"OtelForgeInfinibandPortDown", "OtelForgeInfinibandErrorsRising"}
    fired = {test["alertname"] for test in containers["alert_rule_test"] if test["exp_alerts"]}
    assert fired == {"OtelForgeCpuThrottled", "OtelForgeMemoryNearLimit", "OtelForgeOomKill"}
    fired = {test["alertname"] for test in training["alert_rule_test"] if test["exp_alerts"]}
    assert fired == {"OtelForgeTrainingStalled", "OtelForgeSlowRank"}
    quiet = {test["alertname"] for test in training["alert_rule_test"] if not test["exp_alerts"]}
    assert quiet == fired  # each is also asserted not to fire
    # The 8-node jobs: one slow node each, named with its run.
    nodes = {
        (a["exp_labels"]["mlflow_run_id"], a["exp_labels"]["otel_forge_node_id"])
        for a in alerted["OtelForgeStragglerNode"]["exp_alerts"]
    }
    assert nodes == {("run-a", "node_5"), ("run-b", "node_2")}
    run_a_nodes = {
        re.search(r'otel_forge_node_id="(\w+)"', s["series"]).group(1)
        for s in group["input_series"]
        if s["series"].startswith("otel_forge_run_info") and 'mlflow_run_id="run-a"' in s["series"]
    }
    assert len(run_a_nodes) == 8


def test_run_labels_come_from_a_join_on_run_info():
    """No hardware series is selected by run: each node's series gets the run's labels by group_left."""
    for rule in recording_rules():
        expr = rule["expr"]
        if rule["record"].startswith("run_node:") and "ratio_to_median" not in rule["record"]:
            assert "group_left (" + ", ".join(RUN_LABELS) + ")" in expr, rule["record"]
            assert "topk by (job, instance) (1, otel_forge_run_info == 1)" in expr, rule["record"]
        # Hardware metrics are never matched on a run label (they carry none).
        for selector in re.findall(r"\{[^}]*\}", expr):
            assert "mlflow" not in selector, (rule["record"], selector)
    # The alert reads the recorded series only.
    expr = alert("OtelForgeStragglerNode")["expr"]
    assert "run_node:otel_forge_gpu_activity:ratio_to_median5m < 0.8" in expr
    assert "otel_forge_run_info" not in expr and "hw_" not in expr


def test_both_name_forms_are_read():
    for rule in [*recording_rules(), alert("OtelForgeGpuBusyButIdle")]:
        for name in ("hw_gpu_utilization", "otel_forge_gpu_sm_activity", "system_cpu_utilization"):
            if name in rule["expr"]:
                assert f'{{__name__=~"{name}(_ratio)?"' in rule["expr"], (rule.get("record") or rule["alert"], name)


def test_the_infiniband_errors_alert_counts_the_link_errors_mlflow_and_the_dashboard_count():
    from otel_forge.names import INFINIBAND_LINK_ERRORS

    expr = alert("OtelForgeInfinibandErrorsRising")["expr"]
    (listed,) = re.findall(r'error_type=~"([^"]+)"', expr)
    assert listed.split("|") == list(INFINIBAND_LINK_ERRORS)
    # The port alert is the run's: its labels come from otel_forge_run_info, as the GPU-idle alert's do.
    expr = alert("OtelForgeInfinibandPortDown")["expr"]
    assert (
        "group_left (" + ", ".join(("mlflow_run_id", "mlflow_run_name", "mlflow_experiment_id", "otel_forge_node_id"))
        in expr
    )
    assert "topk by (job, instance) (1, otel_forge_run_info == 1)" in expr


def test_the_training_alerts_name_the_rank_the_host_and_the_run_where_there_is_one():
    for name in ("OtelForgeTrainingStalled", "OtelForgeSlowRank"):
        rule = alert(name)
        metric = {"OtelForgeTrainingStalled": "stalled", "OtelForgeSlowRank": "slow_rank"}[name]
        # Both name forms, the run's labels by the join the other run alerts use, and the node without a run.
        assert rule["expr"].count(f'{{__name__=~"otel_forge_training_{metric}(_ratio)?"}} == 1') == 2, name
        assert "group_left (" + ", ".join(("mlflow_run_id", "mlflow_run_name", "mlflow_experiment_id")) in rule["expr"]
        assert "topk by (job, instance) (1, otel_forge_run_info == 1)" in rule["expr"]
        assert "or on (job, instance)" in rule["expr"]
        for label in ("otel_forge_training_rank", "host_name", "instance"):
            assert f"$labels.{label}" in rule["annotations"]["summary"], (name, label)
    stalled = alert("OtelForgeTrainingStalled")
    # The agent waits max(stall_factor x median step, stall_floor_s) before it says stalled.
    assert stalled["for"] == "0m" and stalled["labels"]["severity"] == "critical"
    assert "stalls/" in stalled["annotations"]["description"]
    assert alert("OtelForgeSlowRank")["for"] == "5m"
