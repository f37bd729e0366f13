"""One bad metric costs only itself: ``log()`` refuses a bad step, key or value alone (warned,
counted), and a batch the server still refuses is split so only the refused value is lost.
Real ``mlflow server`` (behind the counting proxy where the server must refuse)."""

from __future__ import annotations

import logging

from otel_forge.mlflow.training.training_run import TrainingRun
from testkit.proxy import MlflowProxy
from testkit.servers import wait_for


def _run(uri: str, experiment: str) -> TrainingRun:
    return TrainingRun(tracking_uri=uri, experiment=experiment, system_metrics=False, launch_argv=["train.py"])


def _steps(client, run_id: str, key: str) -> list[int]:  # type: ignore[no-untyped-def]
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_bad_steps_keys_and_values_cost_only_themselves(mlflow_server, client, experiment, caplog):
    caplog.set_level(logging.WARNING, logger="otel_forge")
    with _run(mlflow_server.uri, experiment) as run:
        for step in range(300):
            run.log({"loss": float(step), "x" * 300: 1.0}, step=10.5 if step == 150 else step)
        for bad_step in ("7", None, 2**63, -1, True):
            run.log({"loss": 1.0}, step=bad_step)
        run.log({"acc": "high", "inf": float("inf"), "": 1.0, "..": 2.0, "nan": float("nan")}, step=300)

    assert _steps(client, run.run_id, "loss") == [s for s in range(300) if s != 150]  # 299 of 300
    latest = client.get_run(run.run_id).data.metrics
    assert set(latest) == {"loss", "_", "nan"} and latest["_"] == 1.0  # "" kept, ".." collided with it
    # 300 over-long keys + 1 step 10.5 + 5 bad steps + "high" + inf + ".." collision
    assert run.rejected == 300 + 1 + 5 + 3
    warned = [r for r in caplog.records if "dropped (" in r.getMessage()]
    assert 1 <= len(warned) <= 2, [r.getMessage() for r in warned]  # rate-limited: one a minute
    assert client.get_run(run.run_id).data.tags["otel_forge.log.rejected"] == "309"
    assert (
        "309 metric value(s) were dropped in all: 309 refused (bad step, key or value)"
        in caplog.records[-1].getMessage()
    )


def test_a_batch_the_server_refuses_loses_only_the_refused_value(mlflow_server, client, experiment, capfd):
    with MlflowProxy(mlflow_server.uri) as proxy:
        proxy.refuse_metric_keys = {"poison"}
        with _run(proxy.uri, experiment) as run:
            for step in range(200):
                run.log({"loss": float(step), **({"poison": 1.0} if step == 77 else {})}, step=step)
            wait_for(lambda: run.run_id is not None, 30, 0.05)
    assert _steps(client, run.run_id, "loss") == list(range(200))
    assert client.get_metric_history(run.run_id, "poison") == []
    assert run.rejected == 0  # log() took it: the server refused it, and its delivery counted it
    assert client.get_run(run.run_id).data.tags["otel_forge.log.rejected"] == "1"
    # Said by the delivery (the companion process, on our stderr).
    assert "'poison' at step 77 refused by the server" in capfd.readouterr().err
