"""torchrun ``--max-restarts``: a worker that ends while torchrun has restarts left is not the job's
outcome (torchrun SIGTERMs every healthy worker to restart them all), and a later attempt's values
are kept, not skipped as steps the run holds already. Against a real MLflow store (sqlite)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from otel_forge.mlflow.training.journal_delivery import Delivered, DeliveryPace, JournalDelivery
from otel_forge.mlflow.training.outcome import JOB_OUTCOME_TAG, OUTCOME_TAG_PREFIX, begin_attempt, end_run
from otel_forge.mlflow.training.run_journal import RunJournal
from otel_forge.node import NodeIdentity


def _attempt(restart_count: int, max_restarts: int = 1) -> dict[str, str]:
    """What torchrun sets in a worker of attempt ``restart_count``."""
    return {"TORCHELASTIC_RESTART_COUNT": str(restart_count), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}


def _worker(rank: int, node: int) -> NodeIdentity:
    environ = {"RANK": str(rank), "LOCAL_RANK": "0", "GROUP_RANK": str(node), "GROUP_WORLD_SIZE": "2"}
    return NodeIdentity.detect(environ=environ)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlflow import MlflowClient

    root: Path = tmp_path_factory.mktemp("store")
    return MlflowClient(f"sqlite:///{root / 'mlflow.db'}")


@pytest.fixture
def journals(tmp_path: Path) -> Path:
    return tmp_path / "spool"


@pytest.fixture
def run(store: Any, request: pytest.FixtureRequest) -> Any:
    experiment_id = store.create_experiment(f"restarts-{request.node.name}")
    return store.create_run(experiment_id)


def _outcome_tags(store: Any, run_id: str) -> dict[str, str]:
    tags = store.get_run(run_id).data.tags
    return {k: v for k, v in tags.items() if k == JOB_OUTCOME_TAG or k.startswith(OUTCOME_TAG_PREFIX)}


def test_workers_stopped_for_a_restart_leave_the_final_attempt_to_decide(store, run) -> None:
    run_id, experiment_id = run.info.run_id, run.info.experiment_id
    # Attempt 0: node 1's worker fails; torchrun stops rank 0's worker (SIGTERM) to restart both.
    end_run(store, run_id, experiment_id, "FAILED", _worker(1, 1), environ=_attempt(0))
    end_run(store, run_id, experiment_id, "KILLED", _worker(0, 0), environ=_attempt(0))
    assert _outcome_tags(store, run_id) == {}
    # Attempt 1 succeeds.
    end_run(store, run_id, experiment_id, "FINISHED", _worker(1, 1), environ=_attempt(1))
    end_run(store, run_id, experiment_id, "FINISHED", _worker(0, 0), environ=_attempt(1))
    finished = store.get_run(run_id)
    assert finished.info.status == "FINISHED"
    assert finished.data.tags["otel_forge.torchrun.restart_count"] == "1"


def test_a_worker_that_fails_in_the_final_attempt_fails_the_job(store, run) -> None:
    run_id, experiment_id = run.info.run_id, run.info.experiment_id
    end_run(store, run_id, experiment_id, "FAILED", _worker(1, 1), environ=_attempt(1))
    end_run(store, run_id, experiment_id, "FINISHED", _worker(0, 0), environ=_attempt(1))
    assert store.get_run(run_id).info.status == "FAILED"
    assert _outcome_tags(store, run_id) == {JOB_OUTCOME_TAG: "FAILED", f"{OUTCOME_TAG_PREFIX}node_1": "FAILED (rank 1)"}


def test_a_job_cancelled_while_restarts_remain_is_not_left_running(store, run) -> None:
    end_run(store, run.info.run_id, run.info.experiment_id, "KILLED", _worker(0, 0), environ=_attempt(0, 3))
    assert store.get_run(run.info.run_id).info.status == "KILLED"


def _deliver(store: Any, run: Any, journals: Path, last_step: int, environ: dict[str, str]) -> list[int]:
    """Journal steps 0..4 of a process of attempt ``environ`` that resumed a run holding steps up to
    ``last_step``, deliver the journal; the steps of ``loss`` the run holds afterwards."""
    journal = RunJournal.create(journals, store.tracking_uri)
    journal.plan({"attempt_environ": environ})
    journal.opened({"run_id": run.info.run_id, "experiment_id": run.info.experiment_id, "last_step": last_step})
    for step in range(5):
        journal.metrics({"loss": 1.0 / (step + 1)}, step, 1_000 + step)
    delivery = JournalDelivery(journal.directory, tracking_uri=store.tracking_uri, pace=DeliveryPace(fsync_s=0))
    delivery.finish(0)  # what is journaled, not the run's end (the process goes on)
    assert delivery.run() is Delivered.LEFT
    return sorted(m.step for m in store.get_metric_history(run.info.run_id, "loss"))


def test_a_later_torchrun_attempt_keeps_the_steps_it_logs_again(store, run, journals) -> None:
    assert _deliver(store, run, journals, last_step=16, environ=_attempt(1)) == [0, 1, 2, 3, 4]


def test_a_resume_outside_a_torchrun_retry_skips_the_steps_the_run_holds(store, run, journals) -> None:
    assert _deliver(store, run, journals, last_step=2, environ={"SLURM_RESTART_COUNT": "1"}) == [3, 4]
    assert _deliver(store, run, journals, last_step=16, environ=_attempt(0)) == [3, 4]


def test_a_new_attempt_records_which_attempt_it_is(store, run) -> None:
    store.set_tag(run.info.run_id, JOB_OUTCOME_TAG, "FAILED")
    store.set_terminated(run.info.run_id, "FAILED")
    begin_attempt(store, store.get_run(run.info.run_id), {"SLURM_RESTART_COUNT": "2"})
    resumed = store.get_run(run.info.run_id)
    assert resumed.info.status == "RUNNING"
    assert resumed.data.tags["otel_forge.slurm.restart_count"] == "2"
    assert JOB_OUTCOME_TAG not in resumed.data.tags
