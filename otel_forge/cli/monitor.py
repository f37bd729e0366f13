"""``otel-forge monitor``: the node agent, until SIGINT/SIGTERM or ``--duration``."""

from __future__ import annotations

import argparse
import math
import signal
import sys
from typing import TYPE_CHECKING, Any

from otel_forge.cli.main_thread import sleep_until
from otel_forge.cli.options import add_agent_options, config_from_args
from otel_forge.config import ConfigError, ForgeConfig
from otel_forge.pipeline import Agent

if TYPE_CHECKING:
    from otel_forge.mlflow.received_runs import ReceivedRuns
    from otel_forge.mlflow.system_metrics.monitor import SystemMetricsMonitor


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "monitor",
        help="run the node agent",
        description=(
            "Sample this node (CPU, memory, disk, network, NVIDIA and AMD GPUs, a process tree) once per "
            "interval and hand each sample to every sink: /metrics for Prometheus, OTLP to a Collector "
            "(--otlp-endpoint), and an MLflow run as system/... metrics (--run-id). Runs until stopped."
        ),
        epilog=(
            "examples:\n"
            "  otel-forge monitor --prometheus-port 9464\n"
            "  otel-forge monitor --run-id 0123456789abcdef0123456789abcdef --duration 600"
        ),
    )
    add_agent_options(parser)
    parser.add_argument("--duration", metavar="S", help="stop after S seconds (default: until stopped)")
    parser.set_defaults(run=run)


def _duration_s(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < math.inf:
        raise ConfigError(f"invalid duration (from --duration): must be a number of seconds > 0, got {text!r}")
    return value


def _agent(config: ForgeConfig, received: ReceivedRuns | None) -> Agent | SystemMetricsMonitor:
    """The plain agent (with what it receives over OTLP, where it does), or with ``--run-id`` the agent
    plus the MLflow exporter into that run (which receives OTLP itself)."""
    if config.run_id is None:
        from otel_forge.collectors.self_telemetry import ReceivedCollector

        return Agent(config, extra_collectors=[ReceivedCollector(received.latest)] if received else ())
    from otel_forge.mlflow.system_metrics.monitor import SystemMetricsMonitor

    return SystemMetricsMonitor(config)


def _receive(config: ForgeConfig) -> ReceivedRuns | None:
    """OTLP metrics received into the runs each request names (this agent serves none)."""
    if not config.otlp_receiver:
        return None
    from otel_forge.mlflow.received_runs import ReceivedRuns

    return ReceivedRuns(config, config.tracking_uri, serves_a_run=False).start()


def _deliver_leftovers(config: ForgeConfig, node: str) -> None:
    """What ended processes left in this node's spools, in the background (a daemon thread)."""
    from otel_forge.mlflow.leftovers import LeftoverDelivery
    from otel_forge.mlflow.spool_files import spool_root

    LeftoverDelivery(spool_root(config.spool_dir), node).start()


def run(args: argparse.Namespace) -> int:
    duration_s = _duration_s(args.duration)
    config = config_from_args(args)
    received = _receive(config) if config.run_id is None else None
    agent = _agent(config, received)
    stopping: list[int] = []  # the handler only records: it may run inside a lock the main thread holds
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: stopping.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        agent.start()
        if not agent.node.runs_agent:
            print(f"otel-forge: local rank {agent.node.local_rank}: the agent runs on local rank 0", flush=True)
            return 0
        for endpoint in [*agent.endpoints, *(received.receiver.endpoints if received else ())]:
            print(f"otel-forge: serving {endpoint}", flush=True)
        for name, reason in agent.absent_collectors.items():
            print(f"otel-forge: collector {name} absent: {reason}", file=sys.stderr, flush=True)
        if isinstance(agent, Agent):  # with a run, the MLflow monitor delivers them
            _deliver_leftovers(config, agent.node.node_id or agent.node.hostname)
        sleep_until(lambda: bool(stopping), duration_s)
    finally:
        if received is not None:
            received.stop(config.close_deadline_s())
        agent.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
