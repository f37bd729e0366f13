"""``otel-forge run -- torchrun ...`` on each of two nodes, with the real torchrun (static
rendezvous on 127.0.0.1): otel-forge reads torchrun's own arguments (node rank, node count,
rendezvous id) before torchrun has set a variable, and the job lands in one run with both nodes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

import pytest
from helpers import contiguous, loss_steps, node_steps, task_environ, the_run, unique
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
    assert run.info.status == "FINISHED"
    assert run.data.tags["otel_forge.job.key"] == f"torchrun-{rdzv_id}"
    for name in ("node_0", "node_1"):
        steps = node_steps(client, run.info.run_id, name)
        assert len(steps) >= 3 and contiguous(steps), (name, steps, outputs)
    assert loss_steps(client, run) == list(range(10))
