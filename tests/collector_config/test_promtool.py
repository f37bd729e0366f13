"""promtool accepts the shipped Prometheus config and alert rules, and rejects broken copies."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

CONFIG_DIR = Path(__file__).resolve().parents[2] / "collector-config"
PROMTOOL = shutil.which("promtool")
TARGET_EXAMPLES = {"otel-forge": "nodes.yml.example", "otel-forge-gateway": "gateway.yml.example"}

pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian package prometheus)")


def promtool(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60, cwd=cwd)


def copy_config(tmp_path: Path) -> Path:
    """collector-config/ copied, with the target examples in place as discovery files."""
    folder = tmp_path / "collector-config"
    shutil.copytree(CONFIG_DIR, folder)
    for job, example in TARGET_EXAMPLES.items():
        shutil.copy(folder / "targets" / job / example, folder / "targets" / job / example.removesuffix(".example"))
    return folder


@pytest.mark.parametrize("name, count", [("alert-rules.yml", 23), ("recording-rules.yml", 12)])
def test_rules_pass(name, count):
    result = promtool("check", "rules", CONFIG_DIR / name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {count} rules found" in result.stdout


def test_config_passes_with_its_rules():
    result = promtool("check", "config", CONFIG_DIR / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 2 rule files found" in result.stdout


def test_config_passes_with_the_discovery_examples_in_place(tmp_path):
    folder = copy_config(tmp_path)
    result = promtool("check", "config", folder / "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    # The examples were found and parsed as file_sd files (no "does not exist" warning for *.yml).
    assert 'file "targets/otel-forge/*.yml"' not in result.stdout + result.stderr


def test_scrape_jobs():
    config = yaml.safe_load((CONFIG_DIR / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"otel-forge", "otel-forge-gateway"}
    agents = jobs["otel-forge"]
    assert agents["static_configs"] and agents["file_sd_configs"]
    assert jobs["otel-forge-gateway"]["honor_labels"] is True
    assert config["rule_files"] == ["alert-rules.yml", "recording-rules.yml"]


def test_rule_with_a_promql_syntax_error_fails(tmp_path):
    rules = yaml.safe_load((CONFIG_DIR / "alert-rules.yml").read_text())
    rules["groups"][0]["rules"][0]["expr"] = "avg_over_time(hw_temperature_celsius[5m] > 85"
    broken = tmp_path / "alert-rules.yml"
    broken.write_text(yaml.safe_dump(rules))
    result = promtool("check", "rules", broken)
    assert result.returncode != 0
    assert "parse error" in result.stdout + result.stderr


def test_rule_with_a_bad_template_fails(tmp_path):
    rules = yaml.safe_load((CONFIG_DIR / "alert-rules.yml").read_text())
    rules["groups"][0]["rules"][0]["annotations"]["summary"] = "{{ $labels.hw_id "
    broken = tmp_path / "alert-rules.yml"
    broken.write_text(yaml.safe_dump(rules))
    assert promtool("check", "rules", broken).returncode != 0


def test_config_with_a_bad_key_fails(tmp_path):
    folder = copy_config(tmp_path)
    config = yaml.safe_load((folder / "prometheus.yml").read_text())
    config["scrape_configs"][0]["scrape_intervall"] = "15s"
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = promtool("check", "config", folder / "prometheus.yml")
    assert result.returncode != 0
    assert "scrape_intervall" in result.stdout + result.stderr


def test_config_with_a_broken_rule_file_fails(tmp_path):
    folder = copy_config(tmp_path)
    (folder / "alert-rules.yml").write_text("groups:\n  - name: x\n    rules:\n      - alert: A\n        expr: up ==\n")
    assert promtool("check", "config", folder / "prometheus.yml").returncode != 0


def test_config_with_a_broken_discovery_file_fails(tmp_path):
    folder = copy_config(tmp_path)
    (folder / "targets" / "otel-forge" / "nodes.yml").write_text("- targetz: [gpu-node-001:9464]\n")
    assert promtool("check", "config", folder / "prometheus.yml").returncode != 0
