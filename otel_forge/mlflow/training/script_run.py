"""The job's run where the script names its experiment: who opens it and which run it is, in files
every process of a single-node job shares, by the job key.

Nothing outside the script named an experiment (no ``--experiment``, no ``MLFLOW_EXPERIMENT_NAME``
or ``_ID``), and MLflow cannot move a run to another experiment: the job's run opens only once the
script names one. The first process to *claim* the run opens it (the script's first MLflow run,
seen by ``run_context``; a ``TrainingRun`` naming its experiment, or at its first value; else, after
``experiment_wait_s``, whoever waited), and *publishes* it; the others adopt the published run. The
claim names the experiment before any server answers, so a replay opens the run where the script
would have.

Files, in ``otel-forge run``'s job directory (or the spool root, for a job without it):
``script-run-<key>.claim`` (made with O_EXCL: one winner), ``script-run-<key>.json`` (the run),
``script-run-<key>.mlflow-<pid>`` (a process of the command imported MLflow: it may start a run at any
moment, so ``otel-forge run`` does not open one in the default experiment behind its back).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.config import LAUNCHED_RUN_ENV, env_name
from otel_forge.mlflow.fluent_runs import fluent_ended_run_ids, fluent_run, fluent_run_id
from otel_forge.mlflow.spool_files import make_spool_dir, spool_root, write_atomically
from otel_forge.mlflow.training.launched_run import (
    LaunchedRun,
    await_launched_run,
    launched_run_id,
    wait_for_process_run,
)
from otel_forge.private_dirs import open_private_file

_logger = logging.getLogger(__name__)

_POLL_S = 0.05
_CREATED_WITHIN_S = 120.0  # a script's start_run that has not made its run by then failed
_ASKED_WAIT_S = 30.0  # for the run job_run_id() asked for
LAUNCHER = "otel-forge run"  # a claim by this name asks the launcher to open the run


@dataclass(frozen=True)
class PublishedRun:
    run_id: str
    experiment_id: str | None
    experiment: str | None  # by name

    @classmethod
    def of(cls, run: Any) -> PublishedRun:
        """An ``OpenRun``'s."""
        return cls(run.run_id, run.experiment_id, run.experiment)


@dataclass(frozen=True)
class ScriptRun:
    """The record of one job's run in ``directory``, by the job's ``key``."""

    directory: Path
    key: str

    def entry(self) -> dict[str, str]:
        """The record as a journal's plan keeps it (the process that delivers the journal adopts it too)."""
        return {"directory": str(self.directory), "key": self.key}

    @classmethod
    def from_entry(cls, entry: dict[str, str]) -> ScriptRun:
        return cls(Path(entry["directory"]), entry["key"])

    def _path(self, suffix: str) -> Path:
        # A key is the user's (a SLURM job id, a torchrun rendezvous id): a file name of its own.
        readable = re.sub(r"[^A-Za-z0-9_.-]", "_", self.key)[:64]
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:12]
        return self.directory / f"script-run-{readable}-{digest}{suffix}"

    def claim(self, experiment: str | None, by: str) -> bool:
        """Whether ``by`` opens the job's run (the first to ask), in ``experiment`` (None: MLflow's
        choice, a script's own run)."""
        make_spool_dir(self.directory)
        try:
            fd = open_private_file(self._path(".claim"), os.O_WRONLY | os.O_EXCL)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as file:
            json.dump({"experiment": experiment, "by": by, "pid": os.getpid()}, file)
        return True

    def claimed_experiment(self) -> str | None:
        """The experiment the claim names (None: MLflow's choice, or no claim)."""
        return (self.claimed() or {}).get("experiment")

    def claimed_by(self) -> str | None:
        return (self.claimed() or {}).get("by")

    def abandoned(self) -> bool:
        """Claimed by a process that ended without publishing the run (the server never answered it,
        or it was killed): the claim's experiment stands, and whoever comes next opens the run there."""
        return self.claimed() is not None and self.given_up()

    def awaited(self) -> bool:
        """Claimed by a process that still runs and has not published the run yet: wait for it."""
        return self.published() is None and self.claimer_running()

    def given_up(self) -> bool:
        """Unpublished, its claimer gone (ended, killed, or the claim released): nobody publishes it now.
        The claimer is looked at first: one that published as it ended is not taken for one that gave up."""
        return not self.claimer_running() and self.published() is None

    def claimer_running(self) -> bool:
        """The process that claimed the run still runs (it logs into the run beside its adopters)."""
        import psutil

        claim = self.claimed()
        return claim is not None and psutil.pid_exists(int(claim.get("pid", 0)))

    def release(self) -> None:
        """The claimed run was never made (the script's start_run failed): another may claim it."""
        with contextlib.suppress(OSError):
            self._path(".claim").unlink()

    def claimed(self) -> dict[str, Any] | None:
        """Who claimed the run and for which experiment; None before anyone has (or while the claim
        is being written)."""
        return _read(self._path(".claim"))

    def publish(self, run: PublishedRun) -> None:
        write_atomically(self._path(".json"), json.dumps(run.__dict__))

    def published(self) -> PublishedRun | None:
        record = _read(self._path(".json"))
        return PublishedRun(**record) if record else None

    def wait_published(self, timeout_s: float) -> PublishedRun | None:
        deadline = time.monotonic() + timeout_s
        while (run := self.published()) is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return run

    def ask(self) -> None:
        """A process of the command needs the run now (``job_run_id()``): the launcher opens it."""
        make_spool_dir(self.directory)
        os.close(open_private_file(self._path(".asked"), os.O_WRONLY))

    def asked(self) -> bool:
        return self._path(".asked").exists()

    def mark_mlflow_imported(self) -> None:
        make_spool_dir(self.directory)
        os.close(open_private_file(self._path(f".mlflow-{os.getpid()}"), os.O_WRONLY))

    def mlflow_imported(self) -> bool:
        return any(self.directory.glob(self._path(".mlflow-*").name))

    def remove(self) -> None:
        for path in self.directory.glob(self._path("*").name):
            with contextlib.suppress(OSError):
                path.unlink()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


# --- this process's part ---------------------------------------------------------------------

_expecting: list[Callable[[], None]] = []  # opens a TrainingRun of this process that waits for the script
_local: ScriptRun | None = None  # the record of a TrainingRun here (no `otel-forge run` above us)
_lock = threading.Lock()


def current() -> ScriptRun | None:
    """The record of this process's job while its script may still name the experiment: handed by
    ``otel-forge run``, or made by a ``TrainingRun`` of this process that names none."""
    if _local is not None:
        return _local
    launched = LaunchedRun.from_environ()
    if launched is None or not launched.script_opens or launched.job_key is None:
        return None
    return ScriptRun(spool_root(launched.directory), launched.job_key)


def expect(record: ScriptRun, open_now: Callable[[], None]) -> None:
    """A ``TrainingRun`` of this process waits for the script to name the experiment; ``open_now``
    opens it (it adopts the job's run where another claimed it)."""
    global _local
    with _lock:
        _local = _local or record
        _expecting.append(open_now)


def stop_expecting(open_now: Callable[[], None]) -> None:
    global _local
    with _lock:
        with contextlib.suppress(ValueError):
            _expecting.remove(open_now)
        if not _expecting:
            _local = None


def job_run_id() -> str | None:
    """The job's run, for a framework given it by id (Lightning's ``MLFlowLogger(run_id=...)``); None
    outside one. Where the script has not named the experiment yet, asking opens the run now: by a
    ``TrainingRun`` of this process, else by ``otel-forge run``, in its default experiment."""
    if (run_id := launched_run_id()) is not None:
        return run_id
    wait_for_process_run()  # a TrainingRun of ours, whose companion opens the run, makes it ours
    if (run_id := launched_run_id() or await_launched_run()) is not None:
        return run_id
    if (record := current()) is None:
        return None
    waiting: list[Callable[[], None]] = []
    if (published := record.published()) is None:
        with _lock:
            waiting = list(_expecting)
        for open_now in waiting:
            open_now()
        if not waiting:
            record.ask()
        published = record.wait_published(_ASKED_WAIT_S)
    if published is not None and not waiting:
        take_published(published)
    return published.run_id if published is not None else None


def take_published(run: PublishedRun) -> None:
    """The job's run is ``run``: a ``TrainingRun`` waiting here adopts it (and makes it the process's
    run while it lasts), else this process's next MLflow runs resume or nest under it, as under a
    launched run."""
    with _lock:
        waiting = list(_expecting)
    if not waiting:
        os.environ[LAUNCHED_RUN_ENV] = run.run_id
        if fluent_run_id() is None:
            os.environ.setdefault(env_name("run_id"), run.run_id)
    for open_now in waiting:
        open_now()


def publish_once_created(record: ScriptRun, made: Callable[[], PublishedRun | None]) -> None:
    """The script is making the job's run: publish it once ``made`` returns it (no hook runs after
    MLflow makes a run: ``start_run`` leaves it on MLflow's active-run stack). A script that ends at
    once publishes it on its way out."""
    lock, done = threading.Lock(), threading.Event()

    def publish_if_made() -> bool:
        with lock:
            if done.is_set():
                return True
            if (run := made()) is None:
                return False
            done.set()
        record.publish(run)
        _logger.info("MLflow: the script's run %s is the job's run", run.run_id)
        take_published(run)
        return True

    def watch() -> None:
        deadline = time.monotonic() + _CREATED_WITHIN_S
        while not publish_if_made():
            if time.monotonic() >= deadline:
                done.set()
                record.release()
                return
            time.sleep(_POLL_S / 5)

    atexit.register(publish_if_made)
    threading.Thread(target=watch, name="otel-forge-script-run", daemon=True).start()


def fluent_run_made() -> PublishedRun | None:
    """The run the script's ``start_run`` made: the active one, or the one it ended already."""
    if (active := fluent_run()) is not None:
        return PublishedRun(active.info.run_id, active.info.experiment_id, None)
    ended = fluent_ended_run_ids()
    return PublishedRun(next(iter(ended)), None, None) if ended else None
