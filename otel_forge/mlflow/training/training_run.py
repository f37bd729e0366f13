"""``TrainingRun``: the MLflow run of a training job, which never stalls the training loop and loses
nothing when the training process dies.

A facade over objects with one role each: what was asked for (``RunPlan``), the opener of the run
(``RunOpener``, on a thread of its own), the journal (``RunJournal``: ``log()`` checks its values and
appends them, nothing else), and the journal's delivery in another process (``CompanionProcess``,
or ``otel-forge run``'s own process). Constructing one does no I/O; the first ``log()``, ``start()``
or ``with`` begins the run.
"""

from __future__ import annotations

import json
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
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.fluent_runs import forget_fluent_run
from otel_forge.mlflow.keys import key_segment
from otel_forge.mlflow.spool_files import spool_root
from otel_forge.mlflow.system_metrics.one_sampler import stand_down_mlflow_sampler
from otel_forge.mlflow.training.companion import CompanionProcess
from otel_forge.mlflow.training.exit_handlers import ExitHandlers
from otel_forge.mlflow.training.job_run import MissingRun
from otel_forge.mlflow.training.journal_delivery import CURSOR_FILE, JournalDelivery
from otel_forge.mlflow.training.launched_run import make_process_run
from otel_forge.mlflow.training.metric_values import MetricChecker, checked_step
from otel_forge.mlflow.training.outcome import end_run
from otel_forge.mlflow.training.run_description import RunDescription
from otel_forge.mlflow.training.run_journal import Record, RunJournal
from otel_forge.mlflow.training.run_opener import OpenerState, RunOpener
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.training.run_plan import DEFAULT_EXPERIMENT, RunPlan, embedded_tracking_uri
from otel_forge.node import NodeIdentity
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import SecretKeys, error_line, uri_without_credentials

_logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_EXPERIMENT", "MissingRun", "TrainingRun", "embedded_tracking_uri"]


class TrainingRun:
    """The MLflow run of a training job: ``log``, ``register_checkpoint``, ``close``.

    Run the same code in every rank. Global rank 0 creates the run (or resumes the one its job key
    names) and logs; every other process finds the run, and local rank 0 of every node samples its
    node into it. Any process that fails ends the run FAILED. Nothing is raised into training.
    ``deliver_here``: this process delivers its journal itself (``otel-forge run``, which outlives CMD).
    """

    def __init__(
        self,
        config: Any = None,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        run_id: str | None = None,
        description: str | None = None,
        tags: Mapping[str, str] | None = None,
        system_metrics: bool = True,
        register_checkpoints: bool = False,
        launch_argv: Sequence[str] | None = None,
        forge_config: ForgeConfig | None = None,
        node: NodeIdentity | None = None,
        init_deadline_s: float = 60.0,
        end_deadline_s: float = 60.0,
        handle_sigterm: bool = True,
        create_if_missing: bool = False,
        deliver_here: bool = False,
    ) -> None:
        forge_config = forge_config or ForgeConfig.resolve()
        plan = RunPlan.resolve(
            forge_config, tracking_uri=tracking_uri, experiment=experiment, run_name=run_name, run_id=run_id,
            node=node, system_metrics=system_metrics, register_checkpoints=register_checkpoints,
            create_if_missing=create_if_missing, deadlines=(init_deadline_s, end_deadline_s),
        )  # fmt: skip
        self.config = config
        self.launch_argv = list(sys.argv if launch_argv is None else launch_argv)
        self._warnings = RateLimitedLogger(_logger)
        secret = SecretKeys(forge_config.secret_keys)
        self._description = RunDescription(config, description, dict(tags or {}), self.launch_argv, secret, self._warnings)
        self._opener = RunOpener(plan, lambda key: (self._description.default_run_name(), self._description.creation_tags(key)))
        self._opener.before_open.append(self._describe)
        self._opener.on_open.append(self._opened)
        self._opener.on_fail.append(lambda error: self._journal and self._journal.disabled(error_line(error)))
        self._checker = MetricChecker(self._warnings)
        self._journal: RunJournal | None = None
        self._companion: CompanionProcess | None = None
        self._here: tuple[JournalDelivery, threading.Thread] | None = None
        self._deliver_here = deliver_here
        self._pid = os.getpid()  # a forked child (a DataLoader worker) logs and ends nothing
        self._lock = threading.Lock()  # begin and close; never held across the journal's I/O
        self._closed = False
        self._restore_environ: Callable[[], None] | None = None
        self._checkpoints: set[int] = set()  # steps journaled
        self._model_ids: dict[int, str] = {}  # their models, once the delivery has registered them
        self._exit_handlers = ExitHandlers(self.close, handle_sigterm)
        self.described = False
        self.ended = False  # the run's end reached the server (as far as this process knows)
        self.on_open: list[Callable[[], None]] = []  # called on the opener's thread once the run is open

    # --- what the run is (no I/O) -----------------------------------------------------------

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
    run_id = property(lambda self: self._opener.run.run_id if self._opener.run else None)
    experiment_id = property(lambda self: self._opener.run.experiment_id if self._opener.run else None)

    @property
    def journal_directory(self) -> Path | None:
        return self._journal.directory if self._journal is not None else None

    def tracking_entry(self) -> dict[str, str] | None:
        """``{backend, run_id, experiment, tracking_uri}`` without credentials; None unless live."""
        run = self._opener.run
        if run is None or self._closed:
            return None
        uri = uri_without_credentials(self.tracking_uri)
        return {"backend": "mlflow", "run_id": run.run_id, "experiment": run.experiment, "tracking_uri": uri}

    # --- opening ------------------------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> bool:
        """Open (or resume) the run now, waiting at most ``timeout_s`` (default: the init deadline),
        or until the server fails to answer once; True when it is live. Not live yet: it goes on
        opening in the background."""
        self._begin()
        return self._opener.wait(self.plan.init_deadline_s if timeout_s is None else timeout_s)

    def take_rank_zero(self) -> None:
        """This process turned out to hold global rank 0 (known once the launcher's rendezvous is
        done): it makes the job's run, unless one is published by now."""
        self._opener.take_rank_zero()

    def adopt_job_key(self, key: str, source: str) -> None:
        """Find or make the run by ``key`` from the next attempt on (one the caller shares)."""
        self._opener.adopt_job_key(key, source)
        if self._journal is not None:
            self._journal.plan(self._plan_entry())

    def _begin(self) -> None:
        with self._lock:
            if self._opener.state is not OpenerState.IDLE or self._closed:
                return
            plan = self.plan
            if plan.owns_run:
                self._journal = self._new_journal()
            self._opener.begin()
            self._start_delivery()
            self._exit_handlers.install()

    def _new_journal(self) -> RunJournal | None:
        root = spool_root(self.plan.forge_config.spool_dir)
        try:
            journal = RunJournal.create(root, uri_without_credentials(self.tracking_uri), self._deliver_here)
        except OSError as error:
            _logger.warning(
                "MLflow logging disabled: the run's journal cannot be written in %s (%s); set "
                "OTEL_FORGE_SPOOL_DIR to a directory of your own", root, error.strerror or error
            )  # fmt: skip
            return None
        journal.plan(self._plan_entry())
        return journal

    def _plan_entry(self) -> dict[str, Any]:
        plan = self.plan
        return plan.journal_entry(self._description.default_run_name(), self._description.own_tags())

    def _describe(self) -> None:
        """On the opener's thread, before the run is asked for: what a new run records, for whichever
        process opens it (this one, or the delivery, if this one dies first)."""
        if self._journal is not None:
            records = [[r.kind, r.payload] for r in self._description.records(self.node)]
            self._journal.describe({"creation_tags": self._description.creation_tags(self.node.job_key), "records": records})

    def _start_delivery(self) -> None:
        plan = self.plan
        journal = self._journal.directory if self._journal is not None and not plan.delivered_by_launcher else None
        if journal is not None and self._deliver_here:
            delivery = JournalDelivery(journal, tracking_uri=plan.tracking_uri, flush_interval_s=plan.forge_config.flush_interval_s)
            self._here = (delivery, threading.Thread(target=delivery.run, name="otel-forge-journal", daemon=True))
            self._here[1].start()
            journal = None
        sample = plan.system_metrics and plan.node.runs_agent and not plan.node_sampled_by_launcher
        sample = sample and bool(plan.owns_run or plan.requested_run_id or plan.node.job_key)
        if not (sample or journal):
            return
        config = plan.forge_config.replace(run_id=None, tracking_uri=plan.tracking_uri)
        try:
            self._companion = CompanionProcess(config, plan.node, sample=sample, journal=journal, tracking_uri=plan.tracking_uri).start()
        except Exception as error:  # noqa: BLE001 - the journal stays for `otel-forge replay`
            _logger.warning("the otel-forge companion did not start: %s", error_line(error))

    def _opened(self, run: OpenRun) -> None:
        """On the opener's thread: the process's MLflow calls (HF's callback, autolog) open this run."""
        plan = self.plan
        self._restore_environ = make_process_run(run.run_id)
        if plan.system_metrics:
            stand_down_mlflow_sampler(run.run_id)
        self.described = plan.owns_run and (plan.describe_launched or not run.described)
        if self._journal is not None:
            known = {k: getattr(run, k) for k in ("run_id", "run_name", "experiment_id", "experiment", "resumed", "last_step")}
            self._journal.opened({**known, "describe": self.described})
            if plan.launched and plan.run_name and run.run_name != plan.run_name:
                self._journal.record(Record("run_name", plan.run_name))  # as mlflow.start_run(run_name=) would
                run.run_name = plan.run_name
        if self._companion is not None:
            self._companion.attach(run.run_id, RunInfo(run.experiment_id, run.run_name or "", run.experiment))
        for callback in self.on_open:
            callback()

    # --- the training loop's calls: a check and an append, never a wait ------------------------

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Journal ``metrics`` at ``step`` and return. Steps a resumed run has are skipped."""
        if self._journal is None:
            if self._closed or not self.plan.owns_run or forked_from(self._pid):
                return
            self._begin()
            if self._journal is None:
                return
        elif self._closed or forked_from(self._pid):
            return
        if (checked := checked_step(step)) is None:
            self._checker.reject(len(metrics), "step %r is not an integer from 0 to 2**63-1", step)
        elif values := self._checker.values(metrics):
            self._journal.metrics(values, checked, int(time.time() * 1000))  # type: ignore[union-attr]

    def checkpoint_model_name(self, step: int) -> str:
        run = self._opener.run
        return f"{key_segment((run.run_name or run.run_id) if run else (self.run_name or 'run'))}-step-{step}"

    def checkpoint_fields(self, step: int) -> dict[str, str] | None:
        """The model name of the checkpoint at ``step``, and its id once registered (no server call)."""
        if not self.plan.register_checkpoints or self.tracking_entry() is None:
            return None
        if step not in self._model_ids and self._journal is not None:
            self._read_registered()
        fields = {"model_name": self.checkpoint_model_name(step)}
        return fields | ({"model_id": self._model_ids[step]} if step in self._model_ids else {})

    def _read_registered(self) -> None:
        try:
            models = json.loads((self._journal.directory / CURSOR_FILE).read_text())["models"]  # type: ignore[union-attr]
        except (OSError, ValueError, KeyError):
            return
        self._model_ids.update({int(step): model_id for step, model_id in models.items()})

    def register_checkpoint(self, step: int, directory: str | os.PathLike[str]) -> None:
        """Register a committed checkpoint directory as an external logged model, by the delivery."""
        plan = self.plan
        if not plan.register_checkpoints or self._closed or not plan.owns_run or forked_from(self._pid):
            return
        self._begin()
        if self._journal is not None and step not in self._checkpoints:
            self._checkpoints.add(step)
            self._journal.checkpoint(step, str(Path(directory).absolute()), self.checkpoint_model_name(step))

    # --- ending -------------------------------------------------------------------------------

    def close(self, status: str = "FINISHED") -> None:
        """Journal the run's end and hand it to its delivery; bounded whatever the server does
        (the drain deadline, and the close of the run's opening). Idempotent."""
        if forked_from(self._pid):
            return  # a forked child's copy (a DataLoader worker leaving the block): the parent ends it
        with self._lock:
            if self._closed or self._opener.state is OpenerState.IDLE:
                self._closed = True
                return
            self._closed = True
        self._exit_handlers.remove()
        self._leave_process()
        drain_s = self.forge_config.drain_deadline_s
        self._opener.close(min(drain_s, 1.0) if self._opener.state is OpenerState.UNANSWERED else drain_s)
        if self._journal is not None:
            # Not closed: a signal handler may close the run inside an append of the same thread.
            self._journal.end(status, self._checker.rejected)
        if self._here is not None:
            self._here[0].finish(drain_s)
            self._here[1].join()
            self.ended = self._here[0].ended is not None
        if self._companion is not None:
            self._companion.stop()
            self.ended = self._journal is not None and not self._journal.directory.exists()
        if self._journal is None:
            self._end_here(status)
        self._checker.say_total()

    def _end_here(self, status: str) -> None:
        """A rank that journals nothing ends its part of the run itself (its outcome, if it failed)."""
        run, owner = self._opener.run, self._opener.owner
        if run is None or owner is None:
            return
        try:
            owner.call(lambda: end_run(run.client, run.run_id, run.experiment_id, status, self.node), self.plan.end_deadline_s)
            self.ended = True
        except Exception as error:  # noqa: BLE001 - the run end is best effort too
            _logger.warning("MLflow: ending run %s as %s failed: %s", run.run_id, status, error_line(error))

    def _leave_process(self) -> None:
        """The process's MLflow calls no longer open this run, and MLflow does not end it at exit."""
        if self._restore_environ is not None:
            self._restore_environ()
        run = self._opener.run
        if run is not None and self.plan.owns_run and run.run_id != self._opener.script_run_id:
            forget_fluent_run(run.run_id)

    def __enter__(self) -> TrainingRun:
        """Open the run: every rank finds it and its node is sampled. Rank 0 waits for it a while
        (``start_wait_s``), so that the run a framework opens inside the block is this one."""
        if self.plan.owns_run and not self.plan.launcher_opens and self.forge_config.start_wait_s > 0:
            self.start(self.start_wait_s)
        else:
            self._begin()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, error: BaseException | None, *rest: object) -> None:
        if exc_type is None or (issubclass(exc_type, SystemExit) and getattr(error, "code", 1) in (0, None)):
            self.close("FINISHED")
        else:
            self.close("KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED")

