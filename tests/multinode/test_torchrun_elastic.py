"""``otel-forge run -- torchrun ...`` as users type it on two hosts: elastic c10d rendezvous, no
``--node-rank``, the endpoint an address or a host name, ``--max-restarts``, with the real torchrun.

Each node is a host of its own: a UTS namespace with its own host name, and a mount namespace whose
/etc/hosts gives each host an address of its own (127.0.0.2, 127.0.0.3; both reach the shared
loopback). Neither wrapper knows its node rank before the rendezvous: the host of the endpoint
creates the run, each node is named by its host name, and its workers take that name.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers import contiguous, node_steps, task_environ, the_run, unique, why_not_finished
from jobsim import FORGE, SCRIPTS

from testkit.hermetic import hermetic_environ
from testkit.servers import free_port

pytestmark = pytest.mark.slow

HOSTS = {"host-a": "127.0.0.2", "host-b": "127.0.0.3"}
# Inside the node's namespaces: its /etc/hosts, its host name, then the command.
_AS_HOST = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'


@pytest.fixture(scope="module")
def hosts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not shutil.which("unshare") or subprocess.run(["unshare", "--uts", "--mount", "true"]).returncode != 0:
        pytest.skip("unshare --uts --mount (util-linux, as root) gives each simulated node its host")
    path = tmp_path_factory.mktemp("hosts") / "hosts"
    lines = ["127.0.0.1 localhost", "::1 localhost", *(f"{address} {name}" for name, address in HOSTS.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


def _node_prefixes(client: Any, run_id: str) -> set[str]:
    """The node segment of every ``system/<node>/...`` key of the run."""
    keys = client.get_run(run_id).data.metrics
    return {key.split("/")[1] for key in keys if key.startswith("system/") and key.count("/") >= 2}


def _run_job(
    hosts_file: Path, endpoint: str, mlflow_uri: str, cwd: Path, tmp: Path, *task_args: str, max_restarts: int = 0
) -> tuple[str, list[tuple[str, str]], list[int]]:
    """Both nodes' ``otel-forge run -- torchrun ...``: (experiment, outputs, exit codes)."""
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun (pip install torch) is the launcher under test"
    experiment = unique("elastic")
    rdzv_id = unique("rdzv")
    port = free_port()

    def node(name: str) -> subprocess.Popen[str]:
        argv = [
            "unshare",
            "--uts",
            "--mount",
            "--fork",
            "sh",
            "-c",
            _AS_HOST,
            str(hosts_file),
            name,
            *FORGE,
            "run",
            "--",
            torchrun,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{endpoint}:{port}",
            "--rdzv-id",
            rdzv_id,
            "--max-restarts",
            str(max_restarts),
            str(SCRIPTS / "task.py"),
            "--api",
            "trainingrun",
            *task_args,
        ]
        env = hermetic_environ(task_environ(mlflow_uri, experiment, tmp))
        return subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

    nodes = [node(name) for name in HOSTS]
    try:
        outputs = [process.communicate(timeout=240) for process in nodes]
    finally:
        for process in nodes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    return experiment, outputs, [process.returncode for process in nodes]


@pytest.mark.parametrize("endpoint", ["127.0.0.2", "host-a"], ids=["by-address", "by-name"])
def test_elastic_rendezvous_without_node_rank_makes_one_run_with_one_prefix_per_node(
    endpoint, hosts_file, mlflow_server, client, job_repo, tmp_path
) -> None:
    experiment, outputs, codes = _run_job(hosts_file, endpoint, mlflow_server.uri, job_repo, tmp_path, "--seconds", "6")
    assert codes == [0, 0], outputs
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED", why_not_finished(run, outputs)
    assert _node_prefixes(client, run.info.run_id) == set(HOSTS), outputs
    for name in HOSTS:
        steps = node_steps(client, run.info.run_id, name)
        assert len(steps) >= 3 and contiguous(steps), (name, steps, outputs)
        assert run.data.tags.get(f"otel_forge.node.{name}.host") == name, run.data.tags
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(10))


def test_a_job_that_succeeds_after_a_torchrun_restart_finishes_with_the_retrys_values(
    hosts_file, mlflow_server, client, job_repo, tmp_path
) -> None:
    experiment, outputs, codes = _run_job(
        hosts_file,
        "127.0.0.2",
        mlflow_server.uri,
        job_repo,
        tmp_path,
        # Rank 1 fails half way: the other node must still be training when torchrun restarts the job
        # (a node whose workers have all ended waits at torchrun's exit barrier, not in the new round).
        "--seconds",
        "12",
        "--fail-first-attempt",
        "1",
        "--log-attempt",
        max_restarts=1,
    )
    assert codes == [0, 0], outputs
    run = the_run(client, experiment)
    assert run.info.status == "FINISHED", (run.data.tags, outputs)
    assert "otel_forge.job.outcome" not in run.data.tags, run.data.tags
    assert run.data.tags.get("otel_forge.torchrun.restart_count") == "1", run.data.tags
    retry_steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "attempt") if m.value == 1.0)
    assert retry_steps == list(range(10)), outputs
    assert _node_prefixes(client, run.info.run_id) == set(HOSTS), outputs
    for name in HOSTS:
        steps = node_steps(client, run.info.run_id, name)
        assert contiguous(steps), (name, steps)
