"""``otel-forge``: the command line. The only place that configures logging or prints."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from importlib.metadata import version
from typing import NoReturn

from otel_forge.cli.parser import USAGE_ERROR, CommandParser
from otel_forge.config import MLFLOW_LOGGING_LEVEL_VAR, MLFLOW_RETRIES_VAR, ConfigError
from otel_forge.pipeline import EndpointError


class RepeatFilter(logging.Filter):
    """Lets a message template of the loggers under ``prefix`` through at most once per interval."""

    def __init__(self, prefix: str, interval_s: float) -> None:
        super().__init__()
        self._prefix = prefix
        self._interval_s = interval_s
        self._last: dict[tuple[str, object], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self._prefix):
            return True
        key = (record.name, record.msg)
        now = time.monotonic()
        if now - self._last.get(key, -self._interval_s) < self._interval_s:
            return False
        self._last[key] = now
        return True


# One module each (``otel_forge.cli.<name>``: its ``add_parser`` and its ``run``).
COMMANDS = ("run", "monitor", "doctor", "replay")


def build_parser(command: str | None = None) -> CommandParser:
    """The command line's parser: every command's, or only ``command``'s where the command line names one
    (a command's module imports what it runs: the node agent need not import ``run``'s or ``doctor``'s)."""
    parser = CommandParser(
        prog="otel-forge",
        description="Hardware metrics of a training machine, to MLflow, Prometheus and OpenTelemetry.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    parser.add_argument("--version", action="version", version=f"otel-forge {version('otel-forge')}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for name in (command,) if command in COMMANDS else COMMANDS:
        importlib.import_module(f"otel_forge.cli.{name}").add_parser(commands)
    return parser


def _without_traceback(record: logging.LogRecord) -> bool:
    """The OTel SDK's warnings as one line (``-v`` keeps the traceback): a collect that outlasts a
    short interval under load ("Metric collection timed out") is the SDK's own, not a crash."""
    if record.name.startswith("opentelemetry") and record.exc_info and record.exc_info[1] is not None:
        record.msg, record.args = f"{record.getMessage()} ({record.exc_info[1]!r})", ()
        record.exc_info, record.exc_text = None, None
    return True


# What otel-forge's own processes never import, though MLflow's client would where it is installed
# (its imports of both are guarded, and mlflow-skinny has neither): pandas, with MLflow's own import
# (0.8 CPU-s), and IPython, which its first call asks whether it runs in a Databricks notebook
# (0.5 CPU-s). On every node of a job at once. Our processes run no user code (CMD is its own).
NOT_IMPORTED = ("pandas", "IPython")


def configure_process(verbose: int) -> None:
    """Logging and MLflow's client as an otel-forge process (the CLI, the sampler) wants them."""
    level = (logging.WARNING, logging.INFO, logging.DEBUG)[min(verbose, 2)]
    logging.basicConfig(level=level, format="otel-forge: %(levelname)s %(name)s: %(message)s")
    # The OTel SDK logs a failed OTLP export every interval: once a minute is enough to be told.
    for handler in logging.getLogger().handlers:
        handler.addFilter(RepeatFilter("opentelemetry", interval_s=60.0))
        if not verbose:
            handler.addFilter(_without_traceback)
    # The delivery worker retries with its own backoff; urllib3's per-attempt lines are noise, and
    # so are MLflow's own (its store's retries, its table creation): -v shows them.
    logging.getLogger("urllib3").setLevel(max(level, logging.ERROR))
    if not verbose:
        os.environ.setdefault(MLFLOW_LOGGING_LEVEL_VAR, "ERROR")  # read when mlflow is imported
    # In the agent's own process our worker does the retrying: one attempt per call.
    os.environ.setdefault(MLFLOW_RETRIES_VAR, "0")
    for name in NOT_IMPORTED:
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]


def exit_now(code: int) -> NoReturn:
    """Exit as the interpreter would, without its teardown: the non-daemon threads finish and the
    atexit handlers run (logging's flush, the SDK's shutdown), then the process ends. Tearing down
    the modules MLflow, SQLAlchemy and pydantic bring costs 0.6 s of CPU at every agent's stop,
    on every node of a job at once, and writes nothing."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # noqa: SLF001 - what the interpreter itself runs at exit
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def console_main() -> NoReturn:
    """The ``otel-forge`` command (``main`` returns its code to a caller in the same process)."""
    exit_now(main())


def main(argv: Sequence[str] | None = None) -> int:
    # CMD of `otel-forge run` gets the environment as the user set it, not our defaults below.
    child_environ = dict(os.environ)
    argv = list(sys.argv[1:] if argv is None else argv)
    # The first word that is not a flag is the command (otel-forge's own flags take no value).
    named = next((word for word in argv if not word.startswith("-")), None)
    args = build_parser(named).parse_command_line(argv)
    args.child_environ = child_environ
    configure_process(args.verbose)
    try:
        return args.run(args)
    except (ConfigError, EndpointError) as error:
        print(f"otel-forge: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        return 130
