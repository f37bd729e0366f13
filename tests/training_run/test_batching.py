"""The training loop's metrics reach MLflow in few ``log_batch`` calls: at most one per flush interval,
sooner once 1,000 values wait, at once when the run closes. Counted on the wire (a proxy in front of a
real MLflow server): each ``log-batch`` request with metrics is one call the training process paid for."""

from __future__ import annotations

import itertools
import time

from otel_forge import ForgeConfig, TrainingRun
from testkit.proxy import MlflowProxy
from testkit.servers import wait_for

LOG_BATCH = "/api/2.0/mlflow/runs/log-batch"


def _metric_batches(proxy: MlflowProxy) -> list[tuple[float, int]]:
    """(arrival time, values) of every log-batch request that carried metrics."""
    return [(at, len(body["metrics"])) for at, body in proxy.arrivals(LOG_BATCH) if body and body.get("metrics")]


def _training_run(proxy: MlflowProxy, experiment: str, flush_interval_s: float) -> TrainingRun:
    config = ForgeConfig.resolve(environ={}, flush_interval_s=flush_interval_s)
    run = TrainingRun(tracking_uri=proxy.uri, experiment=experiment, system_metrics=False, forge_config=config)
    assert run.start(timeout_s=30)
    return run


def test_values_wait_for_a_full_batch_of_1000_and_close_sends_the_rest_at_once(mlflow_server, client, experiment):
    with MlflowProxy(mlflow_server.uri) as proxy:
        run = _training_run(proxy, experiment, flush_interval_s=3600)
        run.log({"loss": 1.0}, step=0)  # the run's first value goes at once
        wait_for(lambda: _metric_batches(proxy), 30, message="the first value's log_batch")
        for step in range(1, 2500):  # 2,499 more, one value a call: two full batches, 499 left
            run.log({"loss": 1.0 / step}, step=step)
        wait_for(lambda: len(_metric_batches(proxy)) == 3, 30, message="two full batches")
        assert [size for _, size in _metric_batches(proxy)] == [1, 1000, 1000]
        run.close()  # not an hour later: at once
        assert [size for _, size in _metric_batches(proxy)] == [1, 1000, 1000, 499]
    history = client.get_metric_history(run.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(2500))
    assert client.get_run(run.run_id).info.status == "FINISHED"


def test_a_steady_20_values_a_second_is_one_log_batch_per_flush_interval(mlflow_server, client, experiment):
    flush_interval_s = 1.0
    with MlflowProxy(mlflow_server.uri) as proxy:
        run = _training_run(proxy, experiment, flush_interval_s)
        for step in range(60):  # 3 s of a loop logging once every 50 ms
            run.log({"loss": 1.0 / (step + 1)}, step=step)
            time.sleep(0.05)
        before_close = _metric_batches(proxy)
        run.close()
        batches = _metric_batches(proxy)
    # Never two calls within one interval (a slow machine only spaces them more); close adds one.
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(before_close)]
    assert all(gap >= 0.9 * flush_interval_s for gap in gaps), gaps
    assert len(batches) <= len(before_close) + 1
    assert sum(size for _, size in batches) == 60
    assert len(batches) < 60 / 10  # 20 values a second: at least 10 values a call on average
    assert sorted(m.step for m in client.get_metric_history(run.run_id, "loss")) == list(range(60))
