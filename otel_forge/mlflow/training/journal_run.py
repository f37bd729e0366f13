"""``JournalRun``: the run a journal is delivered into, as its delivery finds it: the one the training
process opened (its ``opened`` entry), the launcher's (``otel-forge run``'s own journal opened it),
or, where the writer is done and opened none, the one its plan names or makes, as the training
process would have. It describes the run where that is the journal's to do, and ends it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from otel_forge.mlflow.client import classify, import_mlflow, open_failure
from otel_forge.mlflow.delivery.retry import Outcome
from otel_forge.mlflow.training.delivery_world import DeliveryWorld
from otel_forge.mlflow.training.job_run import transient_open_error
from otel_forge.mlflow.training.journal_cursor import Cursor
from otel_forge.mlflow.training.journal_tail import ROWS, Item, MetricRow
from otel_forge.mlflow.training.run_journal import CHECKPOINT, END, RECORD, Record, RunEnd
from otel_forge.mlflow.training.run_notice import RunNotice
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.training.run_source import RunSource
from otel_forge.mlflow.training.run_state import RunEvent, RunState
from otel_forge.mlflow.training.script_run import ScriptRun
from otel_forge.node import NodeIdentity, torchrun_attempt
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import error_line, scrub

_logger = logging.getLogger(__name__)


class RunNotOpenYet(Exception):
    """The training process has not opened the run yet, and may still: wait for it."""


class JournalRun:
    """The run of the journal whose delivery state is ``cursor`` (``save``: keep it on disk)."""

    def __init__(
        self,
        uri: str | None,
        cursor: Cursor,
        save: Callable[[], None],
        world: DeliveryWorld,
        on_run: Callable[[OpenRun], None] | None = None,
        job_run: Callable[[], str | None] | None = None,
        directory: Path | None = None,
    ) -> None:
        self.uri = uri
        self._directory = directory  # the journal's: where its writer is told the run we open for it
        self._refused = False  # the run we open for the writer cannot be opened (a missing run id)
        self._cursor = cursor
        self._save = save
        self._world = world
        self._on_run = on_run
        self._job_run = job_run
        self._client: Any = None
        self.open_run: OpenRun | None = None
        self.told_end: RunEnd | None = None  # the end its writer could not journal, told by other means
        self._warnings = RateLimitedLogger(_logger)

    @property
    def ended(self) -> str | None:
        """The status the run was ended with, by this delivery or an earlier one of the journal."""
        return self._cursor.ended

    @property
    def experiment(self) -> str | None:
        return (self.open_run.experiment if self.open_run else None) or self._cursor.plan.get("experiment")

    def live(self, writer_done: bool) -> OpenRun:
        """The run, found (or opened) and described; ``RunNotOpenYet`` while the writer may yet open it."""
        if self.open_run is None:
            try:
                self.open_run = self._find(writer_done)
            except RunNotOpenYet:
                raise
            except Exception as error:
                self._tell_not_open(error)
                raise
            self._tell(RunNotice(run={**(self._cursor.run or {}), "described": self.open_run.described}))
        if self._cursor.undescribed:  # retried until every record is in: a call may fail on the way
            for kind, payload in self._cursor.describe.get("records", []):
                Record(kind, payload).deliver(self.open_run.client, self.open_run.run_id)
            self._cursor.undescribed = False
            self._save()
        return self.open_run

    def send(self, item: Item, writer_done: bool) -> int:
        """Deliver ``item`` (rows, a record, a checkpoint, the end) into the run; the values delivered."""
        run = self.live(writer_done)  # found, opened or described first
        if item.kind == ROWS:
            return self._log_rows(run, [row.data for row in item.data if self._kept_step(run, row.data[3])])
        if item.kind == RECORD:
            Record(*item.data).deliver(run.client, run.run_id)
        elif item.kind == CHECKPOINT:
            self._register(run, *item.data)
        elif item.kind == END:
            self._end(run, *item.data)
        return 0

    def _log_rows(self, run: OpenRun, rows: list[MetricRow]) -> int:
        """One ``log_batch``; a batch the server refuses is split until the refused values are found."""
        if not rows:
            return 0
        metric = import_mlflow().entities.Metric
        try:
            run.client.log_batch(run.run_id, metrics=[metric(*row) for row in rows], synchronous=True)
        except Exception as error:
            if classify(error) is not Outcome.DROP:
                raise
            if len(rows) > 1:
                middle = len(rows) // 2
                return self._log_rows(run, rows[:middle]) + self._log_rows(run, rows[middle:])
            self._cursor.refused += 1
            self._warnings.warning(
                "refused", "MLflow: metric %r at step %d refused by the server: %s", rows[0][0], rows[0][3],
                error_line(error),
            )  # fmt: skip
            return 0
        return len(rows)

    def _kept_step(self, run: OpenRun, step: int) -> bool:
        """Steps a resumed run holds already are skipped, except in a later torchrun attempt
        (``--max-restarts``): it logs its steps again, and they are the job's."""
        attempt = torchrun_attempt(self._cursor.plan.get("attempt_environ") or {})
        return run.last_step is None or (attempt is not None and attempt.is_retry) or step > run.last_step

    def _register(self, run: OpenRun, step: int, path: str, model_name: str) -> None:
        from otel_forge.mlflow.training.checkpoints import find_or_create_external_model

        if str(step) not in self._cursor.models:
            self._cursor.models[str(step)] = find_or_create_external_model(run, model_name, step, Path(path))

    def _end(self, run: OpenRun, status: str, rejected: int, worker: str | None = None) -> None:
        from otel_forge.mlflow.training.outcome import end_run

        plan = self._cursor.plan
        node = NodeIdentity(**plan["node"]) if plan.get("node") else NodeIdentity.detect()
        # What the training process dropped and what the server refused: the run's one count of it.
        end_run(
            run.client, run.run_id, run.experiment_id, status, node, environ=plan.get("attempt_environ"),
            worker=worker, rejected=rejected + self._cursor.refused,
        )  # fmt: skip
        self._cursor.ended = status
        self._save()
        if status == "FINISHED" and not self.source.launched:
            _warn_runs_elsewhere(run)

    @property
    def source(self) -> RunSource:
        """Where the journal's run comes from, as its plan says."""
        return RunSource.from_plan(self._cursor.plan)

    def ending_is_ours(self) -> bool:
        """A journal whose writer died without closing: its run ends here, unless its launcher
        (``otel-forge run``) ends it from the command's exit."""
        return bool(self._cursor.plan) and self.source.ends_run

    def _find(self, writer_done: bool) -> OpenRun:
        known = self._cursor.opened or self._cursor.run
        job_run = self._job_run() if self._job_run and known is None else None
        if known is None and job_run is None and not writer_done and not self.opens_for_writer:
            raise RunNotOpenYet()  # no client before there is a run: a local store is made once, by its opener
        if self._client is None:
            self._world.check_connects(self.uri)  # a server that is down costs no MLflow import (a second)
            self._client = self._world.make_client(self.uri)
            self._tell(RunNotice())  # the server is asked now: the writer's wait for the run counts from here
        if known is None and job_run is not None and not (self._cursor.describe or writer_done):
            raise RunNotOpenYet()  # the writer describes it first (its block may log before that)
        if known is None and job_run is not None:
            # The launcher's run, opened by its own journal's delivery: this journal describes it too,
            # and names it as the script did (online, the script's TrainingRun renames the run handed to it).
            known = {"run_id": job_run, "experiment": self._cursor.plan.get("experiment"), "describe": True}
            if name := self._cursor.plan.get("named"):
                Record("run_name", name).deliver(self._client, job_run)
                known["run_name"] = name
        if known is None:
            known = self._open_from_plan()
        run = OpenRun.from_entry(known, self._client, described=not known.get("describe", False))
        if self._cursor.run is None:
            self._cursor.run = {k: v for k, v in known.items() if k != "describe"}
            self._cursor.undescribed = bool(known.get("describe"))
            self._save()
        if self._on_run is not None:
            self._on_run(run)
        return run

    @property
    def opens_for_writer(self) -> bool:
        """The writer left the run to us (``RunPlan.delivery_opens``), and has described it: open it now
        (unless it cannot be opened: the writer, told so, disables its journal)."""
        return bool(self._cursor.plan.get("delivery_opens")) and bool(self._cursor.describe) and not self._refused

    def _tell(self, notice: RunNotice) -> None:
        if self._directory is not None and self._cursor.plan.get("delivery_opens"):
            notice.tell(self._directory)

    def _tell_not_open(self, error: BaseException) -> None:
        """The writer waits for the run: say why there is none yet, or will be none."""
        if not transient_open_error(error, self.uri or ""):
            self._refused = True
            self._tell(RunNotice(refused=error_line(error)))
        else:
            self._tell(RunNotice(unanswered=open_failure(error, self.experiment)))

    def _open_from_plan(self) -> dict[str, Any]:
        """The run the training process would have opened, had the server answered while it ran."""
        from otel_forge.mlflow.training.job_run import JobRunFinder, JobRunRequest

        plan = self._cursor.plan
        if not plan:
            raise RuntimeError("the journal has no plan (its writer died before writing it)")
        node = NodeIdentity(**plan["node"])
        adopts = ScriptRun.from_entry(plan["adopts"]) if plan.get("adopts") else None
        if adopts is not None and adopts.awaited():
            raise RunNotOpenYet()  # the process that claimed the job's run has not published it yet
        if adopts is not None and adopts.given_up():
            adopts = None  # its claimer gave it up: the job key's run, or a new one, in the claim's experiment
        request = JobRunRequest(
            tracking_uri=self.uri or "",
            experiment=plan["experiment"],
            experiment_id=plan.get("experiment_id"),
            source=self.source,
            run_name=plan.get("run_name"),
            samples_node=False,
            late_after_s=60.0,
            adopts=adopts,
        )
        finder = JobRunFinder(request, self._new_run_spec, lambda: node, _LookOnce())
        run = finder.open(self._client)
        if run is None:
            raise RunNotOpenYet()
        described = run.described or (run.resumed and self.source.launched)
        return {
            "run_id": run.run_id,
            "run_name": run.run_name,
            "experiment_id": run.experiment_id,
            "experiment": run.experiment,
            "resumed": run.resumed,
            "last_step": run.last_step,
            # An adopted run: its maker described it as it saw it, the writer's description is added.
            "describe": (adopts is not None or not described) and node.is_global_zero,
        }

    def _new_run_spec(self, job_key: str | None) -> tuple[str | None, dict[str, str]]:
        from otel_forge.mlflow.training.rendezvous import JOB_KEY_TAG

        tags = dict(self._cursor.describe.get("creation_tags") or self._cursor.plan.get("tags") or {})
        if job_key:
            tags[JOB_KEY_TAG] = job_key
        if (argv := self._cursor.describe.get("context_argv")) is not None:
            from otel_forge.mlflow.training.run_context import context_tags_of

            tags = {key: scrub(str(value)) for key, value in context_tags_of(argv, tags).items()}
        return self._cursor.plan.get("run_name"), tags


class _LookOnce:
    """A delivery looks for a launcher's run once per attempt, never waits for it."""

    left = False

    def pause(self, seconds: float) -> bool:
        return True

    def fire(self, event: RunEvent) -> RunState:
        return RunState.OPENING


def _warn_runs_elsewhere(run: OpenRun) -> None:
    from otel_forge.mlflow.training.run_context import runs_elsewhere

    if run.experiment_id is None:
        return
    try:
        elsewhere = runs_elsewhere(run.client, run.run_id, run.experiment_id)
    except Exception as error:  # noqa: BLE001 - a look for the user's sake, after the run's end
        _logger.debug("MLflow: the job's runs in other experiments not looked for: %s", error_line(error))
        return
    for run_id, experiment in elsewhere:
        _logger.warning(
            "MLflow: run %s of this job is in experiment %s, not beside run %s in %s: give the "
            "framework the job's run (Lightning: MLFlowLogger(run_id=otel_forge.job_run_id()))",
            run_id,
            experiment,
            run.run_id,
            run.experiment,
        )
