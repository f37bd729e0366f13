"""The companion's one agent for every run it samples into (``NodeSampling``): the node is read once a
collect whatever the number of runs, each run's windows hold the node and its own training process,
a run that leaves gets its last window and the others go on, and a run that samples differently
gets an agent of its own."""

from __future__ import annotations

import subprocess
import sys

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.system_metrics.node_sampling import NodeSampling
from otel_forge.node import NodeIdentity
from testkit.gpu_fakes import fake_nvml
from testkit.servers import wait_for

CPU_KEY = "system/cpu_utilization_percentage"
GPU_MEMORY_KEY = "system/gpu_0_process_memory_megabytes"
RSS_KEY = "system/process_memory_rss_megabytes"
HOLDS_MB = """
import sys
held = bytearray(int(sys.argv[1]) << 20)
held[::4096] = b"x" * len(held[::4096])  # resident, not only reserved
sys.stdin.readline()
"""


def _training_process(megabytes: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", HOLDS_MB, str(megabytes)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True
    )


def _config(uri: str, tmp_path, **settings: object) -> ForgeConfig:
    return ForgeConfig.resolve(
        tracking_uri=uri,
        spool_dir=str(tmp_path / "spool"),
        sampling_interval_s=0.2,
        samples_per_window=2,
        collectors=("cpu", "memory", "process", "nvidia"),
        prometheus=False,
        **settings,
    )


def _latest(client, run_id: str, key: str) -> float:
    return client.get_run(run_id).data.metrics[key]


def test_three_runs_share_one_read_of_the_node_and_each_keeps_its_own_process(
    mlflow_server, client, experiment_id, tmp_path
) -> None:
    processes = [_training_process(megabytes) for megabytes in (300, 10, 10)]
    runs = [client.create_run(experiment_id).info.run_id for _ in processes]
    gpu_memory = [[process.pid, (index + 1) * 100 * 10**6] for index, process in enumerate(processes)]
    sampling = NodeSampling()
    try:
        with fake_nvml({"count": 2, "processes": {"0": gpu_memory}}) as nvml:
            config = _config(mlflow_server.uri, tmp_path)
            node = NodeIdentity.from_config(config)
            sampled = [sampling.sample(config.replace(pid=process.pid), node) for process in processes]
            for run, run_id in zip(sampled, runs, strict=True):
                run.attach(run_id, RunInfo(experiment_id, ""))
            for run_id in runs:
                wait_for(lambda r=run_id: len(client.get_metric_history(r, CPU_KEY)) >= 3, 60, 0.2, "3 windows")
            [agent] = sampling.agents
            assert agent.fan_out is not None
            # Each GPU read once a collect for the three runs (an agent each read it three times).
            collects = agent.fan_out.exports
            assert 0 < nvml.calls("nvmlDeviceGetUtilizationRates", 0) <= collects
            sampled[0].stop()  # its last window now; the others go on
            ended = len(client.get_metric_history(runs[0], CPU_KEY))
            others = len(client.get_metric_history(runs[1], CPU_KEY))
            wait_for(lambda: len(client.get_metric_history(runs[1], CPU_KEY)) > others + 1, 60, 0.2, "windows go on")
            assert len(client.get_metric_history(runs[0], CPU_KEY)) == ended
            for run in sampled[1:]:
                run.stop()
            assert sampling.agents == []
    finally:
        for process in processes:
            process.communicate("\n", timeout=30)
    rss = [_latest(client, run_id, RSS_KEY) for run_id in runs]
    assert rss[0] > 300 > max(rss[1:]), rss  # each run's own process tree, not another's
    assert [_latest(client, run_id, GPU_MEMORY_KEY) for run_id in runs] == [100, 200, 300]


def test_a_run_that_samples_differently_gets_an_agent_of_its_own(mlflow_server, client, experiment_id, tmp_path):
    sampling = NodeSampling()
    with fake_nvml({"count": 1}):
        config = _config(mlflow_server.uri, tmp_path)
        node = NodeIdentity.from_config(config)
        same = [sampling.sample(config, node) for _ in range(2)]
        other = sampling.sample(config.replace(sampling_interval_s=0.5), node)
        assert len(sampling.agents) == 2
        for run in (*same, other):
            run.stop()
        assert sampling.agents == []
