"""TrainingRun in a job: a run created beforehand is described once, a rank other than 0 finds the
job's run by its key without reading the run, and a rank that cannot find it says so, naming the
setting that fixes it. Real ``mlflow server``; the launcher is given as the variables it sets."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from trun_helpers import unique

from otel_forge.mlflow.training.rendezvous import JOB_KEY_TAG, job_tag
from otel_forge.mlflow.training.training_run import TrainingRun
from otel_forge.node import NodeIdentity
from testkit.proxy import MlflowProxy

SLURM_NODE_1 = {
    "SLURM_PROCID": "2",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS": "4",
}


def _node(environ: dict[str, str]) -> NodeIdentity:
    return NodeIdentity.detect(environ=environ)


def test_a_run_created_beforehand_is_described_once(mlflow_server, client, experiment, tmp_path, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the project's repository: git state to record
    run_id = client.create_run(client.create_experiment(experiment)).info.run_id
    with TrainingRun(
        {"lr": 0.1, "model": {"dim": 8}},
        tracking_uri=mlflow_server.uri,
        run_id=run_id,
        system_metrics=False,
        launch_argv=["train.py"],
    ) as first:
        first.log({"loss": 1.0}, step=0)
    described = client.get_run(run_id).data
    assert described.params == {"lr": "0.1", "model.dim": "8"}
    assert described.tags["mlflow.source.git.commit"] and described.tags["otel_forge.described"] == "true"
    config_json = client.download_artifacts(run_id, "config.json", str(tmp_path / "first"))
    assert json.loads(Path(config_json).read_text()) == {"lr": 0.1, "model": {"dim": 8}}

    with TrainingRun(
        {"lr": 0.9, "other": 1},
        tracking_uri=mlflow_server.uri,
        run_id=run_id,
        system_metrics=False,
        launch_argv=["train.py"],
    ) as again:
        again.log({"loss": 0.5}, step=1)
    after = client.get_run(run_id).data
    assert (after.params, after.tags) == (described.params, described.tags)
    config_json = client.download_artifacts(run_id, "config.json", str(tmp_path / "again"))
    assert json.loads(Path(config_json).read_text()) == {"lr": 0.1, "model": {"dim": 8}}


def test_another_rank_finds_the_jobs_run_by_key_without_reading_the_run(mlflow_server, client, experiment):
    key = unique("slurm")
    owner = TrainingRun(
        {"lr": 0.1},
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        system_metrics=False,
        node=_node({"SLURM_JOB_ID": key, "SLURM_PROCID": "0"}),
        launch_argv=["train.py"],
    )
    with MlflowProxy(mlflow_server.uri) as proxy:
        finder = TrainingRun(
            tracking_uri=proxy.uri,
            experiment=experiment,
            system_metrics=False,
            node=_node({**SLURM_NODE_1, "SLURM_JOB_ID": key}),
            launch_argv=["train.py"],
        )
        # The finder looks for the run before rank 0 has made it (or the experiment). It neither logs nor
        # samples its node: it looks only when asked (start()), or should it fail.
        with finder, owner:
            assert finder.run_id is None
            assert finder.start(30)
        paths = set(proxy.counts())
    assert finder.run_id == owner.run_id
    run = client.get_run(owner.run_id)
    assert run.data.tags[JOB_KEY_TAG] == f"slurm-{key}" and run.info.status == "FINISHED"
    assert client.get_experiment_by_name(experiment).tags[job_tag(f"slurm-{key}")] == owner.run_id
    # Finding cost reads of the experiment only: never the run, never a search.
    assert paths and all("experiments/get-by-name" in path for path in paths), paths


def test_a_rank_with_no_way_to_find_the_run_says_which_setting_fixes_it(mlflow_server, experiment, caplog):
    caplog.set_level(logging.WARNING, logger="otel_forge")
    lost = TrainingRun(
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        node=_node(SLURM_NODE_1),
        launch_argv=["train.py"],
        init_deadline_s=5,
    )
    with lost:
        assert not lost.start()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "MLFLOW_RUN_ID" in warnings[0] and "OTEL_FORGE_JOB_ID" in warnings[0], warnings


def test_a_rank_whose_run_never_appears_gives_up_at_the_init_deadline(mlflow_server, client, experiment, caplog):
    caplog.set_level(logging.WARNING, logger="otel_forge")
    client.create_experiment(experiment)
    waiting = TrainingRun(
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        launch_argv=["train.py"],
        node=_node({**SLURM_NODE_1, "SLURM_JOB_ID": unique("never")}),
        init_deadline_s=2,
    )
    with waiting:
        assert not waiting.start()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("published no run" in w and "MLFLOW_RUN_ID" in w for w in warnings), warnings
    assert client.search_runs([client.get_experiment_by_name(experiment).experiment_id]) == []
