"""``RunOpener``: finds or makes the job's run on its own thread (``RunOwner``), once, however long the
server takes, and says what it found in the journal. It moves the run's ``RunStateMachine``."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.config import TOLD_SPOOL_ENV
from otel_forge.mlflow.client import lazy_client, make_client, open_failure
from otel_forge.mlflow.fluent_runs import fluent_run_id, forget_fluent_run
from otel_forge.mlflow.server_probe import ServerRefused, check_connects
from otel_forge.mlflow.spool_files import kept_notice_level, spool_root
from otel_forge.mlflow.system_metrics.one_sampler import stand_down_mlflow_sampler
from otel_forge.mlflow.training.job_run import JobRunFinder, JobRunRequest, transient_open_error
from otel_forge.mlflow.training.launched_run import LaunchedRun, make_process_run, take_launched_run
from otel_forge.mlflow.training.outcome import end_run
from otel_forge.mlflow.training.run_notice import RunNotice
from otel_forge.mlflow.training.run_owner import OpenRun, RunOwner
from otel_forge.mlflow.training.run_plan import RunPlan
from otel_forge.mlflow.training.run_source import RunSource
from otel_forge.mlflow.training.run_state import RunEvent, RunState, RunStateMachine
from otel_forge.mlflow.training.script_run import PublishedRun, ScriptRun
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import error_line, uri_without_credentials

_logger = logging.getLogger(__name__)

_FIRST_OPEN_RETRY_S, _MAX_OPEN_RETRY_S = 1.0, 10.0
_NOTICE_POLL_S, _OUTAGE_POLL_S = 0.05, 1.0  # how often a process whose companion opens the run looks for its notice
# A companion that has not asked the server by then (its start, MLflow's import) is waited for as one
# that asks: the enter's wait for the run counts from here.
_COMPANION_START_S = 30.0
_DATABRICKS_AUTH_HINT = (
    "Databricks authentication: set DATABRICKS_HOST with DATABRICKS_TOKEN, or a profile in "
    "~/.databrickscfg (DATABRICKS_CONFIG_PROFILE), or OAuth M2M (DATABRICKS_CLIENT_ID and "
    "DATABRICKS_CLIENT_SECRET), or run `databricks auth login`"
)


class OpenedElsewhere(Exception):
    """What the companion that opens the run (``RunPlan.delivery_opens``) told: why it has not yet, or
    will not; or that this process closed before it told anything (it opens the run all the same)."""


@dataclass(frozen=True)
class CompanionOpens:
    """Where the process that opens the run tells it (``RunNotice``), and whether it delivers our journal
    (None: not started yet; False: none will, so we open it): the companion, from our journal's plan
    (the journal's directory); or ``otel-forge run``, which opens the job's run as its command starts
    (its job directory: ``launcher``; it says an outage itself)."""

    directory: Path
    delivers: Callable[[], bool | None]
    launcher: bool = False


class RunOpener:
    """Opens the plan's run once; ``on_open`` callbacks run on the opener's thread."""

    def __init__(
        self,
        plan: RunPlan,
        new_run: Callable[[str | None], tuple[str | None, dict[str, str]]],
        machine: RunStateMachine,
    ) -> None:
        self.plan = plan
        self.machine = machine
        self.run: OpenRun | None = None
        self.error: BaseException | None = None  # why the run did not open, once it did not
        self.before_open: list[Callable[[], None]] = []  # on the opener's thread, before the first try
        self.on_open: list[Callable[[OpenRun], None]] = []
        self.on_fail: list[Callable[[BaseException], None]] = []  # the run is not to be opened
        self.on_unanswered: list[Callable[[BaseException], None]] = []
        self._new_run = new_run
        self._owner: RunOwner | None = None
        self._future: concurrent.futures.Future[OpenRun | None] | None = None
        self._warnings = RateLimitedLogger(_logger)
        self.script_run_id: str | None = None  # the MLflow run the script had open when we began
        self._restore_environ: Callable[[], None] | None = None
        self.companion: CompanionOpens | None = None  # where the plan leaves the open to the companion

    @property
    def owner(self) -> RunOwner | None:
        return self._owner

    def begin(self) -> None:
        """Open the run from now on (from idle, or once the script's wait is over)."""
        if self.machine.state not in (RunState.IDLE, RunState.WAITING_FOR_SCRIPT):
            return
        if self.plan.source.run_id is None and not self.plan.source.launcher_opens:
            # `with mlflow.start_run(): with TrainingRun(): ...`: the script's run is the job's; it ends it.
            self.script_run_id = fluent_run_id()
            if self.script_run_id is not None:
                self.plan = dataclasses.replace(self.plan, source=RunSource.given(self.script_run_id))
        self.machine.fire(RunEvent.BEGIN)
        if os.environ.get(TOLD_SPOOL_ENV):
            # `otel-forge run` found the server down before starting us, and said so: nobody waits.
            self.machine.fire(RunEvent.UNANSWERED)
        self._owner = RunOwner("mlflow-run-owner")
        self._future = self._owner.submit(self._open)

    def submit(self, task: Callable[[], Any]) -> None:
        """Run ``task`` on the opener's thread, after the open (or at once if it is done)."""
        if self._owner is not None:
            self._owner.submit(task)

    def wait(self, timeout_s: float, say_late: bool = True) -> bool:
        """Wait for the server's answer, at most ``timeout_s`` once MLflow is asked (importing it is
        not counted), or until it fails once; True when the run is open."""
        if self._future is not None and not self.machine.wait_answer(timeout_s) and say_late:
            self._warnings.warning(
                "open", "MLflow: the run did not open within %.0f s; it goes on opening in the background", timeout_s
            )
        return self.run is not None

    def take_rank_zero(self) -> None:
        if self.run is None and not self.machine.left:
            self.plan = dataclasses.replace(self.plan, node=dataclasses.replace(self.plan.node, rank=0))
            self.machine.fire(RunEvent.RANK_ZERO)

    def adopt_job_key(self, key: str, source: str) -> None:
        node = dataclasses.replace(self.plan.node, job_key=key, job_key_source=source)
        self.plan = dataclasses.replace(self.plan, node=node)

    def key_the_run(self, script_run_id: str | None) -> None:
        """A run found by nothing else gets a job key: should it open only after the job (by its
        journal's delivery or a replay), the node's windows find it by the key."""
        plan = self.plan
        if not (plan.source.run_id or plan.source.launcher_opens or plan.node.job_key or script_run_id):
            self.adopt_job_key(f"otel-forge-{uuid.uuid4().hex}", "TrainingRun")

    def close(self, timeout_s: float, unanswered: bool) -> None:
        """The run is closing (``RunEvent.CLOSE`` fired): a server that had not answered gets one last
        attempt, a run being found gets ``timeout_s``; what is journaled waits for the delivery either way."""
        if unanswered and self._refused_now():
            timeout_s = 0.0  # no last attempt can succeed: nothing to wait for
        if self._future is not None:
            concurrent.futures.wait([self._future], timeout=timeout_s)
        self.machine.fire(RunEvent.LEAVE)

    def leave_process(self) -> None:
        """The process's MLflow calls no longer open the run, and MLflow does not end it at exit."""
        if self._restore_environ is not None:
            self._restore_environ()
        if self.run is not None and self.plan.owns_run and self.run.run_id != self.script_run_id:
            forget_fluent_run(self.run.run_id)

    def end_here(self, status: str, rejected: int = 0) -> bool:
        """End this process's part of the run from here (a rank that journals nothing: its outcome; the
        owner whose journal could not be made, with the count of values it lost for the run's tag)."""
        run, owner = self.run, self._owner
        if run is None or owner is None:
            return False
        node = self.plan.node
        try:
            owner.call(
                lambda: end_run(run.client, run.run_id, run.experiment_id, status, node, rejected=rejected),
                self.plan.end_deadline_s,
            )
        except Exception as error:  # noqa: BLE001 - the run end is best effort too
            _logger.warning("MLflow: ending run %s as %s failed: %s", run.run_id, status, error_line(error))
            return False
        return True

    def _open(self) -> OpenRun | None:
        """Find or make the run (explicit id > job key > new). A server that does not answer
        (refused, timed out, 5xx, 429, a refused credential) is retried with backoff until it does
        or the run is closed: the job outlives the server, and the journal keeps what it logs."""
        run = self._given_run() or self._published_run() or self._companions_run() or self._found_run()
        if run is None:
            self.machine.fire(RunEvent.REFUSED)  # no run to attach to (or closed meanwhile)
            return None
        self.run = run
        try:
            self._opened(run)
        finally:
            # Open once what opening it does is done: start() then finds the run described, as it waits.
            self.machine.fire(RunEvent.OPENED)
        return run

    def _given_run(self) -> OpenRun | None:
        """The run of a rank that only attaches to the id it was given (``otel-forge run``'s, or
        ``MLFLOW_RUN_ID``), rank 0 too where ``otel-forge run`` opened it and delivers its journal:
        nothing to ask the server, so no connection and no MLflow import (its client is made at its
        first call: a failed rank's outcome)."""
        plan = self.plan
        if plan.source.run_id is None or plan.adopts is not None:
            return None
        last_step, described = None, False
        if plan.node.is_global_zero:
            launched = LaunchedRun.from_environ()
            if not (plan.source.launched and plan.delivered_by_launcher and launched is not None):
                return None  # rank 0 resumes it; but the launcher's, which the launcher read and delivers to
            # What rank 0's open would read: the launcher read it, and described the run unless it was.
            last_step, described = launched.last_step, True
            self._prepare()  # our description, journaled before the run is: its delivery sends it first
        self.machine.asked()
        client = lazy_client(plan.tracking_uri)
        return OpenRun(
            plan.source.run_id, None, plan.forge_config.experiment_id, plan.experiment, True, last_step, client,
            described=described,
        )  # fmt: skip

    def _published_run(self) -> OpenRun | None:
        """Under ``otel-forge run``, the job's run another process claimed (the launcher, or a process of
        CMD), once published: the launcher delivers our journal into it, so we attach by its id (no MLflow
        here). None where it gave its claim up: the run is found or made here then."""
        plan, adopts = self.plan, self.plan.adopts
        if adopts is None or not plan.delivered_by_launcher:
            return None
        self._prepare()  # our description, journaled first: the launcher's delivery adds it to the run
        while (published := adopts.published()) is None:
            if adopts.given_up():
                return None  # the run is found or made here
            if self.machine.left:
                raise OpenedElsewhere("closed before the job's run was published; its launcher delivers it still")
            self.machine.pause(_NOTICE_POLL_S)
        self.machine.asked()
        experiment = published.experiment or plan.experiment
        # Its claimer logs into it beside us: no step of it is ours already (last_step None).
        return OpenRun(published.run_id, None, published.experiment_id, experiment, True, None,
                       lazy_client(plan.tracking_uri))  # fmt: skip

    def _companions_run(self) -> OpenRun | None:
        """The run the companion (or the launcher) opened, as its notice tells it (no MLflow here); None
        where no companion delivers the journal after all: this process opens the run then."""
        companion = self.companion
        if companion is None or not (self.plan.delivery_opens or companion.launcher):
            return None
        self._prepare()  # the description, which the companion opens the run with
        began, unanswered = time.monotonic(), None
        while True:
            notice = RunNotice.read(companion.directory)
            if notice is not None and notice.run is not None:
                if companion.launcher:  # the process's run from now on, as had it been handed at the start
                    take_launched_run(notice.run)
                return OpenRun.from_entry(
                    notice.run, lazy_client(self.plan.tracking_uri), bool(notice.run.get("described"))
                )
            if companion.launcher or notice is not None or time.monotonic() - began > _COMPANION_START_S:
                self.machine.asked()  # (the launcher asks the server from its start)
            if notice is not None and notice.refused is not None:
                self._fail(OpenedElsewhere(notice.refused))
                raise OpenedElsewhere(notice.refused)
            if notice is not None and notice.unanswered not in (None, unanswered):
                unanswered = notice.unanswered
                if companion.launcher:  # it said so on the job's stderr
                    self.machine.fire(RunEvent.UNANSWERED)
                else:
                    self._unanswered(OpenedElsewhere(unanswered), unanswered)
            if companion.delivers() is False:
                _logger.debug("no companion delivers the journal: the run is opened here")
                return None
            if self.machine.left:
                raise OpenedElsewhere("closed before the companion opened the run; it opens it still")
            # Through an outage (hours, maybe) a look a second: each takes the training's GIL a while.
            self.machine.pause(_OUTAGE_POLL_S if unanswered else _NOTICE_POLL_S)

    def _found_run(self) -> OpenRun | None:
        pause_s = _FIRST_OPEN_RETRY_S
        # Told before the description is made (it imports MLflow: a second or more); the first
        # attempt goes on from this look, the later ones look again.
        connects = not self._refused_now()
        self._prepare()
        finder = self._finder()
        while True:
            try:
                # A server that takes no connection is told at once, not after MLflow's own retries.
                if not connects:
                    check_connects(self.plan.tracking_uri)
                connects = False
                client = make_client(self.plan.tracking_uri)
                self.machine.asked()
                run = finder.open(client)
                if run is None and not self.machine.left and self.plan.node.is_global_zero:
                    run = finder.open(client)  # this process turned out to hold rank 0
                break
            except Exception as error:
                if not self._transient(error):
                    self._fail(error)
                    raise
                if self.machine.left:
                    self.error = error  # closed before the server answered: the delivery opens it
                    raise
                self.machine.pause(pause_s)  # the opener left at close ends the pause: one last attempt
                pause_s = min(pause_s * 2, _MAX_OPEN_RETRY_S)
        return run

    def _prepare(self) -> None:
        """What comes before the first try (the description journaled), whichever way the run opens."""
        for prepare in self.before_open:
            prepare()

    def _opened(self, run: OpenRun) -> None:
        # The process's MLflow calls (HF's callback, autolog, mlflow.log_metric) open this run.
        self._restore_environ = make_process_run(run.run_id)
        if self.plan.system_metrics:
            stand_down_mlflow_sampler(run.run_id)
        _logger.info(
            "MLflow run %s (%s) in experiment %s at %s",
            run.run_id,
            "resumed" if run.resumed else "new",
            run.experiment,
            uri_without_credentials(self.plan.tracking_uri),
        )
        for callback in self.on_open:
            callback(run)

    def _refused_now(self) -> bool:
        """Whether the server takes no connection now; told as an unanswered attempt, if so."""
        try:
            check_connects(self.plan.tracking_uri)
        except ServerRefused as error:
            self._transient(error)
            return True
        return False

    def _finder(self) -> JobRunFinder:
        plan = self.plan
        request = JobRunRequest(
            tracking_uri=plan.tracking_uri,
            experiment=plan.experiment,
            experiment_id=plan.forge_config.experiment_id,
            source=plan.source,
            run_name=plan.run_name,
            samples_node=plan.samples_node,
            late_after_s=plan.init_deadline_s,
            adopts=plan.adopts,
        )
        return JobRunFinder(request, self._new_run, lambda: self.plan.node, self.machine)

    def _transient(self, error: BaseException) -> bool:
        """An outage of a tracking server, worth waiting for; a local store's errors are not."""
        if not transient_open_error(error, self.plan.tracking_uri):
            return False
        self._unanswered(error, open_failure(error, self.plan.experiment))
        return True

    def _unanswered(self, error: BaseException, cause: str) -> None:
        if self.machine.fire(RunEvent.UNANSWERED) is not RunState.OPENING:
            return  # told at the first failure (or closing: said at the end)
        if self.on_unanswered:
            for callback in self.on_unanswered:
                callback(error)
        else:
            self._warnings.log(
                kept_notice_level(spool_root(self.plan.forge_config.spool_dir)),
                "open-retry",
                "MLflow at %s: %s; the run opens when it answers, and everything logged is kept meanwhile",
                uri_without_credentials(self.plan.tracking_uri),
                cause,
            )

    def _fail(self, error: BaseException) -> None:
        self.error = error
        self.machine.fire(RunEvent.REFUSED)
        auth = self.plan.tracking_uri.startswith("databricks") and _auth_error(error)
        _logger.warning(
            "MLflow logging disabled: %s%s", error_line(error), f". {_DATABRICKS_AUTH_HINT}" if auth else ""
        )
        for callback in self.on_fail:
            callback(error)


def claim_or_adopt(script: ScriptRun, plan: RunPlan, claimer: str, opener: RunOpener) -> RunPlan:
    """Where the script names the experiment, the plan to open with: the process that claims the
    job's run first (or takes over a claim its process left unpublished, in the experiment it names)
    opens and publishes it; the others adopt it where its claim says (a replay opens it there too),
    its maker having described it as it saw it, theirs added as to a launched run."""
    if plan.owns_run and script.claim(plan.experiment, claimer):
        opener.on_fail.append(lambda error: script.release())
    elif plan.owns_run and script.abandoned():
        plan = dataclasses.replace(plan, experiment=script.claimed_experiment() or plan.experiment)
    else:
        source = dataclasses.replace(plan.source, adds_description=True)
        experiment = script.claimed_experiment() or plan.experiment
        return dataclasses.replace(plan, experiment=experiment, source=source, adopts=script)
    opener.on_open.append(lambda run: script.publish(PublishedRun.of(run)))
    return plan


def _auth_error(error: BaseException) -> bool:
    text = str(error).lower()
    return any(word in text for word in ("401", "403", "unauthorized", "forbidden", "credential", "auth", "token"))
