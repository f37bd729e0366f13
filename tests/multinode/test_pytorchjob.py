"""A Kubeflow PyTorchJob of two pods, each ``otel-forge run -- torchrun train.py`` with nothing on
torchrun's command line, with the real torchrun: the pods' environment as the training operator
sets it (pkg/controller.v1/pytorch: ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` =
``<job>-master-0``, ``RANK``, ``WORLD_SIZE``; elastic: ``PET_RDZV_ENDPOINT``, ...) and as a
downward-API pod spec adds it (``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``).

torchrun's rendezvous id is "none" (the operator sets PET_RDZV_ID only when the user gives one),
shared by every job: the one run is found by the PyTorchJob's namespace and name, with no glue.
Each pod is a host of its own (a UTS namespace named as the pod, and a mount namespace whose
/etc/hosts resolves the job's pod names, as the job's headless services do).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import contiguous, loss_steps, node_steps, task_environ, the_run, unique
from jobsim import FORGE, SCRIPTS

from testkit.hermetic import hermetic_environ
from testkit.servers import free_port

pytestmark = pytest.mark.slow

NAMESPACE = "ml-team"
# Inside the pod's namespaces: its /etc/hosts, its host name, then the command.
_AS_POD = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'


@dataclass(frozen=True)
class Pod:
    name: str
    address: str  # what the job's headless service resolves its name to
    node_id: str  # the node's prefix in the run: system/<node_id>/
    machine: str  # the Kubernetes node it runs on
    environ: dict[str, str]  # the training operator's variables


def _pods(layout: str, job: str, port: int) -> list[Pod]:
    """The job's pods, with their variables as training-operator v1 sets them for nprocPerNode 2:
    ``static``, a Master and a Worker (envvar.go, master.go: RANK and PET_NODE_RANK are the pod's
    rank, torchrun's rendezvous is static at the master); ``elastic``, two Workers and an
    elasticPolicy (elastic.go: the c10d rendezvous at worker 0, node ranks handed out there, so
    each node is named by its host, the pod)."""
    common = {"PYTHONUNBUFFERED": "1", "PET_NPROC_PER_NODE": "2", "PET_NNODES": "2"}
    if layout == "static":
        master = {"MASTER_PORT": str(port), "PET_MASTER_PORT": str(port), "WORLD_SIZE": "4"}
        master |= {"MASTER_ADDR": f"{job}-master-0", "PET_MASTER_ADDR": f"{job}-master-0"}
        return [
            Pod(name, address, f"node_{rank}", f"gpu-node-{rank}", {**common, **master, **_rank(rank)})
            for name, address, rank in ((f"{job}-master-0", "127.0.0.2", 0), (f"{job}-worker-0", "127.0.0.3", 1))
        ]
    elastic = {"PET_RDZV_ENDPOINT": f"{job}-worker-0:{port}", "PET_RDZV_BACKEND": "c10d", "PET_MAX_RESTARTS": "0"}
    return [
        Pod(
            f"{job}-worker-{index}",
            f"127.0.0.{index + 2}",
            f"{job}-worker-{index}",
            f"gpu-node-{index}",
            {**common, **elastic},
        )
        for index in (0, 1)
    ]


def _rank(rank: int) -> dict[str, str]:
    """The pod's rank, as the operator gives it twice: the pod's RANK and torchrun's --node-rank."""
    return {"RANK": str(rank), "PET_NODE_RANK": str(rank)}


def _pod_environ(pod: Pod) -> dict[str, str]:
    """What the kubelet adds to the operator's, and a pod spec's downward API (metadata.name,
    metadata.namespace, spec.nodeName)."""
    return {
        **pod.environ,
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "HOSTNAME": pod.name,
        "POD_NAME": pod.name,
        "POD_NAMESPACE": NAMESPACE,
        "NODE_NAME": pod.machine,
    }


@pytest.fixture
def hosts_file(tmp_path: Path) -> Path:
    if not shutil.which("unshare") or subprocess.run(["unshare", "--uts", "--mount", "true"]).returncode != 0:
        pytest.skip("unshare --uts --mount (util-linux, as root) gives each simulated pod its host")
    return tmp_path / "hosts"


@pytest.mark.parametrize("layout", ["static", "elastic"])
def test_a_pytorchjob_of_two_pods_makes_one_run_tagged_with_its_pods_namespace_and_job(
    layout, hosts_file, mlflow_server, client, job_repo, tmp_path
) -> None:
    torchrun = shutil.which("torchrun")
    assert torchrun, "torchrun (pip install torch) is the launcher under test"
    job = f"llama-{uuid.uuid4().hex[:6]}"
    pods = _pods(layout, job, free_port())
    lines = ["127.0.0.1 localhost", "::1 localhost", *(f"{pod.address} {pod.name}" for pod in pods)]
    hosts_file.write_text("\n".join(lines) + "\n")
    experiment = unique("pytorchjob")

    def start(pod: Pod) -> subprocess.Popen[str]:
        command = [*FORGE, "run", "--", torchrun, str(SCRIPTS / "task.py"), "--api", "trainingrun", "--seconds", "6"]
        argv = ["unshare", "--uts", "--mount", "--fork", "sh", "-c", _AS_POD, str(hosts_file), pod.name, *command]
        env = hermetic_environ({**task_environ(mlflow_server.uri, experiment, tmp_path), **_pod_environ(pod)})
        return subprocess.Popen(
            argv,
            cwd=job_repo,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    processes = [start(pod) for pod in pods]
    try:
        outputs = [process.communicate(timeout=240) for process in processes]
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)

    assert [process.returncode for process in processes] == [0, 0], outputs
    run = the_run(client, experiment)
    tags = run.data.tags
    assert run.info.status == "FINISHED", (tags, outputs)
    assert tags["otel_forge.job.key"] == f"k8s-{NAMESPACE}/pytorchjob/{job}"
    assert run.info.run_name == f"task-{job}"
    assert tags["k8s.namespace.name"] == NAMESPACE
    assert (tags["otel_forge.k8s.job.kind"], tags["otel_forge.k8s.job.name"]) == ("PyTorchJob", job)
    for pod in pods:
        assert tags[f"otel_forge.node.{pod.node_id}.k8s.pod.name"] == pod.name, tags
        assert tags[f"otel_forge.node.{pod.node_id}.k8s.node.name"] == pod.machine, tags
        assert tags[f"otel_forge.node.{pod.node_id}.host"] == pod.name, tags
        steps = node_steps(client, run.info.run_id, pod.node_id)
        assert len(steps) >= 3 and contiguous(steps), (pod.node_id, steps, outputs)
    assert loss_steps(client, run) == list(range(10))
