"""``otel-forge replay PATH``: deliver what a close left in a spool (system-metrics windows, or a
training run's metrics and its end); ``otel-forge replay --all``: everything earlier processes left
in the spool root, oldest first (spools whose writer still runs are left to it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from otel_forge.cli.progress import ReplayProgress
from otel_forge.config import ConfigError, ForgeConfig
from otel_forge.scrub import error_line


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "replay",
        help="deliver what a spool directory keeps",
        description=(
            "Deliver to MLflow what a process kept while the tracking server did not answer: a job's "
            "values, windows and run end, each once, in the run it would have had."
        ),
        epilog=(
            "examples:\n"
            "  otel-forge replay ~/.cache/otel-forge/spool/run-20261204-101500-4242\n"
            "  otel-forge replay --all"
        ),
    )
    parser.add_argument(
        "path", nargs="?", help="the spool directory otel-forge named (one spool, or a job's directory of spools)"
    )
    parser.add_argument(
        "--all", action="store_true", help="everything earlier processes left in the spool root, oldest first"
    )
    parser.add_argument("--tracking-uri", help="tracking server (default: the one recorded, or MLFLOW_TRACKING_URI)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otel_forge.mlflow.replay import left_in, spools_in
    from otel_forge.mlflow.spool_files import spool_root

    if (args.path is None) == (not args.all):
        raise ConfigError("invalid arguments: give a spool directory (PATH) or --all, one of them")
    config = ForgeConfig.resolve(argument_names={"tracking_uri": "--tracking-uri"}, tracking_uri=args.tracking_uri)
    tracking_uri = config.tracking_uri if args.tracking_uri else None
    if not args.all:
        path = Path(args.path)
        if not path.is_dir():
            raise ConfigError(f"invalid path (from PATH): {path} is not a directory")
        if not spools_in(path):
            raise ConfigError(f"invalid path (from PATH): {path} holds no spool (nothing to deliver)")
        return _replay_path(path, tracking_uri)
    root = spool_root(config.spool_dir)
    left = left_in(root)
    if not left:
        print(f"otel-forge: nothing left to deliver in {root}")
        return 0
    for done, path in enumerate(left):
        if (code := _replay_path(path, tracking_uri, busy_ok=True)) != 0:
            print(f"otel-forge: {len(left) - done} spool(s) left in {root}; they are kept", file=sys.stderr)
            return code
    return 0


def _replay_path(path: Path, tracking_uri: str | None, busy_ok: bool = False) -> int:
    """One spool or a job's directory of them (the launcher's journal first: it opens the job's run)."""
    from otel_forge.mlflow.replay import VALUES, WINDOWS, kept_in, replay_in

    values, windows = kept_in(path)
    progress = ReplayProgress(sys.stderr, {VALUES: values, WINDOWS: windows})
    try:
        for spool, result in replay_in(path, tracking_uri, progress):
            progress.close()
            if result is None:
                print(f"otel-forge: another process is delivering {spool} now: left to it", file=sys.stderr)
                if not busy_ok:
                    return 1
            elif (code := _said(spool, result)) != 0:
                return code
    except FileNotFoundError as error:
        raise ConfigError(f"invalid path (from PATH): {error}") from None
    except KeyboardInterrupt:
        progress.close()
        print(
            f"otel-forge: replay interrupted; what is not delivered is kept, and `otel-forge replay {path}` "
            "goes on from there", file=sys.stderr,
        )  # fmt: skip
        return 130
    except Exception as error:  # noqa: BLE001 - a server error is reported in one line; the spool stays
        progress.close()
        print(f"otel-forge: replay stopped, the spool is kept: {error_line(error)}", file=sys.stderr)
        return 1
    return 0


def _said(path: Path, result: Any) -> int:
    print(
        f"otel-forge: delivered {result.delivered} {result.unit} to run {result.run_id}"
        f"{f' and ended it {result.ended}' if result.ended else ''}"
    )
    if result.set_aside:
        # Each file was named on stderr as it was set aside.
        print(
            f"otel-forge: {result.set_aside} file(s) in {path} were not windows and are left there as *.corrupt",
            file=sys.stderr,
        )
        return 1
    return 0
