"""What a new run records, read back from a real tracking server through ``MlflowClient``:
flattened config params, job/git tags, note, user tags, ``config.json`` and the launch file."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import socket
from pathlib import Path

import pytest
from trun_helpers import unique

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.git_repo import commit_all
from testkit.proxy import LOG_BATCH, MlflowProxy
from testkit.servers import wait_for

pydantic = pytest.importorskip("pydantic")  # mlflow depends on pydantic: it is installed with it


class Data(pydantic.BaseModel):
    path: str = "/data/shards"
    workers: int = 4


@dataclasses.dataclass
class Model:
    dim: int = 8
    act: str = "gelu"


@dataclasses.dataclass
class Config:
    model: Model = dataclasses.field(default_factory=Model)
    optim: dict = dataclasses.field(default_factory=lambda: {"lr": 0.1, "betas": (0.9, 0.95)})
    layers: list = dataclasses.field(default_factory=lambda: [16, 32])
    resume_from: str | None = None
    args: argparse.Namespace = dataclasses.field(default_factory=lambda: argparse.Namespace(epochs=3, out=None))
    data: Data = dataclasses.field(default_factory=Data)
    notes: str = "z" * 7000
    by_id: dict = dataclasses.field(default_factory=lambda: {1: "one", 2: "two"})
    sweep: dict = dataclasses.field(default_factory=lambda: {f"h{i:03d}": i for i in range(150)})


EXPECTED_PARAMS = {
    "model.dim": "8",
    "model.act": "gelu",
    "optim.lr": "0.1",
    "optim.betas.0": "0.9",
    "optim.betas.1": "0.95",
    "layers.0": "16",
    "layers.1": "32",
    "args.epochs": "3",
    "data.path": "/data/shards",
    "data.workers": "4",
    "notes": "z" * 5975 + "...[1025 more characters]",
    "by_id.1": "one",
    "by_id.2": "two",
    **{f"sweep.h{i:03d}": str(i) for i in range(150)},
}
EXPECTED_CONFIG_JSON = {
    "model": {"dim": 8, "act": "gelu"},
    "optim": {"lr": 0.1, "betas": [0.9, 0.95]},
    "layers": [16, 32],
    "resume_from": None,
    "args": {"epochs": 3, "out": None},
    "data": {"path": "/data/shards", "workers": 4},
    "notes": "z" * 7000,
    "by_id": {"1": "one", "2": "two"},
    "sweep": {f"h{i:03d}": i for i in range(150)},
}


def _git_repo(path: Path) -> str:
    path.mkdir()
    (path / "train.py").write_text("print('train')\n")
    return commit_all(path, "init")


def _download(client, run_id: str, artifact: str, tmp_path: Path) -> str:
    return Path(client.download_artifacts(run_id, artifact, str(tmp_path / unique("dl")))).read_text()


def test_new_run_params_tags_and_artifacts(mlflow_server, client, experiment, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING)
    commit = _git_repo(tmp_path / "repo")
    monkeypatch.chdir(tmp_path / "repo")
    launch = "[optim]\nlr = 0.1\n"
    (tmp_path / "repo" / "cfg.toml").write_text(launch)  # untracked: the repository stays clean
    for name, value in {
        "SLURM_JOB_ID": "4242",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "8",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
    }.items():
        monkeypatch.setenv(name, value)

    with MlflowProxy(mlflow_server.uri) as proxy:
        with TrainingRun(
            Config(),
            tracking_uri=proxy.uri,
            experiment=experiment,
            run_name="meta-run",
            description="baseline, **bold**",
            tags={"team": "vision", "world_size": "from-user"},
            launch_argv=["train.py", "cfg.toml"],
            system_metrics=False,
        ) as run:
            run.log({"loss": 0.5, "acc": 1, "not_a_number": "x"}, step=0)
        param_batches = [len(body["params"]) for _, _, body in proxy.requests(LOG_BATCH) if body.get("params")]

    data = client.get_run(run.run_id)
    assert data.info.run_name == "meta-run"
    assert data.info.status == "FINISHED"
    assert data.data.params == EXPECTED_PARAMS
    # 163 params reach the server as ceil(163 / 100) log-batch requests of at most 100 params. (MLflow's
    # client also chunks by 100, so this counts requests on the wire, not otel_forge's own batches.)
    assert sorted(param_batches, reverse=True) == [100, len(EXPECTED_PARAMS) - 100]

    tags = data.data.tags
    assert tags["host"] == socket.gethostname()
    assert tags["slurm_job_id"] == "4242"
    assert tags["node_count"] == "2"
    assert tags["world_size"] == "from-user"  # user tags win over the detected ones
    assert tags["mlflow.note.content"] == "baseline, **bold**"
    assert tags["team"] == "vision"
    assert tags["mlflow.source.git.commit"] == commit
    assert tags["mlflow.source.git.dirty"] == "false"
    assert data.data.metrics == {"loss": 0.5, "acc": 1.0}

    artifacts = {f.path for f in client.list_artifacts(run.run_id)}
    assert artifacts == {"config.json", "cfg.toml"}
    assert json.loads(_download(client, run.run_id, "config.json", tmp_path)) == EXPECTED_CONFIG_JSON
    assert _download(client, run.run_id, "cfg.toml", tmp_path) == launch
    # The one thing said: the value that is not a number was dropped, not sent.
    said = [r.getMessage() for r in caplog.records if r.name.startswith("otel_forge")]
    assert len(said) == 1 and "'not_a_number'" in said[0] and "dropped" in said[0], caplog.text


def test_world_size_tag_from_torchrun(mlflow_server, client, experiment, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "16",
        "GROUP_RANK": "0",
        "GROUP_WORLD_SIZE": "4",
    }.items():
        monkeypatch.setenv(name, value)
    with TrainingRun(
        {"a": 1}, tracking_uri=mlflow_server.uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"]
    ) as run:
        assert run.start()
    tags = client.get_run(run.run_id).data.tags
    assert (tags["world_size"], tags["node_count"]) == ("16", "4")
    assert "slurm_job_id" not in tags


@pytest.mark.parametrize("where, launch_name", [("dirty-repo", "cfg.yaml"), ("no-repo", "cfg.json")])
def test_git_state_and_launch_file(
    where, launch_name, mlflow_server, client, experiment, tmp_path, monkeypatch, caplog
):
    caplog.set_level(logging.DEBUG, logger="otel_forge")
    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # never find a repository above tmp_path
    if where == "dirty-repo":
        commit = _git_repo(base / "repo")
        (base / "repo" / "train.py").write_text("print('changed')\n")
        workdir = base / "repo"
    else:
        workdir = base / "plain"
        workdir.mkdir()
    monkeypatch.chdir(workdir)
    launch = "lr: 0.1\n" if launch_name.endswith(".yaml") else '{"lr": 0.1}'
    (workdir / launch_name).write_text(launch)

    with TrainingRun(
        {"lr": 0.1},
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        system_metrics=False,
        launch_argv=["train.py", f"--config={launch_name}"],
    ) as run:
        run.log({"loss": 1.0}, step=0)

    data = client.get_run(run.run_id)
    assert data.info.status == "FINISHED"
    assert data.data.params == {"lr": "0.1"}
    if where == "dirty-repo":
        assert data.data.tags["mlflow.source.git.commit"] == commit
        assert data.data.tags["mlflow.source.git.dirty"] == "true"
    else:
        assert not [k for k in data.data.tags if k.startswith("mlflow.source.git")]
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert {f.path for f in client.list_artifacts(run.run_id)} == {"config.json", launch_name}
    assert _download(client, run.run_id, launch_name, tmp_path) == launch


def test_metric_values_numbers_and_item(mlflow_server, client, experiment):
    class Scalar:  # a tensor-like value: .item() gives the number
        def item(self) -> float:
            return 2.5

    with TrainingRun(
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        system_metrics=False,
        launch_argv=["train.py"],
        forge_config=ForgeConfig.resolve(),
    ) as run:
        run.log({"t": Scalar(), "i": 3, "nan": float("nan"), "s": "x", "none": None}, step=7)
    data = client.get_run(run.run_id).data
    assert data.params == {}  # no config, no params
    assert set(data.metrics) == {"t", "i", "nan"}
    assert (data.metrics["t"], data.metrics["i"]) == (2.5, 3.0)
    assert [m.step for m in client.get_metric_history(run.run_id, "t")] == [7]
    assert {f.path for f in client.list_artifacts(run.run_id)} == set()


def test_metric_keys_mlflow_rejects_do_not_lose_the_step(mlflow_server, client, experiment):
    with TrainingRun(
        tracking_uri=mlflow_server.uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"]
    ) as run:
        run.log({"loss": 0.25, "acc@1": 0.5}, step=0)
    assert client.get_run(run.run_id).data.metrics.get("loss") == 0.25


def test_a_param_key_mlflow_rejects_does_not_lose_the_other_params(mlflow_server, client, experiment):
    config = {"lr": 0.1, "loss(weights)": [1, 2], "layers": 4}
    with TrainingRun(
        config, tracking_uri=mlflow_server.uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"]
    ) as run:
        run.log({"loss": 1.0}, step=0)
    params = client.get_run(run.run_id).data.params
    assert (params.get("lr"), params.get("layers")) == ("0.1", "4")


def test_a_fast_loop_is_delivered_whole_in_few_calls(mlflow_server, client, experiment):
    """10,000 log() calls in a tight loop: every step arrives, in log_batch calls of up to 1000."""
    from otel_forge import ForgeConfig, TrainingRun

    with MlflowProxy(mlflow_server.uri) as proxy:
        run = TrainingRun(
            tracking_uri=proxy.uri,
            experiment=experiment,
            system_metrics=False,
            forge_config=ForgeConfig.resolve(environ={}, drain_deadline_s=60),
        )
        for step in range(10_000):
            run.log({"train/loss": 1.0 / (step + 1)}, step=step)
        run.close()
        metric_batches = [body for _, _, body in proxy.requests(LOG_BATCH) if body.get("metrics")]
    history = client.get_metric_history(run.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(10_000))
    # Up to 1,000 values a call, not one call per log(): the loop outran the first flush interval.
    assert 10 <= len(metric_batches) <= 10 + 3, len(metric_batches)


def test_a_description_call_that_fails_is_sent_again_until_the_run_holds_it(
    mlflow_server, client, tmp_path, monkeypatch
):
    """The delivery describes the run (tags, params, config.json) before the first values: a call that
    fails on the way (here every log_batch, for a while) is sent again, not forgotten."""
    monkeypatch.chdir(tmp_path)
    experiment = unique("describe-retried")
    with MlflowProxy(mlflow_server.uri) as proxy:
        proxy.fail_paths.add(LOG_BATCH)
        with TrainingRun(
            {"lr": 0.1, "layers": 4}, tracking_uri=proxy.uri, experiment=experiment, system_metrics=False
        ) as run:
            run.log({"loss": 0.5}, step=0)
            wait_for(
                lambda: any(body.get("tags") for _, _, body in proxy.requests(LOG_BATCH)),
                30,
                0.05,
                "a description call",
            )
            proxy.fail_paths.clear()
            run.log({"loss": 0.25}, step=1)
        refused = [request for request in proxy.log() if request[2] == LOG_BATCH and request[3] == 500]

    assert refused  # the description was refused at least once
    data = client.get_run(run.run_id)
    assert data.data.params == {"lr": "0.1", "layers": "4"}
    assert data.data.tags["otel_forge.described"] == "true"
    assert {f.path for f in client.list_artifacts(run.run_id)} >= {"config.json"}
    assert [(m.step, m.value) for m in client.get_metric_history(run.run_id, "loss")] == [(0, 0.5), (1, 0.25)]
