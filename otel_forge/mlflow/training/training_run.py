"""``TrainingRun``: the MLflow run of a training job, which never stalls the loop and loses nothing when
the training process dies. A facade over one object per role: ``RunPlan`` (what was asked for),
``RunOpener`` (on a thread of its own), ``RunRecorder`` (the journal ``log()`` appends to) and
``RunDelivery`` (the journal delivered by another process). No I/O before ``log()``, ``start()`` or ``with``."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_forge.config import ForgeConfig
from otel_forge.forking import forked_from
from otel_forge.mlflow.fluent_runs import fluent_run_id
from otel_forge.mlflow.spool_files import spool_root
from otel_forge.mlflow.training import description_gate
from otel_forge.mlflow.training.exit_handlers import ExitHandlers, exit_status
from otel_forge.mlflow.training.job_run import MissingRun
from otel_forge.mlflow.training.launched_run import expect_process_run, launcher_notice_directory
from otel_forge.mlflow.training.metric_values import MetricChecker, checked_step
from otel_forge.mlflow.training.run_delivery import RunDelivery
from otel_forge.mlflow.training.run_description import RunDescription
from otel_forge.mlflow.training.run_journal import Record, RunEnd
from otel_forge.mlflow.training.run_opener import CompanionOpens, RunOpener, claim_or_adopt
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.training.run_plan import DEFAULT_EXPERIMENT, RunPlan, embedded_tracking_uri
from otel_forge.mlflow.training.run_recorder import RunRecorder, checkpoint_model_name
from otel_forge.mlflow.training.run_source import RunOrigin
from otel_forge.mlflow.training.run_state import CLOSED_STATES, RunEvent, RunState, RunStateMachine
from otel_forge.mlflow.training.script_run import LAUNCHER, ScriptRun, expect, stop_expecting
from otel_forge.node import NodeIdentity
from otel_forge.progress import rank_hooks
from otel_forge.progress.import_hooks import when_imported
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import SecretKeys, uri_without_credentials

_logger = logging.getLogger(__name__)


__all__ = ["DEFAULT_EXPERIMENT", "MissingRun", "TrainingRun", "embedded_tracking_uri"]


class TrainingRun:
    """The MLflow run of a training job: ``log``, ``register_checkpoint``, ``close``.

    Run the same code in every rank. Global rank 0 creates the run (or resumes the one its job key
    names) and logs; local rank 0 of every node finds the run and samples its node into it; the other
    ranks find it only when asked (``start()``) or should they fail: any process that fails ends the
    run FAILED. Nothing is raised into training.
    ``deliver_here``: this process delivers its journal itself (``otel-forge run``, which outlives CMD).
    """

    def __init__(
        self, config: Any = None, tracking_uri: str | None = None, experiment: str | None = None,
        run_name: str | None = None, run_id: str | None = None, description: str | None = None,
        tags: Mapping[str, str] | None = None, system_metrics: bool = True, register_checkpoints: bool = False,
        launch_argv: Sequence[str] | None = None, forge_config: ForgeConfig | None = None,
        node: NodeIdentity | None = None, init_deadline_s: float = 60.0, end_deadline_s: float = 60.0,
        handle_sigterm: bool = True, create_if_missing: bool = False, deliver_here: bool = False,
    ) -> None:  # fmt: skip
        forge_config = forge_config or ForgeConfig.resolve()
        plan = RunPlan.resolve(
            forge_config, tracking_uri=tracking_uri, experiment=experiment, run_name=run_name, run_id=run_id,
            node=node, system_metrics=system_metrics, register_checkpoints=register_checkpoints,
            create_if_missing=create_if_missing, deadlines=(init_deadline_s, end_deadline_s),
        )  # fmt: skip
        self.config = config
        argv = list(sys.argv if launch_argv is None else launch_argv)
        warnings = RateLimitedLogger(_logger)
        secret = SecretKeys(forge_config.secret_keys)
        self._description = RunDescription(config, description, dict(tags or {}), argv, secret, warnings)
        self._machine = RunStateMachine()  # the run's one state: idle, waiting for the script, opening, ...
        self._opener = RunOpener(plan, self._description.new_run, self._machine)
        self._opener.on_open.append(self._opened)
        self._checker = MetricChecker(warnings)
        self._recorder: RunRecorder | None = None  # the journal's writer, in the process that owns the run
        self._delivery: RunDelivery | None = None
        self._deliver_here = deliver_here
        self._pid = os.getpid()  # a forked child (a DataLoader worker) logs and ends nothing
        self._lock = threading.Lock()  # begin and close; never held across the journal's I/O
        self._script: ScriptRun | None = None  # the job's record where the script names the experiment
        self._exit_handlers = ExitHandlers(self.close, handle_sigterm)
        self.described = False
        self.ended = False  # the run's end reached the server (as far as this process knows)
        self.on_open: list[Callable[[], None]] = []  # called on the opener's thread once the run is open
        self._deferred = False  # the block began before the run opened: what needs the run waits for it
        self._stop_expecting: Callable[[], None] = lambda: None  # job_run_id() waits for our run until called

    plan = property(lambda self: self._opener.plan)
    forge_config = property(lambda self: self.plan.forge_config)
    tracking_uri = property(lambda self: self.plan.tracking_uri)
    experiment = property(lambda self: self.plan.experiment)
    run_name = property(lambda self: self.plan.run_name)
    requested_run_id = property(lambda self: self.plan.requested_run_id)
    node = property(lambda self: self.plan.node)
    start_wait_s = property(lambda self: self.plan.start_wait_s)
    open_error = property(lambda self: self._opener.error)
    on_unanswered = property(lambda self: self._opener.on_unanswered)
    rejected = property(lambda self: self._checker.rejected)
    open_run = property(lambda self: self._opener.run)

    @property
    def run_id(self) -> str | None:
        """The run's id; None until it is open (asked for, it waits for a run the block began without)."""
        run = self._awaited_run()
        return run.run_id if run else None

    @property
    def experiment_id(self) -> str | None:
        run = self._awaited_run()
        return run.experiment_id if run else None

    journal_directory = property(lambda self: self._recorder.directory if self._recorder else None)

    def _awaited_run(self) -> OpenRun | None:
        """The open run. Where the block began without waiting for it, asking for it waits for it
        (``start_wait_s``, on the main thread), as MLflow's import in the block does."""
        if self._deferred and threading.current_thread() is threading.main_thread():
            self._wait_for_run()
        return self._opener.run

    def tracking_entry(self) -> dict[str, str] | None:
        """``{backend, run_id, experiment, tracking_uri}`` without credentials; None unless live."""
        run = self._awaited_run()
        if run is None or self._machine.closed:
            return None
        uri = uri_without_credentials(self.tracking_uri)
        return {"backend": "mlflow", "run_id": run.run_id, "experiment": run.experiment, "tracking_uri": uri}

    def begin(self) -> None:
        """Open (or resume) the run in the background, from now on."""
        self._begin()

    def start(self, timeout_s: float | None = None) -> bool:
        """Open (or resume) the run now, waiting at most ``timeout_s`` (default: the init deadline),
        or until the server fails to answer once; True when it is live (else it goes on opening)."""
        self._begin()
        return self._opener.wait(self.plan.init_deadline_s if timeout_s is None else timeout_s)

    def take_rank_zero(self) -> None:
        """This process turned out to hold global rank 0 (known once the launcher's rendezvous is done)."""
        self._opener.take_rank_zero()

    def open_script_run(self, script: ScriptRun) -> None:
        """Open the job's run where the script names the experiment (``otel-forge run``): the one the
        script's process claimed and publishes, else this process claims it, in our experiment."""
        with self._lock:
            self._script = script
        self._begin()

    def wait_open(self, timeout_s: float) -> bool:
        """Wait for the run a while, silently (the job's end says what did not reach it)."""
        return self._opener.wait(timeout_s, say_late=False)

    def adopt_job_key(self, key: str, source: str) -> None:
        """Find or make the run by ``key`` from the next attempt on (one the caller shares)."""
        self._opener.adopt_job_key(key, source)
        if self._recorder is not None:
            self._recorder.plan(self.plan)

    def _begin(self) -> None:
        with self._lock:
            if self._machine.state is not RunState.IDLE:
                return
            script_run_id = fluent_run_id()
            if self.plan.owns_run:
                self._opener.key_the_run(script_run_id)
                self._recorder = recorder = self._new_recorder(script_run_id)
                self._opener.before_open.append(lambda: recorder.describe(self.plan))
                self._opener.on_fail.append(recorder.disabled)
            script_origin = self.plan.source.origin is RunOrigin.SCRIPT
            if script_origin and script_run_id is None and (key := self.plan.node.job_key):
                self._script = ScriptRun(spool_root(self.forge_config.spool_dir), key)
            if self._script is not None and self.plan.source.waits_for_script and self.plan.owns_run:
                self._wait_for_script(self._script)
            else:
                self._open(self._script)
            self._delivery = RunDelivery(self.plan, self.journal_directory, self._deliver_here)
            self._delivery.start()
            self._exit_handlers.install()

    def _new_recorder(self, script_run_id: str | None) -> RunRecorder:
        """The journal; where the companion can open the run from it, the plan leaves it to the
        companion (``delivery_opens``): this process then imports no MLflow and connects to nothing."""
        # (A run the script may name is left to the companion, or not, once the script has had its say.)
        if self.plan.source.origin is not RunOrigin.SCRIPT and self._companion_opens(script_run_id):
            self._opener.plan = dataclasses.replace(self.plan, delivery_opens=True)
        recorder = RunRecorder(self.plan, self._description, self._deliver_here)
        if self.plan.delivery_opens and recorder.directory is None:
            self._opener.plan = dataclasses.replace(self.plan, delivery_opens=False)  # no journal to open it from
        elif self.plan.delivery_opens and recorder.directory is not None:
            self._opener.companion = CompanionOpens(recorder.directory, self._companion_delivers)
        elif (directory := self._launcher_tells()) is not None:
            self._opener.companion = CompanionOpens(directory, lambda: True, launcher=True)
        return recorder

    def _launcher_tells(self) -> Path | None:
        """Where ``otel-forge run``, still opening the job's run as it started this process, tells it
        (``RunNotice``): to rank 0, whose journal it delivers; None elsewhere."""
        plan = self.plan
        if plan.owns_run and plan.source.launcher_opens and plan.delivered_by_launcher:
            return launcher_notice_directory()
        return None

    def _companion_opens(self, script_run_id: str | None) -> bool:
        """A companion delivers our journal, and the run is one it can open as we would: given by id, the
        job key's, new, or the script's that this process claimed. A process that has imported MLflow
        already opens it itself (at once)."""
        plan = self.plan
        return (
            not self._deliver_here
            and not plan.delivered_by_launcher
            and plan.source.origin is not RunOrigin.LAUNCHER  # its rank 0 finds the launcher's run
            and script_run_id is None
            and "mlflow" not in sys.modules
        )

    def _companion_delivers(self) -> bool | None:
        return None if (delivery := self._delivery) is None else delivery.delivers_journal()

    def _wait_for_script(self, script: ScriptRun) -> None:
        """The script may name the experiment yet: the run opens at its first MLflow run, at our first
        value (or when the run is asked for), else after ``experiment_wait_s``."""
        self._machine.fire(RunEvent.WAIT_FOR_SCRIPT)
        expect(script, self._open_waiting)
        threading.Thread(target=self._script_deadline, name="otel-forge-script-wait", daemon=True).start()

    def _script_deadline(self) -> None:
        if not self._machine.wait_while(RunState.WAITING_FOR_SCRIPT, self.forge_config.experiment_wait_s):
            self._open_waiting()

    def _open_waiting(self) -> None:
        with self._lock:
            if self._machine.state is not RunState.WAITING_FOR_SCRIPT:
                return
            stop_expecting(self._open_waiting)
            self._open(self._script)

    def _open(self, script: ScriptRun | None) -> None:
        """Open the run; where the script names the experiment, the first process to claim the run
        opens it and publishes it, the others adopt it."""
        if script is not None:
            claimer = LAUNCHER if self._deliver_here else "TrainingRun"
            plan = claim_or_adopt(script, self.plan, claimer, self._opener)
            if (directory := self.journal_directory) is not None and self._companion_opens(fluent_run_id()):
                plan = dataclasses.replace(plan, delivery_opens=True)
                self._opener.companion = CompanionOpens(directory, self._companion_delivers)
            if plan != self.plan:
                self._opener.plan = plan
                if self._recorder is not None:
                    self._recorder.plan(plan)
        self._opener.begin()

    def _opened(self, run: OpenRun) -> None:
        plan = self.plan
        self.described = plan.owns_run and (plan.source.adds_description or not run.described)
        if self._recorder is not None:
            handed = plan.source.origin is RunOrigin.LAUNCHER  # (the run the launcher opens, or opened)
            self._recorder.opened(run, self.described, plan.run_name if handed else None)
        with self._lock:  # a run handed to this rank opens at once: _begin makes the delivery meanwhile
            delivery = self._delivery
        if delivery is not None:
            delivery.attach(run)
        for callback in self.on_open:
            callback()

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Journal ``metrics`` at ``step`` and return: a check and an append, never a wait."""
        # The recorder's journal, once begun: what log() appends to (None where it could not be made).
        if (journal := self._recorder.journal if self._recorder else None) is None:
            if self._machine.closed or not self.plan.owns_run or forked_from(self._pid):
                return
            self._begin()
            if (journal := self._recorder.journal if self._recorder else None) is None:
                if self._recorder is not None:  # the journal could not be made: counted, as a full disk's are
                    self._checker.lose(len(metrics), self._recorder.unwritable or "no journal")
                return
        elif self._machine.closed or forked_from(self._pid):
            return
        if self._machine.state is RunState.WAITING_FOR_SCRIPT:
            self._open_waiting()  # a value before the script named an experiment: its default it is
        if (checked := checked_step(step)) is None:
            self._checker.reject(len(metrics), "step %r is not an integer from 0 to 2**63-1", step)
        elif values := self._checker.values(metrics):
            rank_hooks.logged(checked)
            try:
                journal.metrics(values, checked, int(time.time() * 1000))
            except (OSError, ValueError) as error:  # a full or failing disk: the values are lost, never the training
                self._checker.lose(len(values), getattr(error, "strerror", None) or str(error))

    def record(self, record: Record) -> bool:
        """Journal a record (tags, a text or dict artifact) into the run, from the process that owns it;
        False where this process does not own the run or has no journal."""
        if self._machine.closed or not self.plan.owns_run or forked_from(self._pid):
            return False
        self._begin()
        journal = self._recorder.journal if self._recorder else None
        if journal is None:
            return False
        journal.record(record)
        return True

    def checkpoint_model_name(self, step: int) -> str:
        return checkpoint_model_name(self._opener.run, self.run_name, step)

    def checkpoint_fields(self, step: int) -> dict[str, str] | None:
        """The model name of the checkpoint at ``step``, and its id once registered (no server call)."""
        if not self.plan.register_checkpoints or self.tracking_entry() is None or self._recorder is None:
            return None
        model_id = self._recorder.model_id(step)
        return {"model_name": self.checkpoint_model_name(step), **({"model_id": model_id} if model_id else {})}

    def register_checkpoint(self, step: int, directory: str | os.PathLike[str]) -> None:
        """Register a committed checkpoint directory as an external logged model, by the delivery."""
        plan = self.plan
        if not plan.register_checkpoints or self._machine.closed or not plan.owns_run or forked_from(self._pid):
            return
        self._begin()
        if self._machine.state is RunState.WAITING_FOR_SCRIPT:
            self._open_waiting()
        if self._recorder is not None:
            with rank_hooks.checkpointing():
                self._recorder.checkpoint(step, Path(directory), self.checkpoint_model_name(step))

    def close(self, status: str = "FINISHED", *, worker: str | None = None) -> None:
        """Journal the run's end and hand it to its delivery, bounded whatever the server does. Idempotent.
        ``worker``: this process ran a launcher, and that worker ended the job (``outcome.end_run``)."""
        if forked_from(self._pid):
            return  # a forked child's copy (a DataLoader worker leaving the block): the parent ends it
        if self._machine.state is RunState.IDLE and self._exit_handlers.installed and status != "FINISHED":
            self._begin()  # a rank that needs the run only to end it: it fails, so it finds the run now
            self.wait_open(self.plan.end_deadline_s)
        if self._machine.state is RunState.WAITING_FOR_SCRIPT:
            self._open_waiting()  # the script named none: the run's end goes to the default experiment
        with self._lock:
            before = self._machine.fire(RunEvent.CLOSE)
        if before is RunState.IDLE:
            self._exit_handlers.remove()  # never begun (a rank that needed the run only had it failed)
            return
        if before in CLOSED_STATES:
            return  # closed already
        try:
            self._end(status, worker, unanswered=before is RunState.UNANSWERED)
        finally:
            self._machine.fire(RunEvent.CLOSED)

    def _end(self, status: str, worker: str | None, unanswered: bool) -> None:
        self._exit_handlers.remove()
        self._opener.leave_process()
        drain_s = self.forge_config.close_deadline_s(self.plan.node.node_count)
        self._opener.close(min(drain_s, 1.0) if unanswered else drain_s, unanswered)
        recorder = self._recorder if self._recorder and self._recorder.journal else None
        end = recorder.end(self.plan, RunEnd(status, self._checker.rejected, worker)) if recorder else None
        self.ended = self._delivery.finish(end) if self._delivery is not None else False
        if recorder is None:  # no journal (a read-only spool): the tag the last line names is set here
            self.ended = self._opener.end_here(status, self._checker.rejected)
        self._checker.say_total()
        if self._script is not None and self.plan.owns_run and not self.plan.delivered_by_launcher:
            self._script.remove()  # ours alone (`otel-forge run` reads its own, and removes it)
        description_gate.release(self.journal_directory)

    def __enter__(self) -> TrainingRun:
        """Open the run: every rank finds it and its node is sampled. Rank 0 waits for it a while
        (``start_wait_s``), so that the run a framework opens inside the block is this one; until its
        description is in, this process's MLflow calls wait for it (``description_gate``). Where its
        companion opens the run and MLflow is not imported, the block begins at once, and what needs
        the run waits for it instead: MLflow's import, ``job_run_id()``, ``run_id``. Where
        nothing names the experiment, the run opens later, in the experiment the script names
        (``_wait_for_script``): the run a framework opens in the block is the job's. A rank that neither
        logs nor samples its node, handed no run, finds the run only should it fail."""
        told = self._launcher_tells() is not None
        if self.plan.owns_run and (told or not self.plan.source.launcher_opens) and self.forge_config.start_wait_s > 0:
            self._begin()
            if (self.plan.delivery_opens or told) and "mlflow" not in sys.modules:
                # No MLflow run can open in this process before MLflow is imported: the block begins
                # now, and MLflow's import (the script's, a framework's) waits for the run instead.
                self._deferred, self._stop_expecting = True, expect_process_run(self._wait_for_run)
                when_imported("mlflow", lambda _: self._wait_for_run())
            else:
                self._wait_for_run()
        elif self.plan.needs_run_only_to_end_it:
            self._exit_handlers.install()  # the run is found should this rank fail (close() does)
        else:
            self._begin()
        return self

    def _wait_for_run(self) -> None:
        """Wait for the run a while (``start_wait_s``), then for its description (``description_gate``)."""
        waited_until = time.monotonic() + self.start_wait_s
        opened = not self._machine.closed and self.start(self.start_wait_s)
        if opened and self.described and (journal := self.journal_directory) is not None:
            description_gate.hold_or_wait(journal, waited_until, self.tracking_uri)
        if self._deferred:
            self._deferred = False
            self._stop_expecting()

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, *rest: object) -> None:
        if exc_type is None or issubclass(exc_type, SystemExit):
            self.close(exit_status(getattr(error, "code", None)))
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")
