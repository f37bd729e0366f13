"""Running a simulated job against a tracking server, and reading its run back: the one run of an
experiment, a node's system steps."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jobsim import Finished, Job, Task, mpi_hostname
from run_reading import anchor_history

from otel_forge.node import host_node_id

LAUNCH_TOML = "[optim]\nlr = 0.1\n"
PARENT_TAG = "mlflow.parentRunId"
JOB_KEY_TAG = "otel_forge.job.key"


def unique(name: str) -> str:
    return f"job-{name}-{uuid.uuid4().hex[:8]}"


def task_environ(tracking_uri: str, experiment: str, tmp: Path) -> dict[str, str]:
    """What every task of a job gets besides its launcher's variables: the server, a fast interval."""
    return {
        "MLFLOW_TRACKING_URI": tracking_uri,
        "MLFLOW_EXPERIMENT_NAME": experiment,
        "OTEL_FORGE_SAMPLING_INTERVAL": "0.3",
        "OTEL_FORGE_PROMETHEUS": "false",
        "OTEL_FORGE_COLLECTORS": "cpu,memory,process",
        "OTEL_FORGE_SPOOL_DIR": str(tmp / "spool"),
        "TMPDIR": str(tmp),
        "GIT_CONFIG_NOSYSTEM": "1",
    }


@dataclass
class JobResult:
    job: Job
    finished: list[Finished]
    experiment: str
    cwd: Path

    def node_names(self) -> list[str]:
        if self.job.launcher == "mpi":
            return [host_node_id(mpi_hostname(self.job.job_id, n)) for n in range(self.job.nodes)]
        return [f"node_{n}" for n in range(self.job.nodes)]

    def codes(self) -> list[int]:
        return [f.returncode for f in self.finished]

    def describe(self) -> str:
        return describe(self.finished)


def run_job(
    launcher: str,
    argv: Callable[[Task], Sequence[str]],
    tmp: Path,
    tracking_uri: str,
    cwd: Path,
    experiment: str | None = None,
    **job_options: Any,
) -> JobResult:
    """Start a job's tasks together and wait for all of them."""
    if launcher == "mpi":
        assert shutil.which("unshare"), "unshare (util-linux) gives each simulated MPI node its host name"
    experiment = experiment or unique(launcher)
    job = Job(tmp, launcher, **job_options)
    job.start(argv, lambda task: task_environ(tracking_uri, experiment, tmp), cwd)
    return JobResult(job, job.wait(), experiment, cwd)


def the_run(client: Any, experiment: str) -> Any:
    """The job's one run: the experiment's one top-level run (the runs CMD starts with MLflow's API
    are its children)."""
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment}"
    runs = client.search_runs([found.experiment_id])
    top = [r for r in runs if PARENT_TAG not in r.data.tags]
    assert len(top) == 1, f"{len(top)} top-level runs: {[(r.info.run_id, r.data.tags.get(JOB_KEY_TAG)) for r in top]}"
    strays = [r.info.run_id for r in runs if r.data.tags.get(PARENT_TAG, top[0].info.run_id) != top[0].info.run_id]
    assert strays == [], f"runs nested elsewhere: {strays}"
    return top[0]


def loss_steps(client: Any, run: Any) -> list[int]:
    """Rank 0's training-loss steps: in the run (TrainingRun) or in its one child (MLflow's API under
    ``otel-forge run``)."""
    children = client.search_runs([run.info.experiment_id], f"tags.`{PARENT_TAG}` = '{run.info.run_id}'")
    holders = [r for r in (run, *children) if "loss" in r.data.metrics]
    assert len(holders) == 1, [r.info.run_id for r in holders]
    return sorted(m.step for m in client.get_metric_history(holders[0].info.run_id, "loss"))


def node_history(client: Any, run_id: str, node: str) -> list[Any]:
    """The node's windows, as its anchor key's points."""
    return anchor_history(client, run_id, f"system/{node}/")


def node_steps(client: Any, run_id: str, node: str) -> list[int]:
    return [m.step for m in node_history(client, run_id, node)]


def contiguous(steps: list[int]) -> bool:
    """Steps 0..n-1, each once."""
    return steps == list(range(len(steps)))


def describe(finished: list[Finished]) -> str:
    return "\n".join(
        f"task {f.task.rank} (node {f.task.node}) exit {f.returncode}\n{f.stdout}\n{f.stderr}" for f in finished
    )


def why_not_finished(run: Any, outputs: Sequence[tuple[str, str]]) -> str:
    """For an assertion's message: the run's status, its outcome tags (who ended it so) and the end of
    each node's stderr."""
    outcomes = {k: v for k, v in run.data.tags.items() if k.startswith(("otel_forge.outcome", "otel_forge.job"))}
    tails = "\n---\n".join(err[-3000:] for _, err in outputs)
    return f"run {run.info.status}, outcome tags {outcomes}; stderr tails:\n{tails}"
