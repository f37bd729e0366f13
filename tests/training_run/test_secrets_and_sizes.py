"""What a config may hold and what never reaches MLflow: secrets are masked everywhere a run shows
them (params, tags, config.json, the uploaded launch file), the original file untouched; a value
that cannot be read costs only itself; a config of any size gets all its params and config.json;
a huge value never holds the training loop. Real ``mlflow server``."""

from __future__ import annotations

import json
import time
from pathlib import Path

from mlflow.entities import Param

from otel_forge.mlflow.training.training_run import TrainingRun
from otel_forge.scrub import SecretKeys, scrub
from testkit.servers import wait_for

SECRETS = ("hunter2", "sk-live-123", "tok-abc", "pw-in-url", "vault-9")
LAUNCH = """\
[db]
url = "postgresql://admin:pw-in-url@db.example/runs"
password = "hunter2"

[model]
tokenizer = "bpe"
max_tokens = 4096
"""


def _everything_mlflow_shows(client, run_id: str, tmp_path: Path) -> str:  # type: ignore[no-untyped-def]
    run = client.get_run(run_id)
    shown = [json.dumps(run.data.params), json.dumps(run.data.tags)]
    for artifact in client.list_artifacts(run_id):
        shown.append(Path(client.download_artifacts(run_id, artifact.path, str(tmp_path / "dl"))).read_text())
    return "\n".join(shown)


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no")


def test_secrets_are_masked_in_params_tags_config_and_launch_file(
    mlflow_server, client, experiment, tmp_path, monkeypatch, capfd
):
    monkeypatch.setenv("OTEL_FORGE_SECRET_KEYS", "vault path")
    launch = tmp_path / "train.toml"
    launch.write_text(LAUNCH)
    config = {
        "db": {"password": "hunter2", "host": "db"},
        "openai_api_key": "sk-live-123",
        "hf_token": "tok-abc",
        "creds": {"url": "https://u:pw-in-url@hub.example"},
        "vault_path": "vault-9",
        "model": {"tokenizer": "bpe", "max_tokens": 4096},
    }
    with TrainingRun(
        config,
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        system_metrics=False,
        tags={"api_key": "sk-live-123", "team": "ml"},
        launch_argv=["train.py", str(launch)],
    ) as run:
        run.log({"loss": 1.0}, step=0)

    shown = _everything_mlflow_shows(client, run.run_id, tmp_path)
    out, err = capfd.readouterr()
    assert not [secret for secret in SECRETS if secret in shown + out + err], shown
    params = client.get_run(run.run_id).data.params
    assert params["db.password"] == "***" and params["db.host"] == "db" and params["model.tokenizer"] == "bpe"
    assert params["model.max_tokens"] == "4096" and params["vault_path"] == "***"
    uploaded = Path(client.download_artifacts(run.run_id, "train.toml", str(tmp_path / "up"))).read_text()
    assert 'password = "***"' in uploaded and 'tokenizer = "bpe"' in uploaded and "max_tokens = 4096" in uploaded
    assert launch.read_text() == LAUNCH  # the original is untouched


def test_an_odd_value_costs_only_itself_and_a_big_config_is_recorded_whole(mlflow_server, client, experiment, tmp_path):
    recursive: dict = {"depth": 1}
    recursive["again"] = recursive
    config = {f"layer_{i:05d}": {"width": i} for i in range(10_000)}
    config.update({"odd": Unprintable(), "loop": recursive})
    with TrainingRun(
        config, tracking_uri=mlflow_server.uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"]
    ) as run:
        run.log({"loss": 1.0}, step=0)
        # 101 calls of 100 params (MLflow's limit); the sqlite server slows as a run's params grow,
        # and each look at the run reads them all: look seldom.
        wait_for(
            lambda: run.run_id and len(client.get_run(run.run_id).data.params) == 10_003,
            90,
            4.0,
            "every param in the run",
        )

    data = client.get_run(run.run_id).data
    assert data.params["odd"] == "<unprintable Unprintable>" and data.params["loop.again"] == "<cycle>"
    assert data.metrics == {"loss": 1.0}
    config_json = json.loads(Path(client.download_artifacts(run.run_id, "config.json", str(tmp_path))).read_text())
    assert len(config_json) == 10_002 and config_json["layer_09999"] == {"width": 9999}


def test_a_large_flat_config_is_in_the_run_param_by_param(mlflow_server, client, experiment, tmp_path, monkeypatch):
    """5,000 flat entries of every scalar kind (a sweep's or a framework's dump); None is no param.
    The block begins once the run is open, its params still arriving (MLflow stores 100 per call);
    the block's MLflow calls wait for them: its first sees every one, and a framework that logs the
    same params as the block begins (accelerate's ``init_trackers(config=)``: ``log_params`` in calls
    of 100) finds them in, none refused (MLflow refuses one of two writers inserting a param at once)."""
    monkeypatch.setenv("OTEL_FORGE_START_WAIT", "120")  # how long they may wait: a loaded server is slow
    kinds = (lambda i: i * 0.5, lambda i: i, lambda i: f"value-{i}", lambda i: i % 2 == 0, lambda i: None)
    config = {f"param_{i:04d}": kinds[i % len(kinds)](i) for i in range(5_000)}
    expected = {key: str(value) for key, value in config.items() if value is not None}
    with TrainingRun(
        config, tracking_uri=mlflow_server.uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"]
    ) as run:
        seen = client.get_run(run.run_id).data.params
        mlflow_params = [Param(key, value) for key, value in expected.items()]
        client.log_batch(run.run_id, params=mlflow_params, synchronous=True)  # MLflow's client: calls of 100
        run.log({"loss": 1.0}, step=0)

    assert seen == expected
    assert client.get_run(run.run_id).data.params == expected
    config_json = json.loads(Path(client.download_artifacts(run.run_id, "config.json", str(tmp_path))).read_text())
    assert config_json == config


def test_a_huge_config_value_never_holds_the_training_loop(mlflow_server, client, experiment, socket_io):
    # 1 MiB in one value, with something secret-looking in it; the loop logs every 10 ms meanwhile.
    huge = ("token=abc " + "x" * 1000 + "\n") * 1000
    with TrainingRun(
        {"huge": huge, "lr": 0.1},
        tracking_uri=mlflow_server.uri,
        experiment=experiment,
        system_metrics=False,
        launch_argv=["train.py"],
    ) as run:
        log = socket_io.watched(run.log)
        for step in range(300):
            log({"loss": 1.0 / (step + 1)}, step)
            time.sleep(0.01)
        wait_for(lambda: run.run_id is not None, 30, 0.05)
    # Recording the value (scrubbed, as a param and in config.json) is the worker's: no log() talked
    # to the server on the loop's thread.
    assert (socket_io.watched_calls, socket_io.operations) == (300, 0)
    params = client.get_run(run.run_id).data.params
    assert len(params["huge"]) <= 6000 and "abc" not in params["huge"]
    assert params["huge"].endswith(f"...[{len(huge) - params['huge'].index('...[')} more characters]")
    assert len(client.get_metric_history(run.run_id, "loss")) == 300


def test_scrubbing_is_linear():
    # 25k -> 100k -> 400k characters: 4x the text costs about 4x, never 16x.
    def cost(n: int) -> float:  # this thread's CPU time: what other processes do does not count
        text = "a" * n + "://" + "b" * n
        started = time.thread_time()
        scrub(text)
        SecretKeys().redact_text(text)
        return time.thread_time() - started

    small, large = min(cost(25_000) for _ in range(3)), min(cost(400_000) for _ in range(3))
    assert large / small < 40, (small, large)  # quadratic would be ~256


def test_a_long_word_costs_the_launch_file_masking_what_it_costs_the_line_scrubber():
    # A key is tried only where a word starts: trying every character of a long word (up to 128
    # steps each) made masking ~70x the scrubber's cost on the same text, all of it holding the GIL.
    text = "a" * 200_000 + "://" + "b" * 200_000

    def cpu(function) -> float:  # type: ignore[no-untyped-def]
        started = time.thread_time()
        function(text)
        return time.thread_time() - started

    masking, scrubbing = min(cpu(SecretKeys().redact_text) for _ in range(3)), min(cpu(scrub) for _ in range(3))
    assert masking < 5 * scrubbing, (masking, scrubbing)
