"""A 2-node x 2-task job, simulated on one machine, lands in ONE MLflow run with every node in it.

For SLURM, torchrun and Open MPI, with ``otel-forge run`` wrapping every task and with
``TrainingRun`` entered in every rank, and no run id handed to any process: exactly one run;
``system/<node>/`` steps 0..n-1 for both nodes, each step once; the run FINISHED; the job's params
and git state in it. The job is real processes against the session's real ``mlflow server``.
"""

from __future__ import annotations

import pytest
from helpers import JobResult, contiguous, loss_steps, node_steps, run_job, the_run
from jobsim import FORGE, TASK

from testkit.git_repo import git

PATTERNS = {
    # srun otel-forge run -- python train.py: one wrapper per task; CMD uses MLflow's own API.
    "otel-forge-run": lambda task: [
        *FORGE,
        "run",
        "--",
        *TASK,
        "--api",
        "mlflow",
        "--rank",
        str(task.rank),
        "--node",
        str(task.node),
        "--seconds",
        "3",
        "cfg.toml",
    ],
    # The same script in every rank, with TrainingRun.
    "trainingrun": lambda task: [
        *TASK,
        "--api",
        "trainingrun",
        "--rank",
        str(task.rank),
        "--node",
        str(task.node),
        "--seconds",
        "6",
    ],
}


@pytest.fixture(
    scope="module",
    params=[(launcher, pattern) for launcher in ("slurm", "torchrun", "mpi") for pattern in PATTERNS],
    ids=lambda p: f"{p[0]}-{p[1]}",
)
def job_result(request, mlflow_server, job_repo, tmp_path_factory) -> JobResult:  # type: ignore[no-untyped-def]
    launcher, pattern = request.param
    tmp = tmp_path_factory.mktemp(f"{launcher}-{pattern}")
    return run_job(launcher, PATTERNS[pattern], tmp, mlflow_server.uri, job_repo)


def test_every_task_exits_0_without_a_traceback(job_result: JobResult) -> None:
    assert [f.returncode for f in job_result.finished] == [0, 0, 0, 0], job_result.describe()
    assert not any("Traceback" in f.stderr for f in job_result.finished), job_result.describe()


def test_one_run_holds_every_node_each_step_once(job_result: JobResult, client) -> None:
    run = the_run(client, job_result.experiment)
    assert run.info.status == "FINISHED"
    for node in job_result.node_names():
        steps = node_steps(client, run.info.run_id, node)
        assert len(steps) >= 3 and contiguous(steps), (node, steps, job_result.describe())
    nodes_in_run = {key.split("/")[1] for key in run.data.metrics if key.startswith("system/")}
    assert nodes_in_run == set(job_result.node_names()), sorted(run.data.metrics)


def test_the_run_has_the_jobs_params_git_state_and_key(job_result: JobResult, client) -> None:
    run = the_run(client, job_result.experiment)
    tags, params = run.data.tags, run.data.params
    assert tags["mlflow.source.git.commit"] == git(job_result.cwd, "rev-parse", "HEAD")
    assert tags["otel_forge.job.key"].startswith(job_result.job.launcher)
    assert (
        tags["otel_forge.job.key"].endswith(job_result.job.job_id)
        or job_result.job.job_id in tags["otel_forge.job.key"]
    )
    # The launch file (otel-forge run) or TrainingRun's config, recorded once by rank 0.
    assert params.get("optim.lr") == "0.1" or params.get("lr") == "0.1", params
    # Training metrics from rank 0 only (MLflow's API or TrainingRun.log).
    assert loss_steps(client, run) == list(range(10))
