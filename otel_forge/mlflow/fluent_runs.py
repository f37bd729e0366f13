"""What MLflow's fluent API holds in memory about this process's runs, read without I/O and
without importing mlflow (a process that never imported it has no run).

MLflow keeps its active-run stack (and the last run ended) per thread, and every thread's value in
one place: the run a framework opened on its own thread is seen from ours.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow import ActiveRun


def _fluent_stacks() -> list[list[ActiveRun]]:
    """MLflow's active-run stack of every thread of this process."""
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is None:
        return []
    stacks = fluent._active_run_stack.get_all_thread_values()  # noqa: SLF001 - no public all-threads view
    return [stack for stack in stacks.values() if isinstance(stack, list)]


def fluent_run() -> ActiveRun | None:
    """The top-level run (``mlflow.ActiveRun``, with its info) MLflow's fluent API has active in some
    thread of this process, if any."""
    for stack in _fluent_stacks():
        if stack:
            return stack[0]
    return None


def fluent_run_id() -> str | None:
    """The id of ``fluent_run()``."""
    run = fluent_run()
    return None if run is None else str(run.info.run_id)


def fluent_ended_run_ids() -> set[str]:
    """The runs MLflow's fluent API ended last, one per thread that ended one."""
    fluent = sys.modules.get("mlflow.tracking.fluent")
    if fluent is None:
        return set()
    ended = fluent._last_active_run_id.get_all_thread_values()  # noqa: SLF001 - no public all-threads view
    return {str(run_id) for run_id in ended.values() if run_id}


def forget_fluent_run(run_id: str) -> None:
    """Take ``run_id`` off MLflow's active-run stacks, with no call to the server: the job's end
    sets its status, and MLflow's exit handler would end it FINISHED afterwards, whatever the job did."""
    for stack in _fluent_stacks():
        stack[:] = [run for run in stack if run.info.run_id != run_id]
