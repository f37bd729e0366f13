"""collector-config/README.md: its files exist, its commands parse, its names match the shipped files."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from otel_forge.cli import build_parser
from otel_forge.cli.options import AGENT_FLAGS
from otel_forge.config import SETTINGS, ForgeConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "collector-config"
README = (CONFIG_DIR / "README.md").read_text()
# Variables the Collector configs read (not otel-forge settings).
CONFIG_VARIABLES = {"OTEL_GATEWAY_ENDPOINT": "agent.yaml", "PROMETHEUS_REMOTE_WRITE_URL": "gateway.yaml"}
# Shell values the README uses, replaced by something concrete to parse.
SHELL_VALUES = {
    '"$(hostname -s)"': "gpu-node-001",
    "$(hostname -s)": "gpu-node-001",
    '"$MLFLOW_RUN_ID"': "0123456789abcdef",
}


def code_blocks() -> list[str]:
    return re.findall(r"```[a-z]*\n(.*?)```", README, flags=re.S)


def otel_forge_commands() -> list[str]:
    """Every `otel-forge run|monitor|doctor ...` command of the README, env assignments included."""
    lines = []
    for block in code_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            if re.search(r"(^|\s)otel-forge (run|monitor|doctor)\b", line) and not line.startswith("#"):
                lines.append(line)
    lines += [
        span
        for span in re.findall(r"`([^`\n]*otel-forge (?:run|monitor|doctor)[^`\n]*)`", README)
        if "--" in span or "=" in span
    ]
    return lines


def split_command(line: str) -> tuple[dict[str, str], list[str]]:
    for shell, value in SHELL_VALUES.items():
        line = line.replace(shell, value)
    tokens = shlex.split(line)
    env = {}
    while tokens and re.match(r"^[A-Z_][A-Z0-9_]*=", tokens[0]):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    assert tokens[0] == "otel-forge", line
    return env, tokens[1:]


def test_files_named_exist():
    for name in re.findall(r"^\| `([^`]+)` \|", README, flags=re.M):
        if "/" in name or "." in name:
            assert (CONFIG_DIR / name).is_file(), name


def test_there_are_commands_for_each_setup():
    commands = otel_forge_commands()
    assert any("--otlp-endpoint" in line for line in commands)
    assert any("OTEL_EXPORTER_OTLP_ENDPOINT=" in line for line in commands)
    assert any("--prometheus-host" in line for line in commands)
    for heading in (
        "## 1. Single node",
        "## 2. Many nodes, scraped directly",
        "## 3. Many nodes, through OpenTelemetry Collectors",
    ):
        assert heading in README
    for command in (
        "prometheus --config.file=collector-config/prometheus.yml",
        "otelcol-contrib --config collector-config/gateway.yaml",
        "otelcol-contrib --config collector-config/agent.yaml",
    ):
        assert command in README, command


@pytest.mark.parametrize("line", otel_forge_commands())
def test_otel_forge_command_parses_and_resolves(line):
    env, argv = split_command(line)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as error:
        pytest.fail(f"{line!r}: usage error ({error.code})")
    if args.command in ("monitor", "doctor", "run"):
        explicit = {field: getattr(args, field, None) for field in AGENT_FLAGS.values()}
        explicit["prometheus"] = getattr(args, "prometheus", None)
        ForgeConfig.resolve(environ=env, **explicit)  # raises ConfigError on a bad value


def test_environment_variables_are_real():
    settings = {name for setting in SETTINGS for name in setting.env}
    for name in set(re.findall(r"\b((?:OTEL|MLFLOW|PROMETHEUS)_[A-Z0-9_]+)\b", README)):
        if name in CONFIG_VARIABLES:
            assert f"${{env:{name}" in (CONFIG_DIR / CONFIG_VARIABLES[name]).read_text(), name
        else:
            assert name in settings, f"{name} is neither an otel-forge setting nor a Collector config variable"


def test_alert_table_lists_every_rule():
    rules = {
        rule["alert"]: rule
        for group in yaml.safe_load((CONFIG_DIR / "alert-rules.yml").read_text())["groups"]
        for rule in group["rules"]
    }
    table = dict(re.findall(r"^\| `(OtelForge\w+)` \| (\w+) \|", README, flags=re.M))
    assert table == {name: rule["labels"]["severity"] for name, rule in rules.items()}


def test_component_list_matches_the_configs():
    from collector_lint import load, used_types

    used = used_types(load(CONFIG_DIR / "agent.yaml")) | used_types(load(CONFIG_DIR / "gateway.yaml"))
    for kind, type_name in used:
        assert f"`{type_name}`" in README, (kind, type_name)
