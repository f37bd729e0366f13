"""The agent options shared by the commands that run an agent, mapped onto ``ForgeConfig``."""

from __future__ import annotations

import argparse
from typing import Any

from otel_forge.config import SETTINGS_BY_NAME, ForgeConfig

# flag -> ForgeConfig field; argparse stores each under the field's name.
AGENT_FLAGS = {
    "--interval": "sampling_interval_s",
    "--samples-per-window": "samples_per_window",
    "--prometheus-host": "prometheus_host",
    "--prometheus-port": "prometheus_port",
    "--otlp-endpoint": "otlp_endpoint",
    "--otlp-protocol": "otlp_protocol",
    "--otlp-receiver-grpc-port": "otlp_receiver_grpc_port",
    "--otlp-receiver-http-port": "otlp_receiver_http_port",
    "--collectors": "collectors",
    "--gpus": "gpus",
    "--node-id": "node_id",
    "--job-id": "job_id",
    "--pid": "pid",
    "--run-id": "run_id",
    "--tracking-uri": "tracking_uri",
}
_HELP = {
    "--interval": "seconds between samples",
    "--samples-per-window": "samples folded into one MLflow step (default: 1, 3 or 6 by the job's node count)",
    "--prometheus-host": "address of the /metrics endpoint",
    "--prometheus-port": "port of the /metrics endpoint (0: a free one)",
    "--otlp-endpoint": "OTLP endpoint URL (enables OTLP export)",
    "--otlp-protocol": "grpc or http/protobuf",
    "--otlp-receiver-grpc-port": "port of the OTLP/gRPC receiver, with --otlp-receiver",
    "--otlp-receiver-http-port": "port of the OTLP/HTTP receiver, with --otlp-receiver",
    "--collectors": "collectors to run, comma-separated",
    "--gpus": "all, visible, or a list of GPU indices/UUIDs",
    "--node-id": "node id (default: from the launcher)",
    "--job-id": "job key shared by every process of the job (default: from the launcher)",
    "--pid": "root of the monitored process tree (default: the agent)",
    "--run-id": "MLflow run that receives system/<node>/ metrics",
    "--tracking-uri": "MLflow tracking URI (default: MLFLOW_TRACKING_URI, else MLflow's default)",
}


def add_agent_options(parser: argparse.ArgumentParser, help_overrides: dict[str, str] | None = None) -> None:
    group = parser.add_argument_group("agent options")
    helps = {**_HELP, **(help_overrides or {})}
    for flag, field in AGENT_FLAGS.items():
        # Plain strings: ForgeConfig parses and validates them, naming the flag on error.
        group.add_argument(
            flag, dest=field, metavar=field.split("_")[-1].upper(), help=_with_default(helps[flag], field)
        )
    group.add_argument(
        "--no-prometheus",
        dest="prometheus",
        action="store_const",
        const=False,
        help="do not serve a Prometheus endpoint",
    )
    group.add_argument(
        "--otlp-receiver",
        dest="otlp_receiver",
        action="store_const",
        const=True,
        help="receive OTLP metrics (gRPC and HTTP, on localhost) into the run (docs/cli.md, 'OTLP in')",
    )


def _with_default(text: str, field: str) -> str:
    """The help, with the setting's default from the settings table (unless the text says it)."""
    default = SETTINGS_BY_NAME[field].default
    if "default" in text or default in (None, (), {}):
        return text
    shown = ",".join(default) if isinstance(default, tuple) else default
    return f"{text} (default {shown})"


def config_from_args(args: argparse.Namespace, **overrides: Any) -> ForgeConfig:
    explicit = {field: getattr(args, field, None) for field in AGENT_FLAGS.values()}
    explicit["prometheus"] = getattr(args, "prometheus", None)
    explicit["otlp_receiver"] = getattr(args, "otlp_receiver", None)
    explicit.update(overrides)
    names = {field: flag for flag, field in AGENT_FLAGS.items()}
    names["prometheus"] = "--no-prometheus"
    names["otlp_receiver"] = "--otlp-receiver"
    return ForgeConfig.resolve(argument_names=names, **explicit)
