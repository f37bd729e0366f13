"""``otel-forge run [options] -- CMD ...``: CMD inside an MLflow run, its node sampled meanwhile.

The run is opened first and handed to CMD (``LaunchedRun``: ``MLFLOW_RUN_ID``, the tracking URI, the
experiment), which launchers pass on to other nodes; a Python CMD of one node starts as the run opens,
and its processes are told the run once open (``_CmdNotice``: their MLflow import waits for it). The
first run CMD's code opens is that run: a plain ``mlflow.log_metric``, ``mlflow.start_run()``, HF's
``MLflowCallback`` or autolog's first fit resume it, so the loss lands beside ``system/...``; the runs
it opens after that nest under it (``run_context``); CMD's ``TrainingRun`` logs into it. Whatever CMD's
code does to the run's status (MLflow ends its run FINISHED at exit), the run ends FINISHED, FAILED or
KILLED from CMD's exit, after CMD, and ``otel-forge`` exits with CMD's code. Under a launcher every
task's ``otel-forge run`` finds the job's one run by the job key (``TrainingRun``'s rendezvous).
SIGINT/SIGTERM are forwarded; processes CMD leaves behind are stopped. MLflow's own system-metrics
logging stands down in CMD.

The run's ``mlflow.source.name`` is the first Python file on CMD's command line, as typed (the name
MLflow gives the runs that script starts), else CMD's program; ``otel_forge.command`` has all of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_forge.cli.children import Watchdog, become_subreaper, dies_with_us, stop_leftovers
from otel_forge.cli.launchers import read_launch, runs_python
from otel_forge.cli.main_thread import sleep_until
from otel_forge.cli.options import add_agent_options, config_from_args
from otel_forge.cli.rank_watch import RankZeroWatch
from otel_forge.cli.script_run_watch import ScriptRunWatch, script_names_experiment, script_run_of
from otel_forge.config import (
    JOURNALS_DELIVERED_BY_ENV,
    LAUNCHED_RUN_ENV,
    LAUNCHER_OPENS,
    MLFLOW_SYSTEM_METRICS_VAR,
    PID_NOT_STARTED,
    PROGRESS_BOARD_ENV,
    TOLD_SPOOL_ENV,
    ConfigError,
    ForgeConfig,
    env_name,
    local_store_problem,
)
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.spool_files import kept_notice_level, remove_if_empty, spool_root, told_spool
from otel_forge.mlflow.training.launched_run import LaunchedRun
from otel_forge.mlflow.training.run_notice import NOTICE_FILE, RunNotice
from otel_forge.mlflow.training.run_plan import DEFAULT_EXPERIMENT
from otel_forge.mlflow.training.run_source import RunOrigin, RunSource
from otel_forge.mlflow.training.worker_ends import take_failed_worker
from otel_forge.node import NodeIdentity
from otel_forge.pipeline.agent import EndpointError, check_prometheus_port
from otel_forge.scrub import scrub, uri_without_credentials

_logger = logging.getLogger(__name__)

SOURCE_NAME_TAG = "mlflow.source.name"


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "run",
        help="run a training command inside an MLflow run",
        description=(
            "Open (or resume) an MLflow run, run CMD inside it and end the run with CMD's outcome. CMD's own "
            "MLflow calls (HF Trainer, autolog, mlflow.log_metric, TrainingRun) log to that run; the node is "
            "sampled into it as system/... metrics and served on /metrics while CMD runs."
        ),
        epilog=(
            "examples:\n"
            "  otel-forge run --experiment llm -- python train.py --lr 3e-4\n"
            "  otel-forge run -- torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --rdzv-id job7 train.py\n"
            "Under a launcher, run it once per node, around the launcher (torchrun's options name the node)."
        ),
    )
    parser.add_argument("--experiment", help="experiment name (default: MLFLOW_EXPERIMENT_NAME, else otel-forge)")
    parser.add_argument("--run-name", help="name of a new run")
    parser.add_argument("--description", help="run description (mlflow.note.content)")
    parser.add_argument("--tag", action="append", default=[], metavar="K=V", help="a run tag (repeatable)")
    parser.add_argument(
        "--create-if-missing",
        action="store_true",
        help="with --run-id / MLFLOW_RUN_ID: start a new run if that run does not exist",
    )
    add_agent_options(
        parser,
        {
            "--run-id": "resume this MLflow run (default: MLFLOW_RUN_ID, else a new run)",
            "--pid": "root of the monitored process tree (default: CMD)",
        },
    )
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
    from otel_forge.mlflow.training.training_run import MissingRun

    command = _command(args)
    config = config_from_args(args)
    if shutil.which(command[0]) is None:
        raise ConfigError(f"invalid command (from CMD): {command[0]!r} is not an executable on PATH")
    # From here a signal is the user's: it must end the run, never kill us half way.
    signals = SignalForwarder()
    launch = read_launch(command)
    node = NodeIdentity.from_config(config, {**os.environ, **launch.environ}, host_named=launch.host_named)
    # What no server takes, from us and from CMD, is kept in one directory of this job.
    spool = job_spool_dir(config)
    config = config.replace(spool_dir=str(spool))
    script_names = script_names_experiment(args.experiment, config, node)
    training_run = _training_run(args, command, config, node, DEFAULT_EXPERIMENT if script_names else None)
    board = progress_board(config, node, spool)
    # The ranks' progress is watched where the node is sampled (local rank 0's process).
    watch = _training_watch(config, node, board, training_run).start() if board and node.runs_agent else None
    script = script_run_of(training_run, spool) if script_names else None
    at_once = script is None and _cmd_starts_at_once(command, config, node, training_run)
    # The node is served from now on (/metrics answers while the run opens), or, where CMD starts at
    # once, from CMD's start (a port in use is said before it); its process tree is CMD's once CMD
    # runs, its windows go to the run once the run is open.
    sampling = _NodeSampling()
    start_sampling = functools.partial(_start_system_metrics, config, training_run.tracking_uri, node, watch)
    if not at_once:
        sampling.start(start_sampling())
    elif node.runs_agent:
        check_prometheus_port(config)
    training_run.on_open.append(lambda: sampling.run_opened(training_run))
    training_run.on_unanswered.append(lambda error: _say_unanswered(training_run, command, error))
    if script is not None:
        _ask_server(training_run, command)
    if at_once:
        training_run.begin()  # CMD's processes are told the run once it is open (_CmdNotice)
    live = script is None and not at_once and training_run.start(training_run.start_wait_s)
    if isinstance(training_run.open_error, MissingRun):
        _end_before_cmd(training_run, sampling, "FAILED")
        source = config.source("run_id")
        raise ConfigError(
            f"invalid run_id (from {source}): {training_run.open_error}; --create-if-missing starts a new run instead"
        )
    env = _cmd_environ(args.child_environ, training_run, node, live, script, at_once)
    env.update(launch.cmd_environ(node))  # the workers name this node as we do
    notice = _CmdNotice(spool) if env.get(LAUNCHED_RUN_ENV) == LAUNCHER_OPENS else None
    if board is not None or notice is not None:
        env.update(bootstrap_environ(env, board))
    if signals.received:
        _end_before_cmd(training_run, sampling, "KILLED")
        return 128 + signals.received[0]
    if notice is not None:
        notice.follow(training_run, command, waited=not at_once)
    become_subreaper()
    watchdogs = _RunWatchdog(
        lambda: Watchdog(
            training_run.run_id, training_run.tracking_uri, training_run.experiment_id, node, args.child_environ
        )
    )
    if live and training_run.run_id:
        watchdogs.start()
    else:  # a run that opens late is not left RUNNING if we die either
        training_run.on_open.append(watchdogs.start)
    try:
        # preexec_fn with threads running: it only calls prctl, through a function resolved before the fork.
        child = subprocess.Popen(command, env=env, preexec_fn=dies_with_us())  # noqa: PLW1509
    except OSError as error:
        sampling.stop()
        if notice is not None:
            notice.remove()
        _end(training_run, "FAILED", watchdogs.finish())
        raise ConfigError(f"invalid command (from CMD): cannot run {command[0]!r}: {error.strerror}") from None
    signals.forward_to(child)
    sampling.cmd_started(child.pid)
    if at_once:
        sampling.start_after_cmd(start_sampling)
    script_watch = ScriptRunWatch(script, training_run, config.experiment_wait_s).start() if script else None
    journals = _cmd_journals(training_run, spool)
    if launch.rank_pending and training_run.run_id is None:
        # Whether this node holds rank 0 is known once its workers run: if so, it makes the run.
        rank_watch = RankZeroWatch(training_run.take_rank_zero).start()
        training_run.on_open.append(rank_watch.stop)
    stopping: threading.Thread | None = None
    try:
        sleep_until(lambda: child.poll() is not None)  # a SIGTERM for CMD is passed on while it runs
        code = child.returncode
        if at_once:  # CMD was quicker than the run's open: what it and the node left goes to the run
            training_run.wait_open(config.close_deadline_s(node.node_count))
        if script_watch is not None:
            script_watch.finish()  # the run CMD made (or claimed), else ours in the default experiment
        watchdog = watchdogs.finish()
        # Nothing CMD left behind may touch the run once it is ended (MLflow's atexit ends it FINISHED).
        stop_leftovers(keep={watchdog.pid} if watchdog else (), grace_s=config.exit_grace_s)
    finally:
        if notice is not None:
            notice.remove()
        if watch is not None:
            watch.stop()  # its tables are journaled before the run's end
            sampling.read_afresh("progress")  # its last look, not a collect's cached one, is the last window's
        if (monitor := sampling.monitor) is not None:
            if monitor.exporter is not None and (key := training_run.node.job_key) is not None:
                # The server may never answer before we end: the windows wait for the job's run.
                monitor.exporter.keep_for_job_run(training_run.experiment, key)
            # Its last windows drain while the run's own calls do: one drain deadline for both.
            stopping = threading.Thread(target=monitor.stop, name="otel-forge-monitor-stop", daemon=True)
            stopping.start()
    status = "KILLED" if signals.received or code < 0 else ("FINISHED" if code == 0 else "FAILED")
    if watch is not None:
        shutil.rmtree(watch.tracker.directory, ignore_errors=True)
    journals.finish(config.close_deadline_s(node.node_count))  # what CMD logged reaches the run before its end
    # CMD is a launcher: the job's outcome names its worker that failed, never our own rank.
    worker = take_failed_worker(spool) if launch.workers_here else None
    _end(training_run, status, watchdog, stopping, worker if status != "FINISHED" else None)
    if training_run.run_id is None:
        _say_nothing_delivered(training_run, spool)
    if script is not None:
        script.remove()
    remove_if_empty(spool)
    return code if code >= 0 else 128 - code


def _cmd_starts_at_once(command: list[str], config: ForgeConfig, node: NodeIdentity, training_run: Any) -> bool:
    """CMD (Python: ``runs_python``) starts as the run opens, and is told the run once open
    (``_CmdNotice``), where nothing must be known first: no run id to check (a missing one fails before
    CMD), a job of this node alone (other nodes, and workers started elsewhere, take the run from their
    environment), and a tracking server (a local store is made once, before CMD's processes would make
    it too)."""
    from otel_forge.mlflow.training.run_plan import is_remote

    single_node = (node.node_count or 1) <= 1
    return runs_python(command) and config.run_id is None and single_node and is_remote(training_run.tracking_uri)


class _CmdNotice:
    """Tells CMD's processes, handed a run still opening (``LAUNCHER_OPENS``), what became of it: a
    ``RunNotice`` in the job directory (their MLflow import, ``job_run_id()`` and rank 0's ``TrainingRun``
    wait for it). Once the run is told, nothing overwrites it."""

    def __init__(self, directory: Path) -> None:
        self._directory = directory
        self._lock = threading.Lock()
        self._told_run = False

    def follow(self, training_run: Any, command: list[str], waited: bool) -> None:
        """Tell the run once open; an outage once the server has not answered within ``start_wait_s``
        (said on stderr, once: ``waited``, we said it before CMD), or the reason the run will not open."""
        training_run.on_open.append(lambda: self._run_opened(training_run))
        threading.Thread(
            target=self._tell_unopened, args=(training_run, command, waited), name="otel-forge-cmd-notice", daemon=True
        ).start()

    def _tell_unopened(self, training_run: Any, command: list[str], waited: bool) -> None:
        from otel_forge.mlflow.training.job_run import transient_open_error
        from otel_forge.scrub import error_line

        wait_s = training_run.start_wait_s
        if training_run.wait_open(0 if waited else wait_s):
            return
        with self._lock:
            if self._told_run or training_run.open_run is not None:
                return  # open meanwhile, or CMD is done
            error = training_run.open_error
            if error is not None and not transient_open_error(error, training_run.tracking_uri):
                RunNotice(refused=error_line(error)).tell(self._directory)
                return
            # An outage: said once (a refused connection, at once, by on_unanswered; or before CMD), and told.
            if not waited:
                _say_unanswered(training_run, command, TimeoutError(f"no answer within {wait_s:.0f} s"))
            RunNotice(unanswered=f"no answer within {wait_s:.0f} s").tell(self._directory)

    def _run_opened(self, training_run: Any) -> None:
        # "described": whether the run holds CMD's description already; not where we just described
        # it (a new run): CMD's TrainingRun adds its own then, as when handed an open run.
        entry = {**training_run.open_run.entry(), "described": not training_run.described}
        with self._lock:
            if not self._told_run:
                RunNotice(run=entry).tell(self._directory)
                self._told_run = True

    def remove(self) -> None:
        with self._lock:
            self._told_run = True  # nothing more is told: CMD is done
            (self._directory / NOTICE_FILE).unlink(missing_ok=True)


def _ask_server(training_run: Any, command: list[str]) -> None:
    """Before CMD starts, as when the run opens then: the store is made (a local one, once) and a
    server that does not answer is said at once (``start_wait_s``), not at the job's end."""
    import concurrent.futures

    from otel_forge.mlflow.client import Outcome, classify, make_client
    from otel_forge.mlflow.training.rendezvous import find_experiment
    from otel_forge.mlflow.training.run_owner import RunOwner

    owner = RunOwner("otel-forge-ask-server")
    wait_s = training_run.start_wait_s
    try:
        owner.call(lambda: find_experiment(make_client(training_run.tracking_uri), DEFAULT_EXPERIMENT), wait_s)
    except concurrent.futures.TimeoutError:
        _say_unanswered(training_run, command, TimeoutError(f"no answer within {wait_s:.0f} s"))
    except Exception as error:  # noqa: BLE001 - an outage is said; anything else is left to the run's own open
        if classify(error) is Outcome.RETRY:
            _say_unanswered(training_run, command, error)
    finally:
        owner.close()


def _training_run(
    args: argparse.Namespace, command: list[str], config: ForgeConfig, node: NodeIdentity, experiment: str | None
) -> Any:
    from otel_forge.mlflow.training.run_description import source_name
    from otel_forge.mlflow.training.run_metadata import launch_config_path, load_launch_config
    from otel_forge.mlflow.training.training_run import TrainingRun

    launch_file = launch_config_path(["otel-forge", *command])
    tags = {
        SOURCE_NAME_TAG: scrub(source_name(command) or command[0]),
        **_tags(args.tag),
        "otel_forge.command": scrub(" ".join(command)),
    }
    training_run = TrainingRun(
        config=load_launch_config(launch_file) if launch_file else None,
        tracking_uri=config.tracking_uri,
        experiment=args.experiment or experiment,
        run_name=args.run_name,
        run_id=config.run_id,
        description=args.description,
        tags=tags,
        system_metrics=False,
        launch_argv=["otel-forge", *command],
        forge_config=config,
        node=node,
        handle_sigterm=False,
        create_if_missing=args.create_if_missing,
        deliver_here=True,  # we outlive CMD: our journal, and CMD's, are delivered from here
    )
    if problem := local_store_problem(training_run.tracking_uri):
        raise ConfigError(f"invalid tracking_uri (from {config.source('tracking_uri')}): {problem}")
    return training_run


def _cmd_journals(training_run: Any, spool: Path) -> Any:
    """CMD's TrainingRuns journal into the job's directory; we deliver them, whatever becomes of CMD."""
    from otel_forge.mlflow.training.job_journals import JobJournals

    journals = JobJournals(spool, training_run.tracking_uri, training_run.forge_config, lambda: training_run.run_id)
    return journals.start(own=training_run.journal_directory)


def job_spool_dir(config: ForgeConfig) -> Path:
    """This job's directory in the spool root: one place, and one replay, for all it keeps."""
    root = spool_root(config.spool_dir)
    return root / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _say_unanswered(training_run: Any, command: list[str], error: BaseException) -> None:
    """The one line an unreachable server costs: what happens, where it is kept, how to deliver it."""
    from otel_forge.mlflow.client import unanswered_reason

    spool = training_run.forge_config.spool_dir
    if os.environ.get(TOLD_SPOOL_ENV) == str(Path(spool)):
        return  # said when the server was first asked
    told_spool(Path(spool))
    print(
        f"otel-forge: MLflow at {uri_without_credentials(training_run.tracking_uri)} does not answer: "
        f"{unanswered_reason(error)}; {scrub(' '.join(command[:2]))} runs, everything is kept in {spool}, "
        f"otel-forge replay {spool} delivers it",
        file=sys.stderr,
        flush=True,
    )


def _say_nothing_delivered(training_run: Any, spool: Path) -> None:
    """The job's last line when its run never opened: what waits, where, and the command that delivers it."""
    from otel_forge.mlflow.replay import kept_in

    values, windows = kept_in(spool)
    print(
        f"otel-forge: nothing reached MLflow at {uri_without_credentials(training_run.tracking_uri)}: {values} "
        f"value(s) and {windows} system-metrics window(s) are kept in {spool}; otel-forge replay {spool} delivers them",
        file=sys.stderr,
        flush=True,
    )


def _end_before_cmd(training_run: Any, sampling: _NodeSampling, status: str) -> None:
    sampling.stop()
    training_run.close(status)
    remove_if_empty(Path(training_run.forge_config.spool_dir))


def _cmd_environ(
    environ: dict[str, str],
    training_run: Any,
    node: NodeIdentity,
    live: bool,
    script: Any,
    at_once: bool,
) -> dict[str, str]:
    """CMD's environment: the run (or how to find it once open) and who samples its node."""
    # Never another store behind the user's back: CMD talks to ours, whether the run is open or not,
    # and keeps what it cannot deliver beside what we keep.
    env = {
        **environ,
        env_name("tracking_uri"): training_run.tracking_uri,
        env_name("spool_dir"): training_run.forge_config.spool_dir,
        JOURNALS_DELIVERED_BY_ENV: str(os.getpid()),
    }
    if told := os.environ.get(TOLD_SPOOL_ENV):
        env[TOLD_SPOOL_ENV] = told
    if live or training_run.open_error is None:
        # The user's MLFLOW_RUN_ID is the run we opened (resumed); nothing else may stand for it.
        env.pop(env_name("run_id"), None)
    if script is not None:
        handed = LaunchedRun(
            RunSource(RunOrigin.SCRIPT),
            tracking_uri=training_run.tracking_uri,
            job_key=script.key,
            sampled_node=node.sampling_key,
            directory=str(script.directory),
        )
    elif live:
        handed = _launched_run(training_run, node)
    elif at_once:
        handed = LaunchedRun(
            RunSource(RunOrigin.LAUNCHER),
            tracking_uri=training_run.tracking_uri,
            experiment=training_run.experiment,
            sampled_node=node.sampling_key,  # we sample the node once the run opens
        )
    elif training_run.open_error is None:
        handed = _pending_run(training_run, node)
    else:
        return env
    env.update(handed.environ())
    _stand_down_mlflow_sampler(env, handed)
    return env


def _end(
    training_run: Any,
    status: str,
    watchdog: Watchdog | None,
    stopping: threading.Thread | None = None,
    worker: str | None = None,
) -> None:
    training_run.close(status, worker=worker)
    if stopping is not None:
        stopping.join(training_run.forge_config.close_deadline_s(training_run.plan.node.node_count))
    if watchdog is None:
        return
    if training_run.ended:
        watchdog.disarm()
    else:
        watchdog.hand_over(status, worker)


def _launched_run(training_run: Any, node: NodeIdentity) -> LaunchedRun:
    """The open run: CMD's first MLflow run resumes it, its TrainingRun logs into it, and this node
    is sampled by this process or its sibling task's otel-forge."""
    entry = training_run.tracking_entry() or {}
    return LaunchedRun(
        RunSource(RunOrigin.LAUNCHER, training_run.run_id, adds_description=training_run.described),
        tracking_uri=training_run.tracking_uri,
        experiment_id=training_run.experiment_id,
        experiment=entry.get("experiment"),
        sampled_node=node.sampling_key,
        last_step=training_run.open_run.last_step if training_run.open_run is not None else None,
    )


def _stand_down_mlflow_sampler(env: dict[str, str], handed: LaunchedRun) -> None:
    """One sampler per node: MLflow's own (``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``) would sample the
    node a second time into the same run."""
    from otel_forge.mlflow.system_metrics.one_sampler import mlflow_sampling_enabled

    if not mlflow_sampling_enabled(env):
        return
    env[MLFLOW_SYSTEM_METRICS_VAR] = "false"
    run = handed.run_id or "(when it opens)"
    print(
        f"otel-forge: MLflow's own system-metrics logging ({MLFLOW_SYSTEM_METRICS_VAR}) is off in CMD: "
        f"otel-forge samples this node into run {run}",
        file=sys.stderr,
        flush=True,
    )


class _RunWatchdog:
    """The run's watchdog, started when the run is open (at once, or once it opens late), never
    after the job's end began: one started then would outlive us and end the run KILLED."""

    def __init__(self, make: Callable[[], Watchdog]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._watchdog: Watchdog | None = None
        self._finished = False

    def start(self) -> None:
        with self._lock:
            if not self._finished and self._watchdog is None:
                self._watchdog = self._make()

    def finish(self) -> Watchdog | None:
        with self._lock:
            self._finished = True
            return self._watchdog


class _NodeSampling:
    """The node's agent (None on a local rank that does not sample), started before CMD or once CMD
    runs: CMD's pid roots its process tree, its windows go to the run once the run is open, whichever
    of the three comes first."""

    def __init__(self) -> None:
        self.monitor: Any = None
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._run: Any = None  # the TrainingRun, once its run is open

    def start(self, monitor: Any) -> None:
        with self._lock:
            self.monitor = monitor
            if monitor is not None and self._pid is not None:
                monitor.follow_process(self._pid)
            if monitor is not None and self._run is not None:
                self._attach(self._run)

    def start_after_cmd(self, make: Callable[[], Any]) -> None:
        """Start it now, CMD running: a port taken since our look before CMD is said, and CMD trains on."""
        try:
            self.start(make())
        except EndpointError as error:
            print(f"otel-forge: error: {error}; the node is not sampled", file=sys.stderr, flush=True)

    def cmd_started(self, pid: int) -> None:
        with self._lock:
            self._pid = pid
            if self.monitor is not None:
                self.monitor.follow_process(pid)

    def run_opened(self, training_run: Any) -> None:
        uri = uri_without_credentials(training_run.tracking_uri)
        run = training_run.open_run
        with self._lock:
            # On stderr, as all of otel-forge run's lines: CMD's stdout is the job's output (a pipe, a file).
            print(f"otel-forge: run {run.run_id} in experiment {run.experiment} at {uri}", file=sys.stderr, flush=True)
            self._run = training_run
            if self.monitor is not None:
                self._attach(training_run)

    def _attach(self, training_run: Any) -> None:
        known = RunInfo(training_run.experiment_id, training_run.run_name or "", training_run.experiment)
        self.monitor.attach(training_run.run_id, known)
        print(f"otel-forge: serving {self.monitor.mlflow_endpoint}", file=sys.stderr, flush=True)

    def read_afresh(self, collector: str) -> None:
        """The agent's next collect reads ``collector`` again, however recent its last read."""
        agent = self.monitor.agent if self.monitor is not None else None
        if agent is not None and agent.instruments is not None and (cache := agent.instruments.caches.get(collector)):
            cache.expire()

    def stop(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()


def _pending_run(training_run: Any, node: NodeIdentity) -> LaunchedRun:
    """The server did not answer in time: CMD starts, and finds the run once it opens, by its id
    when one was given, else by a job key under which we publish the run we open.

    Without an id, the runs MLflow starts in CMD are not the job's run (CMD starts before its id
    exists; they land in its experiment); with one, CMD's first run resumes it as under an open run.
    """
    if (run_id := training_run.requested_run_id) is not None:
        return LaunchedRun(RunSource(RunOrigin.LAUNCHER, run_id), tracking_uri=training_run.tracking_uri)
    key = training_run.node.job_key
    if key is None:
        key = f"otel-forge-{uuid.uuid4().hex}"
        training_run.adopt_job_key(key, "otel-forge run (the server did not answer in time)")
    waits_for = "the tracking server answers" if node.is_global_zero else "the job's rank 0 opens it"
    _logger.log(
        kept_notice_level(Path(training_run.forge_config.spool_dir)),
        "MLflow: the run is not open yet; CMD starts now and finds it by job key %s once %s",
        key,
        waits_for,
    )
    return LaunchedRun(
        RunSource(RunOrigin.LAUNCHER),
        tracking_uri=training_run.tracking_uri,
        experiment=training_run.experiment,
        job_key=key,
        sampled_node=node.sampling_key,  # we sample the node once the run opens
    )


def progress_board(config: ForgeConfig, node: NodeIdentity, spool: Path) -> Path | None:
    """Where CMD's ranks on this node write their progress: one directory per job and node, which every
    task of the job on the node finds (srun starts one ``otel-forge run`` per rank); None: not followed."""
    if not config.progress:
        return None
    if node.job_key is None:
        return spool / "progress"
    from otel_forge.mlflow.keys import key_segment

    return spool.parent / f"progress-{key_segment(node.job_key)}-{key_segment(node.node_id or node.hostname)}"


def bootstrap_environ(environ: dict[str, str], board: Path | None) -> dict[str, str]:
    """CMD's Python processes start with our bootstrap (``bootstrap/sitecustomize.py``): the rank hook,
    given a board, and MLflow's import waiting for a run still opening."""
    bootstrap = str(Path(__file__).parent / "bootstrap")
    path = os.pathsep.join(p for p in (bootstrap, environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, **({PROGRESS_BOARD_ENV: str(board)} if board is not None else {})}


def _training_watch(config: ForgeConfig, node: NodeIdentity, board: Path, training_run: Any) -> Any:
    from otel_forge.cli.training_watch import RunNotes, TrainingWatch
    from otel_forge.mlflow.training.run_journal import Record

    def record(kind: str, payload: object) -> None:
        if not training_run.record(Record(kind, payload)):
            _logger.info("the run's %s come from the node of the job's global rank 0", kind)

    notes = RunNotes(
        tags=lambda tags: record("tags", tags),
        text=lambda name, data: record("text", {"name": name, "data": data}),
        table=lambda name, data: record("dict", {"name": name, "data": data}),
    )
    return TrainingWatch(board, config, node.hostname, notes, lambda line: print(line, file=sys.stderr, flush=True))


def _start_system_metrics(config: ForgeConfig, tracking_uri: str, node: NodeIdentity, watch: Any = None) -> Any:
    from otel_forge.collectors.progress import ProgressCollector, gpus_from
    from otel_forge.mlflow.system_metrics.monitor import SystemMetricsMonitor

    if not node.runs_agent:
        _logger.info("local rank %s: local rank 0 samples node %s", node.local_rank, node.node_id or "-")
        return None
    # The process trees are empty until CMD runs (``follow_process``).
    pending = dataclasses.replace(config.replace(run_id=None, tracking_uri=tracking_uri), pid=PID_NOT_STARTED)
    progress = []
    if watch is not None:
        gpus = gpus_from(lambda: _gpu_readings(monitor))
        progress.append(ProgressCollector(watch.latest, config, node.hostname, gpus, watch.energy))
    monitor = SystemMetricsMonitor(pending, node=node, run_pending=True, extra_collectors=progress)
    monitor.start()
    for endpoint in [*(monitor.agent.endpoints if monitor.agent is not None else ()), *monitor.received_endpoints]:
        print(f"otel-forge: serving {endpoint}", file=sys.stderr, flush=True)
    if not config.source("collectors").is_default:
        for name, reason in monitor.absent_collectors.items():
            if name in config.collectors:
                print(f"otel-forge: collector {name} absent: {reason}", file=sys.stderr, flush=True)
    return monitor


def _gpu_readings(monitor: Any) -> list[Any]:
    """The GPU collectors' latest readings (cached: the progress figures read no GPU themselves)."""
    instruments = monitor.agent.instruments if monitor.agent is not None else None
    caches = instruments.caches if instruments is not None else {}
    return [cache.snapshot().readings for name, cache in caches.items() if name in ("nvidia", "amd")]


class SignalForwarder:
    """Records SIGINT/SIGTERM from the start, and passes SIGTERM on to CMD once it runs.

    SIGINT is not passed on: CMD is in our process group, so a Ctrl-C at the terminal reaches it
    directly, and forwarding would interrupt it a second time, during its own cleanup (the rule
    `uv run` follows too). ``kill -INT`` of otel-forge alone therefore leaves CMD running.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self._child: subprocess.Popen | None = None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def forward_to(self, child: subprocess.Popen) -> None:
        self._child = child
        if signal.SIGTERM in self.received:  # arrived while CMD was starting
            child.send_signal(signal.SIGTERM)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        child = self._child
        if child is None or child.poll() is not None:
            return
        if signum != signal.SIGINT:
            child.send_signal(signum)
