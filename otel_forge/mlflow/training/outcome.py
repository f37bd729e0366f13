"""The run's status is the job's: how a process of the job ends the run.

A process that does not finish ends the run FAILED or KILLED and tags the job
(``otel_forge.job.outcome``) and its node (``otel_forge.outcome.<node>``); global rank 0 ends it
FINISHED only when no process of the job has tagged it otherwise (the tag survives a status that
a script's own ``mlflow.end_run`` rewrote). A new attempt of the job (a requeue) clears them.
"""

from __future__ import annotations

from typing import Any

from otel_forge.mlflow.client import import_mlflow
from otel_forge.mlflow.keys import key_segment
from otel_forge.node import NodeIdentity

OUTCOME_TAG_PREFIX = "otel_forge.outcome."  # + node: how that node's process ended, when not FINISHED
JOB_OUTCOME_TAG = "otel_forge.job.outcome"  # FAILED or KILLED once any process of the job ended so


def end_run(
    client: Any, run_id: str, experiment_id: str | None, status: str, node: NodeIdentity, detail: str | None = None
) -> None:
    """End the run as this process of the job ended: ``status`` FINISHED, FAILED or KILLED."""
    if status != "FINISHED":
        run_tag = import_mlflow().entities.RunTag
        name = node.node_id or (f"rank_{node.rank}" if node.rank is not None else "node")
        what = f"{status} (rank {node.rank}{', ' + detail if detail else ''})"
        client.log_batch(
            run_id,
            tags=[run_tag(OUTCOME_TAG_PREFIX + key_segment(name), what), run_tag(JOB_OUTCOME_TAG, status)],
            synchronous=True,
        )
        client.set_terminated(run_id, status)
    elif node.is_global_zero and experiment_id is not None:
        client.set_terminated(run_id, job_outcome(client, run_id, experiment_id) or status)


def job_outcome(client: Any, run_id: str, experiment_id: str) -> str | None:
    """FAILED or KILLED if a process of the job ended so; a search that matches nothing is small,
    whatever the run's size (``get_run`` is not)."""
    failed = f"attributes.run_id = '{run_id}' and tags.`{JOB_OUTCOME_TAG}` LIKE '%'"
    found = client.search_runs([experiment_id], failed, max_results=1)
    return found[0].data.tags.get(JOB_OUTCOME_TAG) if found else None


def begin_attempt(client: Any, run: Any) -> None:
    """A new attempt of the job (a requeue, a run made beforehand): running again, and its outcome
    is this attempt's, not the last one's."""
    if run.info.status != "RUNNING":
        client.update_run(run.info.run_id, status="RUNNING")
    for tag in [t for t in run.data.tags if t == JOB_OUTCOME_TAG or t.startswith(OUTCOME_TAG_PREFIX)]:
        client.delete_tag(run.info.run_id, tag)
