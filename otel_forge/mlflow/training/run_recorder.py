"""``RunRecorder``: what a process that owns the run writes into its journal, each an append: the
plan, the description (on the opener's thread), the run once open, values, checkpoints, the end."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from otel_forge.mlflow.keys import key_segment
from otel_forge.mlflow.spool_files import spool_root
from otel_forge.mlflow.training.journal_cursor import registered_models
from otel_forge.mlflow.training.run_description import RunDescription
from otel_forge.mlflow.training.run_journal import Record, RunEnd, RunJournal
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.training.run_plan import RunPlan
from otel_forge.mlflow.training.run_source import RunOrigin
from otel_forge.scrub import error_line, uri_without_credentials

_logger = logging.getLogger(__name__)

_DESCRIBE_WAIT_S = 10.0


class RunRecorder:
    """The journal of ``plan``'s run as this process writes it (``journal`` None: it could not be made)."""

    def __init__(self, plan: RunPlan, description: RunDescription, launcher: bool) -> None:
        self.unwritable: str | None = None  # why there is no journal, where there is none
        self.journal = self._new_journal(plan, launcher)
        self._description = description
        self._checkpoints: set[int] = set()  # steps journaled
        self._model_ids: dict[int, str] = {}  # their models, once the delivery has registered them
        self._describing = threading.Lock()
        self._described = False
        if self.journal is not None:
            self.plan(plan)

    def _new_journal(self, plan: RunPlan, launcher: bool) -> RunJournal | None:
        root = spool_root(plan.forge_config.spool_dir)
        try:
            return RunJournal.create(root, uri_without_credentials(plan.tracking_uri), launcher)
        except OSError as error:
            self.unwritable = f"{root}: {error.strerror or error}"
            _logger.warning(
                "MLflow logging disabled: the run's journal cannot be written in %s (%s); set OTEL_FORGE_SPOOL_DIR "
                "to a directory of your own", root, error.strerror or error
            )  # fmt: skip
            return None

    @property
    def directory(self) -> Path | None:
        return self.journal.directory if self.journal is not None else None

    def plan(self, plan: RunPlan) -> None:
        if self.journal is not None:
            self.journal.plan(plan.journal_entry(self._description.default_run_name(), self._description.own_tags()))

    def describe(self, plan: RunPlan) -> None:
        """What a new run records, for the process that opens it (ours, or the delivery if we die first).
        Once: on the opener's thread, or by the close that comes before it got there (which waits
        a while for one under way: a close may come from a signal handler)."""
        if not self._describing.acquire(timeout=_DESCRIBE_WAIT_S):
            return
        try:
            if self.journal is not None and not self._described:
                # MLflow's context tags are for a run this process may make (it imports MLflow for them);
                # not one its companion opens, its launcher's, or one it adopts.
                resolve_context = not (
                    plan.delivery_opens or plan.source.origin is RunOrigin.LAUNCHER or plan.adopts is not None
                )
                self.journal.describe(self._description.journal_entry(plan.node, resolve_context))
            self._described = True
        finally:
            self._describing.release()

    def end(self, plan: RunPlan, end: RunEnd) -> RunEnd | None:
        """Journal the run's end, described first (a short job's end may come before its opener
        described it); the end where the journal could not keep it (a full disk, a signal inside an
        append of ours), for the delivery to take from this process."""
        self.describe(plan)
        journaled = self.journal is not None and self.journal.end(end.status, end.rejected, end.worker)
        return None if journaled else end

    def disabled(self, error: BaseException) -> None:
        if self.journal is not None:
            self.journal.disabled(error_line(error))

    def opened(self, run: OpenRun, describe: bool, run_name: str | None) -> None:
        """The run is open; ``run_name``: the name the script gives a run handed to it."""
        if self.journal is None:
            return
        self.journal.opened({**run.entry(), "describe": describe})
        if run_name and run.run_name != run_name:
            self.journal.record(Record("run_name", run_name))  # as mlflow.start_run(run_name=) would
            run.run_name = run_name

    def checkpoint(self, step: int, directory: Path, model_name: str) -> None:
        if self.journal is not None and step not in self._checkpoints:
            self._checkpoints.add(step)
            self.journal.checkpoint(step, str(directory.absolute()), model_name)

    def model_id(self, step: int) -> str | None:
        """The checkpoint's model, once the delivery registered it (read from its cursor, no server call)."""
        if step not in self._model_ids and self.journal is not None:
            self._model_ids.update(registered_models(self.journal.directory))
        return self._model_ids.get(step)


def checkpoint_model_name(run: OpenRun | None, run_name: str | None, step: int) -> str:
    return f"{key_segment((run.run_name or run.run_id) if run else (run_name or 'run'))}-step-{step}"
