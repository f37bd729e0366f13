"""What ``otel-forge run`` hands its command, and what a ``TrainingRun`` makes its process's run:
written and read here only, as one typed record.

The run is handed as MLflow hands a run to a command itself (``mlflow run``): ``MLFLOW_RUN_ID``, so
the first run the command opens, whatever opens it (``mlflow.log_metric``, ``mlflow.start_run()``,
HF's ``MLflowCallback``, a flavour's autolog), resumes it and logs beside ``system/...``. MLflow
consumes that variable at that first ``start_run``; ``OTEL_FORGE_LAUNCHED_RUN_ID`` stays, so the
runs opened after it nest under it (``run_context``), and the command's ``TrainingRun`` finds it.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.config import (
    DESCRIBE_RUN_ENV,
    LAUNCHED_LAST_STEP_ENV,
    LAUNCHED_RUN_ENV,
    LAUNCHER_OPENS,
    SAMPLED_NODE_ENV,
    SCRIPT_OPENS,
    env_name,
)
from otel_forge.mlflow.fluent_runs import fluent_run_id
from otel_forge.mlflow.training.run_notice import RunNotice
from otel_forge.mlflow.training.run_source import RunOrigin, RunSource

_NOTICE_POLL_S = 0.05


@dataclass(frozen=True)
class LaunchedRun:
    """The job's run as a parent process hands it to its command: its ``source`` (LAUNCHER with the
    run's id, LAUNCHER without one while the launcher is still opening it: the command finds it by
    ``job_key`` in ``experiment``; or SCRIPT: nothing outside the command named the experiment, so
    the command's first run is the job's), and where it is."""

    source: RunSource
    tracking_uri: str | None = None
    experiment_id: str | None = None
    experiment: str | None = None  # by name (or an id, while none is known yet)
    job_key: str | None = None
    sampled_node: str | None = None  # NodeIdentity.sampling_key of the node the launcher samples
    # where the job's processes share files: the launcher's job directory (its ``RunNotice`` while pending)
    directory: str | None = None
    last_step: int | None = None  # the run's last training step when the launcher opened it

    @property
    def run_id(self) -> str | None:
        return self.source.run_id

    @property
    def pending(self) -> bool:
        return self.source.launcher_opens

    @property
    def script_opens(self) -> bool:
        return self.source.origin is RunOrigin.SCRIPT

    @property
    def described(self) -> bool:
        """The launcher recorded config, git and command just now: the command adds its own."""
        return self.source.adds_description

    def environ(self) -> dict[str, str]:
        """The variables the command inherits."""
        env = {LAUNCHED_RUN_ENV: self.run_id or (SCRIPT_OPENS if self.script_opens else LAUNCHER_OPENS)}
        if self.run_id is not None:
            env[env_name("run_id")] = self.run_id
        if self.tracking_uri is not None:
            env[env_name("tracking_uri")] = self.tracking_uri
        if self.experiment_id is not None:
            env[env_name("experiment_id")] = self.experiment_id
        if self.experiment is not None and not self.experiment.isdigit():
            # HF's callback sets this experiment before it resumes the run: it must be the run's.
            env[env_name("experiment_name")] = self.experiment
        elif self.experiment is not None and self.experiment_id is None:
            env[env_name("experiment_id")] = self.experiment
        if self.job_key is not None:
            env[env_name("job_id")] = self.job_key
        if self.sampled_node is not None:
            env[SAMPLED_NODE_ENV] = self.sampled_node
        if self.described and self.run_id is not None:
            env[DESCRIBE_RUN_ENV] = self.run_id
        if self.directory is not None:
            env[env_name("spool_dir")] = self.directory
        if self.last_step is not None and self.run_id is not None:
            env[LAUNCHED_LAST_STEP_ENV] = str(self.last_step)
        return env

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> LaunchedRun | None:
        """The run this process was handed; None outside ``otel-forge run`` (or a ``TrainingRun``)."""
        environ = os.environ if environ is None else environ
        handed = environ.get(LAUNCHED_RUN_ENV, "").strip()
        if not handed:
            return None
        run_id = None if handed in (LAUNCHER_OPENS, SCRIPT_OPENS) else handed
        origin = RunOrigin.SCRIPT if handed == SCRIPT_OPENS else RunOrigin.LAUNCHER
        described = run_id is not None and environ.get(DESCRIBE_RUN_ENV) == run_id
        last_step = environ.get(LAUNCHED_LAST_STEP_ENV, "")
        return cls(
            source=RunSource(origin, run_id, adds_description=described),
            tracking_uri=environ.get(env_name("tracking_uri")),
            experiment_id=environ.get(env_name("experiment_id")),
            job_key=environ.get(env_name("job_id")),
            sampled_node=environ.get(SAMPLED_NODE_ENV),
            directory=environ.get(env_name("spool_dir")),
            last_step=int(last_step) if run_id is not None and last_step.isdigit() else None,
        )

    def opened(self, run: Mapping[str, Any]) -> LaunchedRun:
        """This pending run, once the launcher opened it: ``run`` as its notice tells it (``described``:
        the run holds the command's description already; else the command adds its own)."""
        return dataclasses.replace(
            self,
            source=RunSource(RunOrigin.LAUNCHER, run["run_id"], adds_description=not run.get("described")),
            experiment_id=run.get("experiment_id"),
            experiment=run.get("experiment") or self.experiment,
            last_step=run.get("last_step"),
        )


def launcher_notice_directory(environ: Mapping[str, str] | None = None) -> Path | None:
    """Where the launcher tells the run it is still opening (``RunNotice``); None where none is pending."""
    launched = LaunchedRun.from_environ(environ)
    if launched is None or not launched.pending or not launched.directory:
        return None
    return Path(launched.directory)


def take_launched_run(run: Mapping[str, Any], environ: MutableMapping[str, str] | None = None) -> str:
    """The run the launcher opened after this process started, handed as it is handed at a start: the
    next ``mlflow.start_run()`` resumes it (unless the process started one meanwhile: it nests then)."""
    environ = os.environ if environ is None else environ
    launched = LaunchedRun.from_environ(environ) or LaunchedRun(RunSource(RunOrigin.LAUNCHER))
    handed = launched.opened(run).environ()
    if fluent_run_id() is not None:
        handed.pop(env_name("run_id"), None)
    environ.update(handed)
    return str(run["run_id"])


def await_launched_run() -> str | None:
    """The job's run, where the launcher opens it as this process runs: its notice, waited for a little
    longer than ``start_wait_s`` (the launcher tells an outage within it). None while it is not open (an
    outage: the runs this process opens are its own then)."""
    if (directory := launcher_notice_directory()) is None:
        return launched_run_id()
    deadline = time.monotonic() + _notice_wait_s()
    while True:
        notice = RunNotice.read(directory)
        if notice is not None and notice.run is not None:
            return take_launched_run(notice.run)
        if notice is not None or time.monotonic() >= deadline:
            return None
        time.sleep(_NOTICE_POLL_S)


def await_launched_run_at_mlflow_import() -> None:
    """Where the launcher is still opening the job's run: MLflow's import in this process waits for it,
    so the first run the process opens (HF's callback, ``mlflow.start_run()``) is the job's.
    ``otel-forge run``'s bootstrap calls this in every Python process of its command."""
    if launcher_notice_directory() is not None:
        from otel_forge.progress.import_hooks import when_imported

        when_imported("mlflow", _await_at_import)


def _await_at_import(_mlflow: object) -> None:
    await_launched_run()


def _notice_wait_s() -> float:
    from otel_forge.config import ConfigError, ForgeConfig

    try:
        wait_s = ForgeConfig.resolve().start_wait_s
    except ConfigError:
        wait_s = ForgeConfig.defaults().start_wait_s  # the process's own TrainingRun says what is wrong
    return wait_s + 1.0  # the launcher's own wait, and its write


def launched_run_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The job's run handed to this process; None outside one or while it is still opening."""
    launched = LaunchedRun.from_environ(environ)
    return launched.run_id if launched is not None else None


_opening: list[Callable[[], None]] = []  # each waits, bounded, for a run this process's TrainingRun opens


def expect_process_run(wait: Callable[[], None]) -> Callable[[], None]:
    """A ``TrainingRun`` of this process opens, in the background, the run it will make the process's:
    ``wait_for_process_run`` calls ``wait`` until the returned function is called."""
    _opening.append(wait)
    return lambda: _opening.remove(wait) if wait in _opening else None


def wait_for_process_run() -> None:
    """Wait for the runs this process's ``TrainingRun``s are opening (``job_run_id`` asks for one)."""
    for wait in list(_opening):
        wait()


def make_process_run(run_id: str, environ: MutableMapping[str, str] | None = None) -> Callable[[], None]:
    """Make ``run_id`` the run this process's MLflow calls open: the next ``mlflow.start_run()``
    with none active (a plain ``mlflow.log_metric``, HF's callback, autolog) resumes it, the ones
    after nest under it. Returns what puts the variables back as they were.

    ``MLFLOW_RUN_ID`` is set only while no MLflow run was started in this process: after one, the
    next ``start_run`` nests rather than resumes, as under ``otel-forge run``.
    """
    environ = os.environ if environ is None else environ
    wanted = {LAUNCHED_RUN_ENV: run_id}
    if fluent_run_id() is None:
        wanted[env_name("run_id")] = run_id
    before = {name: environ.get(name) for name in wanted}
    for name, value in wanted.items():
        environ.setdefault(name, value)

    def restore() -> None:
        for name, value in before.items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value

    return restore
