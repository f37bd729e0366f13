"""``RunSource``: where the job's run comes from, decided once (``RunPlan.resolve``) from the
arguments, the environment ``otel-forge run`` hands its command, and the node. The same value opens
the run (``JobRunFinder``), is handed to CMD (``LaunchedRun``), is written in the journal's plan and
read back by its delivery and by ``otel-forge replay``. ``SOURCE_ROLES`` says, for each source, who
opens, describes, delivers and ends the run (docs/architecture.md renders it)."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from otel_forge.node import NodeIdentity


class RunOrigin(enum.Enum):
    GIVEN = "given"  # by id: the argument, MLFLOW_RUN_ID, the MLflow run the script has open
    LAUNCHER = "launcher"  # opened by `otel-forge run` (handed by id), or still opening (found by key)
    SCRIPT = "script"  # the script's own: its first run, in the experiment it names (script_run.py)
    JOB_KEY = "job_key"  # the job's key names it: rank 0 finds or makes it and publishes it there
    NEW = "new"  # nothing names it: rank 0 makes it, under a key of its own


@dataclass(frozen=True)
class RunSource:
    """Where the job's run comes from, and the little that goes with it."""

    origin: RunOrigin
    run_id: str | None = None  # GIVEN; LAUNCHER once the launcher opened it
    # The run's maker described it as it saw it (the launcher: its command; another process of the
    # job: its script); this process adds its own config, git state and launch file.
    adds_description: bool = False
    experiment_named: bool = False  # SCRIPT: this process names the experiment, so it opens at once
    create_if_missing: bool = False  # GIVEN: an id that names no run gets a new run, not an error

    @classmethod
    def given(cls, run_id: str, create_if_missing: bool = False) -> RunSource:
        return cls(RunOrigin.GIVEN, run_id, create_if_missing=create_if_missing)

    @classmethod
    def resolve(
        cls,
        requested: str | None,
        handed: RunSource | None,
        *,
        named: bool,
        node: NodeIdentity,
        create_if_missing: bool,
    ) -> RunSource:
        """``requested``: an id asked for (argument, MLFLOW_RUN_ID); ``handed``: what ``otel-forge run``
        handed this process; ``named``: this process names the experiment."""
        if handed is not None and handed.origin is RunOrigin.LAUNCHER and requested in (None, handed.run_id):
            return handed
        if requested:
            return cls.given(requested, create_if_missing)
        script_opens = handed.origin is RunOrigin.SCRIPT if handed is not None else not named
        if script_opens and (node.node_count or 1) <= 1:
            return cls(RunOrigin.SCRIPT, experiment_named=named)
        return cls(RunOrigin.JOB_KEY if node.job_key else RunOrigin.NEW)

    @property
    def launched(self) -> bool:
        """The launcher opened the run for this attempt: resuming it is not a new attempt."""
        return self.origin is RunOrigin.LAUNCHER and self.run_id is not None

    @property
    def launcher_opens(self) -> bool:
        """The launcher is still opening the run: find it by the job's key, never make one."""
        return self.origin is RunOrigin.LAUNCHER and self.run_id is None

    @property
    def waits_for_script(self) -> bool:
        """The run opens once the script names its experiment (or does not, in time)."""
        return self.origin is RunOrigin.SCRIPT and not self.experiment_named

    @property
    def ends_run(self) -> bool:
        """This process's job ends the run (the launcher ends one it opened or opens)."""
        return self.origin is not RunOrigin.LAUNCHER

    def entry(self) -> dict[str, object]:
        """As the journal's plan keeps it."""
        return {
            "origin": self.origin.value,
            "run_id": self.run_id,
            "adds_description": self.adds_description,
            "experiment_named": self.experiment_named,
            "create_if_missing": self.create_if_missing,
        }

    @classmethod
    def from_plan(cls, plan: Mapping[str, object]) -> RunSource:
        """The source a journal's plan kept; a journal of 0.1 kept its flags instead."""
        entry = plan.get("source")
        if isinstance(entry, Mapping):
            run_id = entry.get("run_id")
            return cls(
                RunOrigin(entry["origin"]),
                run_id if isinstance(run_id, str) else None,
                bool(entry.get("adds_description")),
                bool(entry.get("experiment_named")),
                bool(entry.get("create_if_missing")),
            )
        run_id = plan.get("run_id")
        run_id = run_id if isinstance(run_id, str) else None
        if plan.get("launched") or plan.get("launcher_opens"):
            return cls(RunOrigin.LAUNCHER, run_id)
        if run_id is not None:
            return cls.given(run_id, bool(plan.get("create_if_missing")))
        return cls(RunOrigin.JOB_KEY)


@dataclass(frozen=True)
class SourceRoles:
    """Who does what to a run of one source: a row of docs/architecture.md's table."""

    what: str
    opens: str
    describes: str
    delivers: str
    ends: str


SOURCE_ROLES: dict[RunOrigin, SourceRoles] = {
    RunOrigin.GIVEN: SourceRoles(
        "given by id (`run_id=`, `MLFLOW_RUN_ID`, `--run-id`, a run the script has active)",
        "global rank 0's companion resumes it from rank 0's journal (a missing id is an error unless "
        "`create_if_missing`); rank 0 itself where it imported MLflow first; other ranks attach by id (no MLflow "
        "import, no connection)",
        "rank 0's journal, where the run lacks `otel_forge.described`",
        "rank 0's companion (`otel-forge run` for CMD's journals)",
        "the delivery, from the journal's end (KILLED where its process died); a run the script has active, the script",
    ),
    RunOrigin.LAUNCHER: SourceRoles(
        "opened by the launcher (`otel-forge run`, handed to CMD in its environment)",
        "`otel-forge run`, before CMD starts, or as a Python CMD starts (one node, a tracking server, no run id): "
        "it tells CMD's processes in `run.json` in the job directory, which their MLflow import, `job_run_id()` "
        "and rank 0 wait for (every rank attaches by id: no MLflow import, no connection); if the server did not "
        "answer, CMD finds it later by the job key it publishes",
        "`otel-forge run`'s journal (launch file, git), and CMD's `TrainingRun` adds its config",
        "`otel-forge run` (a thread per journal in the job's directory)",
        "`otel-forge run`, from CMD's exit code",
    ),
    RunOrigin.SCRIPT: SourceRoles(
        "the script's own (one node, no experiment named)",
        "the first process of the job to claim it (the script's first MLflow run, or a `TrainingRun`: its "
        "companion, where the process has not imported MLflow), in the experiment the script names; the others "
        "adopt it once it is published (a `TrainingRun`'s companion too)",
        "its maker; the others add theirs",
        "the claiming process's companion (`otel-forge run` where it wraps the job)",
        "the claiming process's delivery (`otel-forge run`, from CMD's exit code, where it wraps the job)",
    ),
    RunOrigin.JOB_KEY: SourceRoles(
        "found by the job's key (SLURM, torchrun, MPI, Kubernetes name the job; a requeued job)",
        "global rank 0's companion makes it carrying the key (or resumes the run that does) from rank 0's "
        "journal, and tells rank 0 (`run.json`); local rank 0 of each node finds it by the key within a bounded "
        "wait; the other ranks only should they fail (or `start()`)",
        "rank 0",
        "rank 0's companion (the other ranks journal nothing; local rank 0 of each node samples its node)",
        "rank 0's delivery; a rank that fails tags its outcome and makes the run FAILED",
    ),
    RunOrigin.NEW: SourceRoles(
        "new (nothing names it)",
        "rank 0's companion from the journal's plan, under a key of its own (the node's windows find the run "
        "by it); rank 0 itself where it imported MLflow first",
        "the delivery, from the journal's description",
        "rank 0's companion",
        "the delivery (KILLED without an end)",
    ),
}


def source_table() -> str:
    """``SOURCE_ROLES`` as docs/architecture.md shows it."""
    lines = ["| the run | opened by | described by | delivered by | ended by |", "|---|---|---|---|---|"]
    for roles in SOURCE_ROLES.values():
        lines.append(f"| {roles.what} | {roles.opens} | {roles.describes} | {roles.delivers} | {roles.ends} |")
    return "\n".join(lines) + "\n"
