"""A SLURM job past ``node_runs_above`` nodes (3 nodes x 2 tasks, the threshold set to 2), simulated
on one machine: the job's run holds the training loop's metrics, params and git state, and no
``system/`` key; each node's hardware is a run of its own nested under it (``system/<key>``, steps
0..n-1, FINISHED), named after its node. Both ways of launching: ``otel-forge run`` around every
task, and ``TrainingRun`` in every rank. Real processes against the session's real ``mlflow server``.
"""

from __future__ import annotations

import pytest
from helpers import PARENT_TAG, JobResult, contiguous, loss_steps, run_job, the_run
from run_reading import anchor_history
from test_one_run_per_job import PATTERNS

from otel_forge.mlflow.system_metrics.node_run import NODE_TAG

NODES = 3


@pytest.fixture(scope="module", params=sorted(PATTERNS))
def job_result(request, mlflow_server, job_repo, tmp_path_factory) -> JobResult:  # type: ignore[no-untyped-def]
    tmp = tmp_path_factory.mktemp(f"node-runs-{request.param}")

    def argv(task):  # type: ignore[no-untyped-def]
        return ["env", "OTEL_FORGE_NODE_RUNS_ABOVE=2", *PATTERNS[request.param](task)]

    return run_job("slurm", argv, tmp, mlflow_server.uri, job_repo, nodes=NODES)


def test_the_jobs_run_keeps_the_training_and_each_node_has_a_run_under_it(job_result: JobResult, client) -> None:
    assert [f.returncode for f in job_result.finished] == [0] * (NODES * 2), job_result.describe()
    run = the_run(client, job_result.experiment)
    assert run.info.status == "FINISHED"
    assert not [key for key in run.data.metrics if key.startswith("system/")], sorted(run.data.metrics)
    assert loss_steps(client, run) == list(range(10))

    children = client.search_runs([run.info.experiment_id], f"tags.`{PARENT_TAG}` = '{run.info.run_id}'")
    node_runs = {child.data.tags[NODE_TAG]: child for child in children if NODE_TAG in child.data.tags}
    assert sorted(node_runs) == job_result.node_names(), job_result.describe()
    for node, node_run in node_runs.items():
        assert node_run.info.run_name == node and node_run.info.status == "FINISHED"
        steps = [m.step for m in anchor_history(client, node_run.info.run_id, "system/")]
        assert len(steps) >= 3 and contiguous(steps), (node, steps)
        assert not [key for key in node_run.data.metrics if not key.startswith("system/") or key.count("/") > 1]
