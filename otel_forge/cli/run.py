"""``otel-forge run [options] -- CMD ...``: CMD inside an MLflow run, its node sampled meanwhile.

The run is opened first so CMD inherits ``MLFLOW_RUN_ID``, ``MLFLOW_TRACKING_URI`` and
``MLFLOW_EXPERIMENT_ID`` (``mlflow.log_*`` in CMD lands in the same run, and launchers pass them
on to other nodes). SIGINT/SIGTERM are forwarded; the run ends FINISHED, FAILED or KILLED from
CMD's exit, and ``otel-forge`` exits with CMD's code.
"""

from __future__ import annotations

import argparse
import logging
import signal
import subprocess
from typing import Any

from otel_forge.cli.options import add_agent_options, config_from_args
from otel_forge.config import ConfigError
from otel_forge.scrub import scrub

_logger = logging.getLogger(__name__)


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("run", help="run a training command inside an MLflow run")
    parser.add_argument("--experiment", help="experiment name (default: MLFLOW_EXPERIMENT_NAME, else otel-forge)")
    parser.add_argument("--run-name", help="name of a new run")
    parser.add_argument("--description", help="run description (mlflow.note.content)")
    parser.add_argument("--tag", action="append", default=[], metavar="K=V", help="a run tag (repeatable)")
    add_agent_options(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ...")
    parser.set_defaults(run=run)


def _tags(pairs: list[str]) -> dict[str, str]:
    tags = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"invalid tag (from --tag): expected K=V, got {pair!r}")
        tags[key] = value
    return tags


def _command(args: argparse.Namespace) -> list[str]:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise ConfigError("invalid command (from CMD): nothing to run; usage: otel-forge run [options] -- CMD ...")
    return command


def run(args: argparse.Namespace) -> int:
    from otel_forge.mlflow.run_metadata import launch_config_path, load_launch_config
    from otel_forge.mlflow.training_run import TrainingRun

    command = _command(args)
    config = config_from_args(args)
    launch_file = launch_config_path(["otel-forge", *command])
    training_run = TrainingRun(
        config=load_launch_config(launch_file) if launch_file else None, tracking_uri=config.tracking_uri,
        experiment=args.experiment, run_name=args.run_name, run_id=config.run_id, description=args.description,
        tags={**_tags(args.tag), "otel_forge.command": scrub(" ".join(command))}, system_metrics=False,
        launch_argv=["otel-forge", *command], forge_config=config, handle_sigterm=False)
    live = training_run.start()
    env = dict(args.child_environ)
    if live:
        entry = training_run.tracking_entry()
        env.update(MLFLOW_RUN_ID=training_run.run_id, MLFLOW_TRACKING_URI=training_run.tracking_uri,
                   MLFLOW_EXPERIMENT_ID=training_run._run.experiment_id)  # noqa: SLF001
        print(f"otel-forge: run {entry['run_id']} in experiment {entry['experiment']} at {entry['tracking_uri']}",
              flush=True)
    try:
        child = subprocess.Popen(command, env=env)
    except OSError as error:
        training_run.close("FAILED")
        raise ConfigError(f"invalid command (from CMD): cannot run {command[0]!r}: {error.strerror}") from None
    monitor = _start_system_metrics(config, training_run, child.pid) if live else None
    received = _forward_signals(child)
    try:
        code = child.wait()
    finally:
        if monitor is not None:
            monitor.stop()
    status = "FINISHED" if code == 0 else ("KILLED" if received or code < 0 else "FAILED")
    training_run.close(status)
    return code if code >= 0 else 128 - code


def _start_system_metrics(config: Any, training_run: Any, pid: int) -> Any:
    from otel_forge.mlflow.monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(config.replace(run_id=training_run.run_id, tracking_uri=training_run.tracking_uri,
                                                  pid=pid))
    if not monitor.node.runs_agent:
        return None
    monitor.start()
    for endpoint in monitor.endpoints:
        print(f"otel-forge: serving {endpoint}", flush=True)
    return monitor


def _forward_signals(child: subprocess.Popen) -> list[int]:
    """Pass SIGINT/SIGTERM on to the child; the list records what arrived."""
    received: list[int] = []

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        if child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    return received
