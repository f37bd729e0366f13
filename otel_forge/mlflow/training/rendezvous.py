"""One job, one run: global rank 0 publishes the job's run under the job key; every other process
finds it there, without a run id handed around.

The key is published as an experiment tag (``otel_forge.job.<key>`` = run id), so finding the run
reads the experiment, never the run: a node's cost at start does not grow with the run. The run
also carries the key (``otel_forge.job.key``) for search.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from otel_forge.mlflow.keys import key_segment
from otel_forge.scrub import error_line

if TYPE_CHECKING:
    from mlflow.entities import Experiment

    from otel_forge.mlflow.client import TrackingClient

_logger = logging.getLogger(__name__)

JOB_KEY_TAG = "otel_forge.job.key"
_FIRST_POLL_S = 0.2
_MAX_POLL_S = 2.0


def job_tag(key: str) -> str:
    """The experiment tag naming the job's run."""
    return f"otel_forge.job.{key_segment(key)}"


def find_experiment(client: TrackingClient, experiment: str) -> Experiment | None:
    """The experiment by id (all digits) or name; None if it does not exist (yet)."""
    if experiment.isdigit():
        return client.get_experiment(experiment)
    return client.get_experiment_by_name(experiment)


# The experiment kind MLflow's UI records when a user picks "Machine learning" for an experiment
# (its value of the ``mlflow.experimentKind`` tag): a UI that goes by the kind opens the training
# runs, not the GenAI pages. MLflow 3.17's UI goes by its own GenAI / Model training switch instead.
EXPERIMENT_KIND_TAGS = {"mlflow.experimentKind": "custom_model_development"}


def create_experiment(client: TrackingClient, name: str) -> str:
    """Create experiment ``name``, of training runs, or take the one another process of the job
    created between our look and our create; its id."""
    try:
        return str(client.create_experiment(name, tags=EXPERIMENT_KIND_TAGS))
    except Exception as error:
        if str(getattr(error, "error_code", "")) != "RESOURCE_ALREADY_EXISTS":
            raise
        if (created := client.get_experiment_by_name(name)) is None:
            raise  # deleted again meanwhile: the create's own error says what happened
        return str(created.experiment_id)


def published_run_id(experiment: Experiment | None, key: str) -> str | None:
    return experiment.tags.get(job_tag(key)) if experiment is not None else None


def publish(client: TrackingClient, experiment_id: str, key: str, run_id: str) -> None:
    client.set_experiment_tag(experiment_id, job_tag(key), run_id)


@dataclass(frozen=True)
class FoundRun:
    run_id: str
    experiment_id: str
    polls: int


def wait_for_run(
    client: TrackingClient,
    experiment: str,
    key: str,
    pause: Callable[[float], bool],
    late_after_s: float,
    on_late: Callable[[], None],
    clock: Callable[[], float] = time.monotonic,
    answered: Callable[[bool], object] | None = None,
) -> FoundRun | None:
    """Poll the experiment until rank 0 has published the job's run; None once ``pause`` (between
    looks) says to stop.

    The experiment may not exist yet (rank 0 creates it) and the server may not answer yet: both
    are "not yet" (``answered`` is told whether each look was). Polls back off from 0.2 s to 2 s;
    ``on_late`` is called once, after ``late_after_s``.
    """
    late_at: float | None = clock() + late_after_s
    delay = _FIRST_POLL_S
    polls = 0
    while True:
        polls += 1
        try:
            experiment_entity = find_experiment(client, experiment)
            if answered is not None:
                answered(True)
        except Exception as error:  # noqa: BLE001 - the server not answering yet is "not yet"
            _logger.debug("looking for job %s's run: %s", key, error_line(error))
            experiment_entity = None
            if answered is not None:
                answered(False)
        if experiment_entity is not None and (run_id := published_run_id(experiment_entity, key)) is not None:
            return FoundRun(run_id, experiment_entity.experiment_id, polls)
        if late_at is not None and clock() >= late_at:
            late_at = None
            on_late()
        if pause(delay):
            return None
        delay = min(delay * 2, _MAX_POLL_S)
