"""The runs a job's code opens after its first nest under the job's run.

The first run the code opens *is* the job's run: ``MLFLOW_RUN_ID`` (``launched_run``) makes MLflow
resume it. MLflow consumes that variable there, so the next ``mlflow.start_run()`` (a second fit, a
sweep's trial) would make an unrelated run. MLflow loads ``LaunchedRunContext`` through its
``mlflow.run_context_provider`` entry point and asks it for tags whenever a run is created with
none active (also for ``mlflow.autolog``'s runs): it adds ``mlflow.parentRunId`` = the job's run.
MLflow applies the caller's own tags after every provider's, so ``start_run(nested=True)`` inside
the user's run keeps its parent.

MLflow imports this module while it is importing itself: it must never raise, and imports nothing
of MLflow but the base class.
"""

from __future__ import annotations

import logging
from typing import Any

from mlflow.tracking.context.abstract_context import RunContextProvider

from otel_forge.mlflow.training.launched_run import LaunchedRun, launched_run_id

_logger = logging.getLogger(__name__)

PARENT_RUN_TAG = "mlflow.parentRunId"
_RECENT_EXPERIMENTS = 20  # where a job's runs in other experiments are looked for, at its end
_RUNS_NAMED = 10


class LaunchedRunContext(RunContextProvider):
    """``mlflow.parentRunId`` = the launched run, for a run started with no run active in this thread.

    While the launched run is still opening (the tracking server did not answer at the job's start),
    its id is not known yet: the command's runs start unparented, as without otel-forge, said once at
    DEBUG. With a run active, MLflow asks providers for the tags of what it logs inside that run
    (logged models, datasets): those belong to the active run, not to the launched one.
    """

    def __init__(self) -> None:
        self._pending_said = False

    def in_context(self) -> bool:
        if launched_run_id() is None:
            self._say_pending()
            return False
        from mlflow.tracking.fluent import active_run

        return active_run() is None

    def tags(self) -> dict[str, str]:
        run_id = launched_run_id()
        return {PARENT_RUN_TAG: run_id} if run_id is not None else {}

    def _say_pending(self) -> None:
        launched = LaunchedRun.from_environ()
        if self._pending_said or launched is None or not launched.pending:
            return
        self._pending_said = True
        _logger.debug("otel-forge run is still opening its run: runs started now are not nested under it")


def _one_sampler_in_cmd() -> None:
    """Under ``otel-forge run``, whose agent samples the node: MLflow's own monitor stands down in
    CMD, also where its code asks for it (``start_run(log_system_metrics=True)``)."""
    launched = LaunchedRun.from_environ()
    if launched is not None and launched.run_id is not None and launched.sampled_node is not None:
        from otel_forge.mlflow.system_metrics.one_sampler import stand_down_mlflow_sampler

        stand_down_mlflow_sampler(launched.run_id)


# MLflow imports this module as it imports itself, in every process of the job that uses it.
_one_sampler_in_cmd()


def runs_elsewhere(client: Any, run_id: str, experiment_id: str) -> list[tuple[str, str]]:
    """(run id, experiment name) of the runs nested under ``run_id`` in another experiment than
    its own: a framework that picks its own experiment (Lightning's ``MLFlowLogger``: ``lightning_logs``)
    put part of the job where the job's run page does not show it."""
    # Bounded on a busy server: the experiments touched last (where the job's runs are), a few runs.
    recent = client.search_experiments(max_results=_RECENT_EXPERIMENTS, order_by=["last_update_time DESC"])
    others = {e.experiment_id: e.name for e in recent if e.experiment_id != experiment_id}
    if not others:
        return []
    nested = f"tags.`{PARENT_RUN_TAG}` = '{run_id}'"
    found = client.search_runs(list(others), nested, max_results=_RUNS_NAMED)
    return [(run.info.run_id, others[run.info.experiment_id]) for run in found]
