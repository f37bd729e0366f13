"""One run per job with several processes per node, as users train: HF ``Trainer`` under a real
``torchrun --nproc_per_node 2`` (gloo on the CPU) inside ``otel-forge run``, and HF accelerate with
``TrainingRun`` in every rank. Each test reads the runs across the whole server.
"""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from typing import Any

import pytest
from framework_jobs import HF_STEPS, SCRIPTS, Job, job_environ, python, run_job, steps

pytest.importorskip("accelerate")

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
ACCELERATE_CONFIG = {"lr", "batch_size", "model"}  # accelerate_job.py's CONFIG keys
# Jobs in one launch. Each asserts the order that closes the race (the run's params are in before the
# block's code runs: "params at entry"), not only its outcome; 20 jobs cost CI 34 s more than 10.
REPETITIONS = 10


def server_runs(client: Any) -> dict[str, list[Any]]:
    """Every run on the server by experiment name (deleted experiments aside)."""
    experiments = client.search_experiments()
    return {e.name: client.search_runs([e.experiment_id]) for e in experiments}


def torchrun_hf(tmp_path: Any, uri: str, *args: str) -> Job:
    return run_job(tmp_path, uri, [*TORCHRUN, str(SCRIPTS / "hf_trainer.py"), "plain", *args], True)


def test_hf_trainer_under_torchrun_is_one_run_with_the_loss_and_the_node(mlflow_server, client, tmp_path) -> None:
    job = torchrun_hf(tmp_path, mlflow_server.uri)
    assert job.result.returncode == 0, job.result.stderr[-3000:]
    runs = server_runs(client)[job.experiment]
    assert len(runs) == 1, [(r.info.run_name, r.data.tags.get("mlflow.parentRunId")) for r in runs]
    [run] = runs
    assert run.info.run_id == job.run_id and run.info.status == "FINISHED"
    assert steps(client, run.info.run_id, "loss") == list(range(1, HF_STEPS + 1))  # rank 0's, once
    assert any(key.startswith("system/") for key in run.data.metrics)


def test_a_failing_torchrun_worker_is_named_in_the_outcome_not_rank_0(mlflow_server, client, tmp_path) -> None:
    # Rank 1 raises at step 3; torchrun stops rank 0 and exits 1. The wrapper ran torchrun, not rank 0.
    job = torchrun_hf(tmp_path, mlflow_server.uri, "--fail-rank", "1")
    assert job.result.returncode == 1, job.result.stderr[-3000:]
    assert "rank 1 fails at step 3" in job.result.stderr  # the worker's traceback is printed as before
    [run] = server_runs(client)[job.experiment]
    assert run.info.status == "FAILED"
    outcomes = {k: v for k, v in run.data.tags.items() if k.startswith("otel_forge.outcome.")}
    assert outcomes == {"otel_forge.outcome.rank_1": "FAILED (rank 1)"}
    assert run.data.tags["otel_forge.job.outcome"] == "FAILED"
    assert not list((tmp_path / "spool").rglob("worker-ends")), "the workers' records are removed"


def test_a_failing_launcher_with_no_worker_record_names_a_worker(mlflow_server, client, tmp_path) -> None:
    # A worker that exits non-zero without an exception (sys.exit) leaves no record: no rank is named.
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    job = run_job(tmp_path, mlflow_server.uri, [*TORCHRUN, str(script)], True)
    assert job.result.returncode == 1, job.result.stderr[-3000:]
    [run] = server_runs(client)[job.experiment]
    assert run.info.status == "FAILED"
    outcomes = {k: v for k, v in run.data.tags.items() if k.startswith("otel_forge.outcome.")}
    assert outcomes == {"otel_forge.outcome.node": "FAILED (a worker)"}


def test_accelerate_in_two_processes_under_otel_forge_run_is_one_run(mlflow_server, client, tmp_path) -> None:
    job = run_job(tmp_path, mlflow_server.uri, [*TORCHRUN, str(SCRIPTS / "accelerate_job.py"), "plain"], True)
    assert job.result.returncode == 0, job.result.stderr[-3000:]
    [run] = server_runs(client)[job.experiment]
    assert run.info.run_id == job.run_id and run.info.status == "FINISHED"
    assert set(run.data.params) >= ACCELERATE_CONFIG
    assert steps(client, run.info.run_id, "loss") == list(range(5))  # the main process's, once
    assert any(key.startswith("system/") for key in run.data.metrics)


def test_accelerate_ranks_with_trainingrun_never_lose_the_param_race(mlflow_server, client, tmp_path) -> None:
    """``TrainingRun(config=CONFIG)`` in both ranks and accelerate's ``init_trackers(config=CONFIG)``:
    MLflow fails one of two writers inserting the same param at once. The run's description is in
    before the block's code runs, so accelerate's params find ours: REPETITIONS jobs, no crash."""
    experiment = f"race-{uuid.uuid4().hex[:8]}"
    result = subprocess.run(
        [*TORCHRUN, str(SCRIPTS / "accelerate_job.py"), "repeat", str(REPETITIONS)],
        cwd=tmp_path, env=job_environ(tmp_path, mlflow_server.uri, experiment), capture_output=True, text=True,
        timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    entries = re.findall(r"params at entry: (.*)", result.stdout)
    assert entries == [",".join(sorted(ACCELERATE_CONFIG))] * REPETITIONS, result.stdout[-2000:]
    runs = server_runs(client)[experiment]
    assert len(runs) == REPETITIONS
    for run in runs:
        assert run.info.status == "FINISHED"
        assert set(run.data.params) >= ACCELERATE_CONFIG and "loss" in run.data.metrics


@pytest.mark.parametrize("mode", ["job-run", "autolog"])
def test_lightning_ddp_is_one_run_without_a_warning(mlflow_server, client, tmp_path, mode) -> None:
    """Lightning's DDP on the CPU, 2 processes (Lightning starts rank 1 itself) with the documented
    line; with ``mlflow.pytorch.autolog()`` too, whose Lightning integration opens a run and logs the
    model in every rank: rank 1 adds nothing, the job's run holds one model."""
    pytest.importorskip("lightning")
    job = run_job(tmp_path, mlflow_server.uri, python(SCRIPTS / "lightning_fit.py", mode, "--ddp"), True)
    assert job.result.returncode == 0, job.result.stderr[-3000:]
    ours = [line for line in job.result.stderr.splitlines() if "otel-forge" in line or "otel_forge" in line]
    assert not [line for line in ours if "WARNING" in line], ours  # no rank is a leftover, nothing elsewhere
    runs = [run for runs in server_runs(client).values() for run in runs if run.info.run_id != job.run_id]
    assert [r for r in runs if r.data.tags.get("mlflow.parentRunId") == job.run_id] == []
    run = client.get_run(job.run_id)
    assert run.info.status == "FINISHED" and "train_loss" in run.data.metrics
    history = [(m.step, m.value) for m in client.get_metric_history(job.run_id, "train_loss")]
    assert len(history) == len(set(history)) >= 5  # rank 0's steps, once (autolog adds its epoch's value)
    experiment = run.info.experiment_id
    models = client.search_logged_models([experiment])
    assert [m.source_run_id for m in models] == ([job.run_id] if mode == "autolog" else [])
