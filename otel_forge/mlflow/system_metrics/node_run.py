"""Where a node's windows land in MLflow, and at which step they continue.

A job of few nodes logs every node into the job's run, as ``system/<node>/<key>``. Past
``node_runs_above`` nodes each node logs into a run of its own, a child of the job's run
(``mlflow.parentRunId``), as ``system/<key>``: MLflow's run page loads a whole run, twice per view,
and stops drawing one of ~10,000 keys, which one run of 2,048 nodes x ~300 keys would pass
hundredfold. The job's run keeps its size whatever the node count; MLflow's compare view draws
the node runs as one line per node on one chart.

Nothing here reads a whole run: the job's run may be the largest of the server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlflow.entities import Run

    from otel_forge.mlflow.client import TrackingClient

SYSTEM_PREFIX = "system/"
PARENT_RUN_TAG = "mlflow.parentRunId"  # MLflow's own: its UI nests the run under its parent
NODE_TAG = "otel_forge.node.id"
# The experiment ``mlflow.start_run()`` uses when the environment names none: node runs go there
# when nothing says where the job's run is.
DEFAULT_EXPERIMENT_ID = "0"


def next_system_step(run: Run, prefix: str) -> int:
    """The step after the last one this node logged in ``run`` (``prefix`` = ``system/[<node>/]``),
    else 0. The run's latest metrics carry their steps: no history is read."""
    last = -1
    for metric in run.data._metric_objs:  # noqa: SLF001 - the latest Metric objects, with steps
        rest = metric.key[len(prefix) :]
        # Without a node id, system/node_0/... belongs to another node, not to us.
        if metric.key.startswith(prefix) and "/" not in rest:
            last = max(last, metric.step)
    return last + 1


def last_anchor_step(client: TrackingClient, run_id: str, anchor: str) -> int:
    """The last step of key ``anchor`` in the run, -1 where it has none: one key's history."""
    return max((m.step for m in client.get_metric_history(run_id, anchor)), default=-1)


@dataclass(frozen=True)
class NodeRun:
    """The node's own run: where its windows go, its artifacts, the step its windows continue at."""

    run_id: str
    artifact_uri: str | None  # as MLflow's RunInfo has it (a store always sets it)
    next_step: int


def open_node_run(client: TrackingClient, job_run_id: str, experiment_id: str, node_id: str) -> NodeRun:
    """The node's run under the job's run: the one an earlier agent of the node made (a restart, a
    requeued job), else a new one. One ``runs/search``, which reads only that small run, plus a
    ``runs/create`` the first time."""
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{PARENT_RUN_TAG}` = '{job_run_id}' AND tags.`{NODE_TAG}` = '{node_id}'",
        max_results=1,
    )
    if found:
        return NodeRun(found[0].info.run_id, found[0].info.artifact_uri, next_system_step(found[0], SYSTEM_PREFIX))
    created = client.create_run(experiment_id, run_name=node_id, tags={PARENT_RUN_TAG: job_run_id, NODE_TAG: node_id})
    return NodeRun(created.info.run_id, created.info.artifact_uri, 0)


def run_artifact_uri(client: TrackingClient, experiment_id: str, run_id: str) -> str:
    """Where a run's artifacts live, from its experiment (one small call), not from the run: MLflow's
    stores place every run's artifacts at ``<experiment's artifact location>/<run id>/artifacts``."""
    from mlflow.utils.uri import append_to_uri_path

    return str(append_to_uri_path(client.get_experiment(experiment_id).artifact_location, run_id, "artifacts"))


def experiment_id_for(client: TrackingClient, experiment: str | None) -> str:
    """The experiment of a run whose opener did not say it: the one the setting names, by id (digits)
    or by name (one lookup); "" where nothing names it. Never a guess, and never a read of the run,
    though no call but a read of the whole run tells a run's experiment."""
    if experiment and experiment.isdigit():
        return experiment
    if experiment and (found := client.get_experiment_by_name(experiment)) is not None:
        return str(found.experiment_id)
    return ""
