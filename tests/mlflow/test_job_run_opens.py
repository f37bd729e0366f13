"""A job's run still opens in MLflow's own UI: a run holding the per-run key budget (``RUN_KEY_BUDGET``
metric keys, shaped as otel_forge writes them: bench/run_page.py's ``system/node_<n>/<key>`` of a typical
8-GPU node, 5 steps each, and a few ``train/`` keys), on the session's real ``mlflow server``:

- ``runs/get`` of it answers in under 1 s (what the run page, MLflow's own monitor and every
  ``get_run`` pay);
- its run page, in headless Chromium (the system's ``chromium`` and ``chromedriver``), lists its metrics
  on the Overview, and its System metrics tab draws charts: not spinners, not "Something went wrong";
- the chart state that tab keeps in the browser's localStorage fits 3 times in Chromium's quota. MLflow
  3.17 keeps it for every run opened, never evicts it, and a write past the quota breaks the tab
  ("Something went wrong"): a run of ~10,000 keys fills a fresh browser's quota alone.

bench/run_page.py measures the sizes around the budget; this test keeps the budget itself honest.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bench.run_page import (
    LOCAL_STORAGE_QUOTA_CHARS,
    RUNS_PER_BROWSER,
    TRAIN_KEYS,
    chromium,
    chromium_available,
    fill,
    get_run,
    probe_overview,
    probe_system_metrics,
    run_keys,
)
from otel_forge.config import RUN_KEY_BUDGET
from otel_forge.mlflow.system_metrics.node_run import PARENT_RUN_TAG

STEPS = 5
PAGE_TIMEOUT_S = 30.0


@dataclass
class BudgetRun:
    experiment_id: str
    run_id: str


@pytest.fixture(scope="module")
def budget_run(mlflow_server) -> BudgetRun:  # type: ignore[no-untyped-def]
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment(f"budget-{time.time_ns()}")
    run_id = client.create_run(experiment_id, run_name=f"keys-{RUN_KEY_BUDGET}").info.run_id
    fill(client, run_id, run_keys(RUN_KEY_BUDGET), STEPS)
    return BudgetRun(experiment_id, run_id)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not chromium_available():
        pytest.skip("/usr/bin/chromium or /usr/bin/chromedriver missing (Debian: chromium, chromium-driver)")
    pytest.importorskip("selenium.webdriver")
    with chromium() as driver:  # a fresh profile: an empty localStorage
        yield driver


def test_runs_get_of_a_run_of_the_budget_answers_in_under_a_second(budget_run, mlflow_server) -> None:  # type: ignore[no-untyped-def]
    got = get_run(mlflow_server, budget_run.run_id)  # the median of 3, after one unmeasured call
    assert len(got.body["run"]["data"]["metrics"]) == RUN_KEY_BUDGET
    assert got.wall_ms < 1000, f"runs/get of {RUN_KEY_BUDGET} keys: {got}"


def test_the_run_page_of_a_run_of_the_budget_lists_its_metrics_and_draws_its_system_charts(  # type: ignore[no-untyped-def]
    budget_run, mlflow_server, browser
) -> None:
    ids = (budget_run.experiment_id, budget_run.run_id)
    overview = probe_overview(browser, mlflow_server, *ids, RUN_KEY_BUDGET, PAGE_TIMEOUT_S)
    assert overview.outcome == "shown", f"the Overview of {RUN_KEY_BUDGET} keys: {overview}"

    system = probe_system_metrics(browser, mlflow_server, *ids, PAGE_TIMEOUT_S)
    assert system.outcome == "charts" and system.drawn > 0, f"the System metrics tab of {RUN_KEY_BUDGET} keys: {system}"
    assert system.storage_chars, system  # the tab keeps its charts' state: the measure below is of something
    assert system.storage_chars * RUNS_PER_BROWSER <= LOCAL_STORAGE_QUOTA_CHARS, (
        f"the chart state of {RUN_KEY_BUDGET} keys, {system.storage_chars:,} characters, fits fewer than "
        f"{RUNS_PER_BROWSER} times in Chromium's localStorage quota ({LOCAL_STORAGE_QUOTA_CHARS:,})"
    )


# --- the job's run of a 2,048-node job, as real agents make it ---------------------------------------

AGENTS = 3  # of the job's 2,048 nodes: each adds nothing to the job's run, so three show it
TRAINING_STEPS = 50


@dataclass
class JobOfManyNodes:
    experiment_id: str
    job_run_id: str
    node_run_ids: list[str]


def _slurm_node(node: int) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "24",
        "SLURM_JOB_NUM_NODES": "2048",
        "SLURM_NNODES": "2048",
        "SLURM_NODEID": str(node),
        "SLURM_PROCID": str(node * 8),
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": str(2048 * 8),
    }


@pytest.fixture(scope="module")
def job_of_many_nodes(mlflow_server, tmp_path_factory) -> JobOfManyNodes:  # type: ignore[no-untyped-def]
    """The job's run with the training loop's keys (rank 0's), and AGENTS real ``otel-forge monitor``
    agents of 8 fake GPUs each, in a SLURM job of 2,048 nodes, sampling into it at the defaults'
    layout (node runs) for a few windows."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    from testkit.gpu_fakes import fake_gpu_env
    from testkit.hermetic import hermetic_environ
    from testkit.servers import wait_for

    tmp = tmp_path_factory.mktemp("job-of-many-nodes")
    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment(f"job-2048-{time.time_ns()}")
    job_run_id = client.create_run(experiment_id, run_name="job-2048").info.run_id
    now = int(time.time() * 1000)
    training = [Metric(key, 1.0 / (step + 1), now + step, step) for key in TRAIN_KEYS for step in range(TRAINING_STEPS)]
    client.log_batch(job_run_id, metrics=training)
    agents = []
    for node in range(AGENTS):
        environ = {**_slurm_node(node), "XDG_CACHE_HOME": str(tmp), "MLFLOW_EXPERIMENT_ID": experiment_id}
        env = fake_gpu_env({"count": 8}, base=hermetic_environ(environ))
        command = [sys.executable, "-m", "otel_forge.cli", "monitor", "--run-id", job_run_id]
        command += [
            "--tracking-uri",
            mlflow_server.uri,
            "--no-prometheus",
            "--interval",
            "0.2",
            "--samples-per-window",
            "1",
        ]
        agents.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))

    def node_runs() -> list[Any]:
        return client.search_runs([experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{job_run_id}'")

    try:
        wait_for(
            lambda: len(node_runs()) == AGENTS and all(len(r.data.metrics) > 200 for r in node_runs()),
            90,
            0.5,
            message="every agent's node run with its 8 GPUs' keys",
        )
    finally:
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        errors = [agent.communicate(timeout=60)[1] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), errors
    return JobOfManyNodes(experiment_id, job_run_id, [run.info.run_id for run in node_runs()])


def test_a_2048_node_jobs_run_holds_the_training_keys_alone_and_opens(
    job_of_many_nodes, mlflow_server, browser
) -> None:  # type: ignore[no-untyped-def]
    job = job_of_many_nodes
    got = get_run(mlflow_server, job.job_run_id)
    keys = {metric["key"] for metric in got.body["run"]["data"]["metrics"]}
    assert keys == set(TRAIN_KEYS)  # the nodes' agents added nothing: its size is the same at 2,048 nodes
    assert len(keys) <= RUN_KEY_BUDGET and got.wall_ms < 1000, got
    overview = probe_overview(browser, mlflow_server, job.experiment_id, job.job_run_id, len(keys), PAGE_TIMEOUT_S)
    assert overview.outcome == "shown", overview


def test_a_node_run_of_8_gpus_is_within_the_budget_and_draws_its_system_charts(
    job_of_many_nodes, mlflow_server, browser
) -> None:  # type: ignore[no-untyped-def]
    job = job_of_many_nodes
    node_run_id = job.node_run_ids[0]
    got = get_run(mlflow_server, node_run_id)
    metrics = got.body["run"]["data"]["metrics"]
    assert 200 < len(metrics) <= RUN_KEY_BUDGET and got.wall_ms < 1000, got
    assert all(m["key"].startswith("system/") and m["key"].count("/") == 1 for m in metrics)
    system = probe_system_metrics(browser, mlflow_server, job.experiment_id, node_run_id, PAGE_TIMEOUT_S)
    assert system.outcome == "charts" and system.drawn > 0, system
