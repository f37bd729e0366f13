"""``otel-forge run -- torchrun ...`` on each of two nodes, with the real torchrun (static
rendezvous on 127.0.0.1): otel-forge reads torchrun's own arguments (node rank, node count,
rendezvous id) before torchrun has set a variable, and the job lands in one run with both nodes."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess

import pytest
from helpers import contiguous, loss_steps, node_steps, task_environ, the_run, unique, why_not_finished
from jobsim import FORGE, SCRIPTS

from testkit.hermetic import hermetic_environ
from testkit.servers import free_port


@pytest.mark.parametrize("spelling", ["dashes", "underscores"])
def test_otel_forge_run_per_node_around_torchrun(spelling, mlflow_server, client, job_repo, tmp_path) -> None:
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun (pip install torch) is the launcher under test"
    experiment = unique("torchrun")
    rdzv_id = unique("rdzv")
    port = free_port()
    sep = "-" if spelling == "dashes" else "_"

    def node(rank: int) -> subprocess.Popen[str]:
        argv = [
            *FORGE,
            "run",
            "--",
            torchrun,
            "--nnodes",
            "2",
            f"--node{sep}rank",
            str(rank),
            f"--nproc{sep}per{sep}node=2",
            f"--rdzv{sep}id",
            rdzv_id,
            f"--master{sep}addr",
            "127.0.0.1",
            f"--master{sep}port",
            str(port),
            str(SCRIPTS / "task.py"),
            "--api",
            "trainingrun",
            "--seconds",
            "6",
        ]
        env = hermetic_environ(task_environ(mlflow_server.uri, experiment, tmp_path))
        return subprocess.Popen(
            argv,
            cwd=job_repo,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    nodes = [node(0), node(1)]
    try:
        outputs = [process.communicate(timeout=180) for process in nodes]
    finally:
        for process in nodes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)

    assert [process.returncode for process in nodes] == [0, 0], outputs
    assert not any("already writes" in err for _, err in outputs), outputs
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED", why_not_finished(run, outputs)
    assert run.data.tags["otel_forge.job.key"] == f"torchrun-{rdzv_id}"
    for name in ("node_0", "node_1"):
        steps = node_steps(client, run.info.run_id, name)
        assert len(steps) >= 3 and contiguous(steps), (name, steps, outputs)
    assert loss_steps(client, run) == list(range(10))


# The run opens only once torchrun's worker runs: the worker leaves its block once the run is open
# (under a second worker's load a 6 s job once ended before it, its values left for a replay).
def test_a_node_that_cannot_tell_it_hosts_the_rendezvous_opens_the_run_once_its_worker_is_rank_0(
    mlflow_server, client, job_repo, tmp_path
) -> None:
    # 127.0.0.5 reaches this machine's c10d store (loopback), but is none of its interface addresses
    # nor its name's: otel-forge cannot tell at start that this node hosts the rendezvous. Its
    # worker's RANK=0 says it once torchrun has run the rendezvous: the job gets its run then.
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun (pip install torch) is the launcher under test"
    experiment = unique("torchrun-rank-pending")
    argv = [
        *FORGE,
        "run",
        "--",
        torchrun,
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.5:{free_port()}",
        "--rdzv-id",
        unique("rdzv"),
        "--rdzv-conf",
        "last_call_timeout=1",
        str(SCRIPTS / "task.py"),
        "--api",
        "trainingrun",
        "--seconds",
        "6",
        "--wait-run",
        "120",
    ]
    env = hermetic_environ({**task_environ(mlflow_server.uri, experiment, tmp_path), "OTEL_FORGE_START_WAIT": "2"})
    result = subprocess.run(argv, cwd=job_repo, env=env, capture_output=True, text=True, timeout=180, check=False)

    assert result.returncode == 0, result.stderr
    assert client.get_experiment_by_name(experiment) is not None, result.stderr[-3000:]
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED"
    [node] = _node_prefixes(run)  # wrapper and worker: one node id
    assert run.data.tags[f"otel_forge.node.{node}.host"] == socket.gethostname()
    assert loss_steps(client, run) == list(range(10))


def _node_prefixes(run) -> set[str]:  # type: ignore[no-untyped-def]
    return {key.split("/")[1] for key in run.data.metrics if key.startswith("system/") and key.count("/") >= 2}
