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
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING

from mlflow.tracking.context.abstract_context import RunContextProvider
from mlflow.tracking.default_experiment.abstract_context import DefaultExperimentProvider

from otel_forge.mlflow.training import script_run
from otel_forge.mlflow.training.launched_run import LaunchedRun, await_launched_run, launched_run_id
from otel_forge.mlflow.training.rendezvous import JOB_KEY_TAG
from otel_forge.mlflow.training.run_plan import DEFAULT_EXPERIMENT
from otel_forge.node import is_first_process

if TYPE_CHECKING:
    from otel_forge.mlflow.client import TrackingClient

_logger = logging.getLogger(__name__)

PARENT_RUN_TAG = "mlflow.parentRunId"
WARNED_AT_OPEN_TAG = "otel_forge.elsewhere_warned"  # said as the run opened: not again at the job's end
_LIGHTNING_LOGGER_MODULES = ("lightning.pytorch.loggers.mlflow", "pytorch_lightning.loggers.mlflow")
_CALLER_FRAMES = 8  # how far up a run's creation MLflow's tag resolution is from the logger that asks
_RECENT_EXPERIMENTS = 20  # where a job's runs in other experiments are looked for, at its end
_RUNS_NAMED = 10
_CLAIMED_WAIT_S = 10.0  # for the run another process of the job claimed to be published
_ARGV_LOCK = threading.Lock()  # sys.argv is the training process's while its context tags resolve


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
        if script_run.current() is not None:
            from mlflow.tracking.fluent import active_run

            return active_run() is None
        if launched_run_id() is None:
            self._say_pending()
            return False
        from mlflow.tracking.fluent import active_run

        return active_run() is None

    def tags(self) -> dict[str, str]:
        if (record := script_run.current()) is not None:
            return _first_run_tags(record, _lightning_logger())
        run_id = launched_run_id()
        if run_id is None:
            return {}
        if (lightning := _lightning_logger()) is None:
            return {PARENT_RUN_TAG: run_id}
        experiment = str(getattr(lightning, "_experiment_name", None) or getattr(lightning, "_experiment_id", "?"))
        _logger.warning(
            "MLflow: Lightning's MLFlowLogger opens a run of its own in experiment %s, not the job's run %s: "
            "MLFlowLogger(run_id=otel_forge.job_run_id()) logs into the job's run",
            experiment,
            run_id,
        )
        return {PARENT_RUN_TAG: run_id, WARNED_AT_OPEN_TAG: "true"}

    def _say_pending(self) -> None:
        launched = LaunchedRun.from_environ()
        if self._pending_said or launched is None or not launched.pending:
            return
        self._pending_said = True
        _logger.debug("otel-forge run is still opening its run: runs started now are not nested under it")


def _first_run_tags(record: script_run.ScriptRun, lightning: object | None) -> dict[str, str]:
    """The script's first run is the job's, where the script names the experiment (Lightning's
    ``MLFlowLogger`` names its own, ``lightning_logs`` by default): it carries the job key, and is
    published once made. A run another process claimed first nests under that one, as a job's later
    runs do."""
    if not is_first_process():
        return {}
    published = record.published()
    if published is None and record.claim(None, "the script's first MLflow run"):
        made = script_run.fluent_run_made if lightning is None else lambda: _lightning_run(lightning)
        script_run.publish_once_created(record, made)
        return {JOB_KEY_TAG: record.key}
    published = published or record.wait_published(_CLAIMED_WAIT_S)
    return {PARENT_RUN_TAG: published.run_id} if published is not None else {}


class JobDefaultExperiment(DefaultExperimentProvider):
    """Where the script names no experiment, MLflow's choice for its run (``Default``) is the job's
    default, ``otel-forge``: MLflow asks only after ``set_experiment`` and ``MLFLOW_EXPERIMENT_*``."""

    def in_context(self) -> bool:
        return script_run.current() is not None

    def get_experiment_id(self) -> str:
        from mlflow import MlflowClient

        from otel_forge.mlflow.training.rendezvous import create_experiment, find_experiment

        client = MlflowClient()
        found = find_experiment(client, DEFAULT_EXPERIMENT)
        return str(found.experiment_id) if found is not None else create_experiment(client, DEFAULT_EXPERIMENT)


def _lightning_logger() -> object | None:
    """Lightning's ``MLFlowLogger`` if it is the one creating a run now, else None.

    It creates its run with ``MlflowClient.create_run`` in an experiment of its own (``lightning_logs``
    by default), whatever run is open, and asks MLflow for the context's tags on the way: its frame is
    a few calls up from here, and the moment is when its run opens, before training, not at the end.
    """
    frame: FrameType | None = sys._getframe(1)  # noqa: SLF001 - the caller's frames, only as a run is created
    for _ in range(_CALLER_FRAMES):
        if frame is None:
            return None
        caller = frame.f_locals.get("self")
        if type(caller).__module__ in _LIGHTNING_LOGGER_MODULES:
            return caller
        frame = frame.f_back
    return None


def _lightning_run(lightning: object) -> script_run.PublishedRun | None:
    """The run Lightning's logger made, once ``create_run`` has returned it."""
    run_id = getattr(lightning, "_run_id", None)
    if run_id is None:
        return None
    return script_run.PublishedRun(str(run_id), getattr(lightning, "_experiment_id", None), None)


def _in_a_process_of_the_job() -> None:
    """In a process handed the job's run (under ``otel-forge run``, or a ``TrainingRun``'s children):
    MLflow's own monitor stands down where our agent samples the node, also where the code asks for it
    (``start_run(log_system_metrics=True)``); a launcher's worker records its own failure
    (``worker_ends``); and MLflow's autologging logs from rank 0 only."""
    launched = LaunchedRun.from_environ()
    if launched is None:
        return
    if launched.pending and await_launched_run() is not None:  # told as MLflow is imported, from here
        launched = LaunchedRun.from_environ() or launched
    if launched.script_opens:
        launched = _script_run_at_import(launched)
    if launched.run_id is not None and launched.sampled_node is not None:
        from otel_forge.mlflow.system_metrics.one_sampler import stand_down_mlflow_sampler

        stand_down_mlflow_sampler(launched.run_id)
    from otel_forge.mlflow.training.worker_ends import install_failure_record

    install_failure_record()
    if not is_first_process():
        _autologging_off()


def _script_run_at_import(launched: LaunchedRun) -> LaunchedRun:
    """Say that MLflow is here (a run may start at any moment: ``otel-forge run`` does not open one
    in its default experiment behind the script's back); a run it opened meanwhile is the job's."""
    record = script_run.current()
    if record is None:
        return launched
    try:
        record.mark_mlflow_imported()
        published = record.published()
        if published is None and record.claimed_by() == script_run.LAUNCHER:
            published = record.wait_published(_CLAIMED_WAIT_S)
    except OSError as error:  # never raise into MLflow's import
        _logger.debug("the job's shared directory is not usable: %s", error)
        return launched
    if published is None:
        return launched
    script_run.take_published(published)
    return LaunchedRun.from_environ() or launched


def _autologging_off() -> None:
    """MLflow's autologging logs from every process that trains: under DDP its Lightning integration
    opens a run and logs the model in each rank. In a job's rank other than 0 it stands down, as
    Lightning's own loggers do (``rank_zero_only``): rank 0 logs the job's model, once.

    MLflow has no public switch that outlasts a script's own ``mlflow.<flavor>.autolog()`` call; its
    global one is what ``autologging_utils.disable_autologging()`` sets while MLflow logs a model.
    """
    try:
        from mlflow.utils import autologging_utils
    except Exception as error:  # noqa: BLE001 - never raise into MLflow's import
        _logger.debug("MLflow autologging left on in this rank: %s", error)
        return
    if hasattr(autologging_utils, "_AUTOLOGGING_GLOBALLY_DISABLED"):
        autologging_utils._AUTOLOGGING_GLOBALLY_DISABLED = True  # noqa: SLF001 - see above
        _logger.debug("MLflow autologging is off in this rank: rank 0 logs the job's run")


# MLflow imports this module as it imports itself, in every process of the job that uses it.
_in_a_process_of_the_job()


def runs_elsewhere(client: TrackingClient, run_id: str, experiment_id: str) -> list[tuple[str, str]]:
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
    return [
        (run.info.run_id, others[run.info.experiment_id]) for run in found if WARNED_AT_OPEN_TAG not in run.data.tags
    ]


def context_tags_of(argv: Sequence[str], tags: Mapping[str, str]) -> dict[str, str]:
    """``context_tags`` as they resolve in the process whose ``sys.argv`` is ``argv`` (MLflow names the
    source by ``sys.argv[0]``): the companion opening the run of a training process without MLflow."""
    with _ARGV_LOCK:
        own, sys.argv = sys.argv, list(argv)
        try:
            return context_tags(tags)
        finally:
            sys.argv = own


def context_tags(tags: Mapping[str, str]) -> dict[str, str]:
    """The tags ``mlflow.start_run`` gives a run it creates here (``mlflow.user``, ``mlflow.source.name``,
    ``mlflow.source.type``, any provider plugin's), with ``tags`` applied over them.

    Git state is left to ``run_metadata.git_tags``: MLflow reads the repository of ``sys.argv[0]``,
    which under ``otel-forge run`` is otel-forge's own entry point, not the job's working directory.
    """
    from mlflow.tracking.context.git_context import GitRunContext
    from mlflow.tracking.context.registry import resolve_tags

    ignore: list[type] = [GitRunContext]
    if script_run.current() is not None:  # a run of ours is not the script's first run
        ignore.append(LaunchedRunContext)
    return resolve_tags(dict(tags), ignore=ignore)  # type: ignore[arg-type]  # MLflow takes classes
