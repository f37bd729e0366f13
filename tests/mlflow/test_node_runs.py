"""Node runs, against the REAL ``mlflow server`` behind the counting proxy: past ``node_runs_above``
nodes each node logs ``system/<key>`` into a child run of its own under the job's run, which keeps
only what the job logs itself; no agent reads the job's run; a restarted agent continues its node's
run; the node's run ends with its agent; a spool the server never saw replays into the node's run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from run_reading import anchor_steps

import otel_forge
from otel_forge.config import ForgeConfig
from otel_forge.mlflow.replay import replay_spool
from otel_forge.mlflow.system_metrics.node_run import NODE_TAG, PARENT_RUN_TAG
from testkit.hermetic import hermetic_environ
from testkit.proxy import GET_HISTORY, GET_RUN, LOG_BATCH
from testkit.servers import wait_for

CPU_KEY = "system/cpu_utilization_percentage"
MEMORY_KEY = "system/system_memory_usage_megabytes"


def _node_monitor(run_id: str, uri: str, node: str, tmp_path: Path, **settings: Any) -> Any:
    return otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        tracking_uri=uri,
        node_id=node,
        sampling_interval=0.1,
        samples_per_window=1,
        prometheus=False,
        collectors=("memory",),
        spool_dir=str(tmp_path),
        node_runs_above=0,
        **settings,
    )


def _node_runs(client: Any, experiment_id: str, job_run_id: str) -> dict[str, Any]:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`{PARENT_RUN_TAG}` = '{job_run_id}'")
    return {run.data.tags[NODE_TAG]: run for run in runs}


def _steps(client: Any, run_id: str) -> list[int]:
    """The node's windows: its anchor key's steps (a key whose value did not change waits)."""
    return anchor_steps(client, run_id, "system/")


def test_the_default_puts_nodes_in_runs_of_their_own_past_8_nodes() -> None:
    config = ForgeConfig.resolve(environ={})
    assert not config.mlflow_node_runs(8) and config.mlflow_node_runs(9) and config.mlflow_node_runs(2048)
    assert not config.mlflow_node_runs(None)  # one node, no launcher: the run itself
    assert ForgeConfig.resolve(environ={"OTEL_FORGE_NODE_RUNS_ABOVE": "0"}).mlflow_node_runs(None)


def test_each_node_logs_into_its_own_run_under_the_jobs_run_which_stays_small(
    client, experiment_id, proxy, tmp_path
) -> None:
    job_run_id = client.create_run(experiment_id, run_name="job").info.run_id
    monitors = [
        _node_monitor(job_run_id, proxy.uri, f"node_{i}", tmp_path, experiment_id=experiment_id) for i in range(3)
    ]
    wait_for(lambda: proxy.count(LOG_BATCH) >= 9, 15, 0.05, message="three windows a node")
    for monitor in monitors:
        monitor.stop()

    job = client.get_run(job_run_id)
    assert not [key for key in job.data.metrics if key.startswith("system/")]  # the job's run keeps its size
    nodes = _node_runs(client, experiment_id, job_run_id)
    assert sorted(nodes) == ["node_0", "node_1", "node_2"]
    for node, run in nodes.items():
        assert run.info.run_name == node and run.info.status == "FINISHED"  # ended with its agent
        assert run.data.tags[f"otel_forge.node.{node}.host"]
        assert MEMORY_KEY in run.data.metrics and not [k for k in run.data.metrics if k.count("/") > 1]
        steps = _steps(client, run.info.run_id)
        assert len(steps) >= 3 and steps == list(range(len(steps)))
    # Each node: one search for its run, one create, its windows, one end; never the job's run read.
    assert proxy.count(GET_RUN) == 0 and proxy.count(GET_HISTORY) == 0
    assert proxy.count("/api/2.0/mlflow/runs/search") == 3 and proxy.count("/api/2.0/mlflow/runs/create") == 3
    assert proxy.count("/api/2.0/mlflow/runs/update") == 3


def test_a_restarted_node_continues_its_own_run(client, experiment_id, proxy, tmp_path) -> None:
    job_run_id = client.create_run(experiment_id).info.run_id
    first = _node_monitor(job_run_id, proxy.uri, "node_7", tmp_path, experiment_id=experiment_id)
    wait_for(lambda: proxy.count(LOG_BATCH) >= 3, 15, 0.05, message="three windows")
    first.stop()
    (node_run_id,) = [run.info.run_id for run in _node_runs(client, experiment_id, job_run_id).values()]
    before = _steps(client, node_run_id)

    again = _node_monitor(job_run_id, proxy.uri, "node_7", tmp_path, experiment_id=experiment_id)
    wait_for(lambda: len(_steps(client, node_run_id)) >= len(before) + 2, 15, 0.05, message="more")
    again.stop()

    assert list(_node_runs(client, experiment_id, job_run_id)) == ["node_7"]  # the same run, not a second
    steps = _steps(client, node_run_id)
    assert steps == list(range(len(steps))) and len(steps) > len(before)  # continued, no gap, no overlap
    assert proxy.count(GET_RUN) == 0


def test_the_experiment_named_by_the_environment_holds_the_node_runs(client, proxy, tmp_path) -> None:
    name = f"named-{time.time_ns()}"
    experiment_id = client.create_experiment(name)
    job_run_id = client.create_run(experiment_id).info.run_id
    monitor = _node_monitor(job_run_id, proxy.uri, "node_3", tmp_path, experiment_name=name)
    wait_for(lambda: proxy.count(LOG_BATCH) >= 2, 15, 0.05, message="two windows")
    monitor.stop()

    assert list(_node_runs(client, experiment_id, job_run_id)) == ["node_3"]
    assert monitor.exporter.window_logger.experiment_id == experiment_id  # the info metric's label
    assert proxy.count(GET_RUN) == 0


def test_a_spool_the_server_never_saw_replays_into_the_nodes_run(client, experiment_id, proxy, tmp_path) -> None:
    job_run_id = client.create_run(experiment_id).info.run_id
    refused = "http://127.0.0.1:9"  # nothing listens on the discard port
    monitor = _node_monitor(job_run_id, refused, "node_5", tmp_path, experiment_id=experiment_id, drain_deadline_s=0.5)
    time.sleep(0.6)
    monitor.stop()
    (spool,) = [path for path in tmp_path.iterdir() if path.is_dir() and "node_5" in path.name]

    result = replay_spool(spool, proxy.uri)

    (node_run,) = _node_runs(client, experiment_id, job_run_id).values()
    steps = _steps(client, node_run.info.run_id)
    assert result.delivered >= 3 and steps == list(range(len(steps))) and len(steps) >= 3
    assert node_run.info.status == "FINISHED"  # the replayed last window ends it
    assert not spool.exists()


def test_a_standalone_agent_of_a_2048_node_job_starts_without_reading_the_run(
    client, mlflow_server, proxy, tmp_path
) -> None:
    """``otel-forge monitor --run-id`` as a SLURM job's node runs it, nothing else said: the run in
    MLflow's default experiment, as ``MlflowClient().create_run("0")`` makes it. Nothing says where
    the job's run is: the node's run goes to MLflow's default experiment, and the agent says so."""
    job_run_id = client.create_run("0").info.run_id
    env = hermetic_environ(
        {
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NUM_NODES": "2048",
            "SLURM_NNODES": "2048",
            "SLURM_NODEID": "1999",
            "SLURM_PROCID": "15992",
            "SLURM_LOCALID": "0",
            "SLURM_NTASKS": "16384",
            "OTEL_FORGE_SPOOL_DIR": str(tmp_path / "spool"),
        }
    )
    agent = subprocess.Popen(
        [sys.executable, "-m", "otel_forge.cli", "monitor", "--run-id", job_run_id, "--tracking-uri", proxy.uri]
        + ["--no-prometheus", "--collectors", "memory", "--interval", "0.1", "--samples-per-window", "1"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        wait_for(lambda: proxy.count(LOG_BATCH) >= 3, 60, 0.1, message="three windows of the node")
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        out, err = agent.communicate(timeout=60)
    assert agent.returncode == 0, err

    assert proxy.count(GET_RUN) == 0 and proxy.count(GET_HISTORY) == 0
    (node_run,) = _node_runs(client, "0", job_run_id).values()
    assert node_run.info.run_name == "node_1999" and node_run.info.status == "FINISHED"
    assert CPU_KEY not in node_run.data.metrics and MEMORY_KEY in node_run.data.metrics
    warnings = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "MLFLOW_EXPERIMENT_ID" in warnings[0] and "Traceback" not in err, err
