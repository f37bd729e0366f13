"""The run's status is the job's: how a process of the job ends the run.

A process that does not finish ends the run FAILED or KILLED and tags the job
(``otel_forge.job.outcome``) and its node (``otel_forge.outcome.<node>``); global rank 0 ends it
FINISHED only when no process of the job has tagged it otherwise (the tag survives a status that
a script's own ``mlflow.end_run`` rewrote). A new attempt of the job (a requeue) clears them.

A torchrun worker that ends while torchrun has restarts left (``--max-restarts``) is not the job's
end: torchrun stops every worker (SIGTERM) once one fails, and starts them all again. It tags
nothing; the final attempt decides.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from otel_forge.mlflow.client import import_mlflow
from otel_forge.mlflow.keys import key_segment
from otel_forge.mlflow.training.run_metadata import REJECTED_TAG, TORCHRUN_RESTART_TAG, attempt_tags
from otel_forge.node import NodeIdentity, torchrun_attempt

if TYPE_CHECKING:
    from mlflow.entities import Run

    from otel_forge.mlflow.client import TrackingClient

_logger = logging.getLogger(__name__)

OUTCOME_TAG_PREFIX = "otel_forge.outcome."  # + node: how that node's process ended, when not FINISHED
JOB_OUTCOME_TAG = "otel_forge.job.outcome"  # FAILED or KILLED once any process of the job ended so


def end_run(
    client: TrackingClient,
    run_id: str,
    experiment_id: str | None,
    status: str,
    node: NodeIdentity,
    detail: str | None = None,
    environ: Mapping[str, str] | None = None,
    worker: str | None = None,
    rejected: int = 0,
) -> None:
    """End the run as this process of the job ended: ``status`` FINISHED, FAILED or KILLED.

    ``environ``: this process's variables (default ``os.environ``), which say its torchrun attempt.
    ``worker``: the process ran a launcher, not a rank: the worker that ended the job (``rank 1``,
    or ``a worker`` where none said so), named in the outcome instead of this process's rank.
    ``rejected``: the values logged and not kept (dropped by ``log()``, refused by the server), for the
    run's tag.
    """
    if rejected:
        client.set_tag(run_id, REJECTED_TAG, str(rejected), synchronous=True)
    attempt = torchrun_attempt(environ)
    if status != "FINISHED" and attempt is not None and attempt.restarts_remain:
        # The status is set all the same, no tag: a job cancelled now must not stay RUNNING, and
        # the next attempt runs the run again (and ends it as the job ends).
        _logger.info(
            "rank %s ended %s in torchrun attempt %d of %d: torchrun restarts the job, its final attempt decides",
            node.rank,
            status,
            attempt.restart_count + 1,
            attempt.max_restarts + 1,
        )
        client.set_terminated(run_id, status)
    elif status != "FINISHED":
        import_mlflow()
        from mlflow.entities import RunTag

        what = f"{status} ({worker or f'rank {node.rank}'}{', ' + detail if detail else ''})"
        client.log_batch(
            run_id,
            tags=[RunTag(OUTCOME_TAG_PREFIX + outcome_name(node, worker), what), RunTag(JOB_OUTCOME_TAG, status)],
            synchronous=True,
        )
        client.set_terminated(run_id, status)
    elif node.is_global_zero and experiment_id is not None:
        if attempt is not None and attempt.is_retry:
            # The run was described in the first attempt: the attempt that finished says which it was.
            client.set_tag(run_id, TORCHRUN_RESTART_TAG, str(attempt.restart_count), synchronous=True)
        client.set_terminated(run_id, job_outcome(client, run_id, experiment_id) or status)


def outcome_name(node: NodeIdentity, worker: str | None = None) -> str:
    """The outcome tag's suffix: the node, else the rank that ended (``rank_1``), else ``node``."""
    if node.node_id:
        return key_segment(node.node_id)
    rank = worker.removeprefix("rank ") if worker else str(node.rank) if node.rank is not None else None
    return f"rank_{rank}" if rank is not None and rank.isdigit() else "node"


def job_outcome(client: TrackingClient, run_id: str, experiment_id: str) -> str | None:
    """FAILED or KILLED if a process of the job ended so; a search that matches nothing is small,
    whatever the run's size (``get_run`` is not)."""
    failed = f"attributes.run_id = '{run_id}' and tags.`{JOB_OUTCOME_TAG}` LIKE '%'"
    found = client.search_runs([experiment_id], failed, max_results=1)
    return found[0].data.tags.get(JOB_OUTCOME_TAG) if found else None


def begin_attempt(client: TrackingClient, run: Run, environ: Mapping[str, str] | None = None) -> None:
    """A new attempt of the job (a requeue, a torchrun restart, a run made beforehand): running
    again, its outcome this attempt's, not the last one's, and which attempt it is (tags)."""
    if run.info.status != "RUNNING":
        client.update_run(run.info.run_id, status="RUNNING")
    for tag in [t for t in run.data.tags if t == JOB_OUTCOME_TAG or t.startswith(OUTCOME_TAG_PREFIX)]:
        client.delete_tag(run.info.run_id, tag)
    tags = {key: value for key, value in attempt_tags(environ).items() if run.data.tags.get(key) != value}
    if tags:
        import_mlflow()
        from mlflow.entities import RunTag

        client.log_batch(run.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)
