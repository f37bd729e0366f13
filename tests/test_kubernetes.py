"""Who a pod is on Kubernetes (otel_forge/kubernetes.py), and where that lands: the job key, the node
id, the run's tags, the OTel Resource, the inventory and the run's info metric.

Each pod's environment is written as its controller and a downward-API pod spec leave it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from otel_forge.cli.launchers import read_launch
from otel_forge.collectors.base import Readings
from otel_forge.collectors.inventory import inventory_tags, node_inventory
from otel_forge.collectors.self_telemetry import RunInfoCollector
from otel_forge.config import ForgeConfig
from otel_forge.kubernetes import KubernetesIdentity
from otel_forge.mlflow.training.run_metadata import job_tags
from otel_forge.node import NodeIdentity, build_resource, job_label

NAMESPACE = "ml-team"
# Every container: the kubelet's service variables; the pod spec's downward API (metadata.name,
# metadata.namespace, spec.nodeName); the runtime's HOSTNAME (the pod's host name).
KUBELET = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def pod(name: str, node: str, host: str | None = None, **more: str) -> dict[str, str]:
    return {
        **KUBELET,
        "HOSTNAME": host or name,
        "POD_NAME": name,
        "POD_NAMESPACE": NAMESPACE,
        "NODE_NAME": node,
        **more,
    }


def pytorchjob_pod(job: str, replica: str, index: int, *, nproc: int = 2, replicas: int = 2) -> dict[str, str]:
    """A pod of a PyTorchJob with a Master and Workers, as training-operator v1 sets its env
    (pkg/controller.v1/pytorch/envvar.go, master.go): RANK and PET_NODE_RANK are the pod's rank."""
    rank = index + (1 if replica == "worker" else 0)
    return pod(
        f"{job}-{replica}-{index}",
        f"gpu-node-{rank}",
        PYTHONUNBUFFERED="1",
        MASTER_PORT="23456",
        PET_MASTER_PORT="23456",
        MASTER_ADDR=f"{job}-master-0",
        PET_MASTER_ADDR=f"{job}-master-0",
        WORLD_SIZE=str(replicas * nproc),
        RANK=str(rank),
        PET_NODE_RANK=str(rank),
        PET_NPROC_PER_NODE=str(nproc),
        PET_NNODES=str(replicas),
    )


def elastic_pod(job: str, index: int, **more: str) -> dict[str, str]:
    """A worker of an elastic PyTorchJob (elastic.go): no Master, the rendezvous at worker 0."""
    return pod(
        f"{job}-worker-{index}",
        f"gpu-node-{index}",
        PET_RDZV_ENDPOINT=f"{job}-worker-0:23456",
        PET_RDZV_BACKEND="c10d",
        PET_NNODES="1:4",
        PET_NPROC_PER_NODE="8",
        PET_MAX_RESTARTS="3",
        **more,
    )


def torchrun_worker(pod_env: dict[str, str], rank: int, group_rank: int, nodes: int, run_id: str) -> dict[str, str]:
    """What torchrun adds for one of its workers in that pod."""
    return {
        **pod_env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % 2),
        "WORLD_SIZE": str(2 * nodes),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(nodes),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
    }


def owner(identity: KubernetesIdentity | None) -> tuple[object, ...]:
    """The owning job and the pod's place in it."""
    assert identity is not None
    return identity.job_kind, identity.job_name, identity.batch_job, identity.replica_type, identity.replica_index


def test_outside_kubernetes_there_is_no_identity_even_with_pod_like_variables():
    assert KubernetesIdentity.detect({}) is None
    assert KubernetesIdentity.detect({"POD_NAME": "x", "HOSTNAME": "x-worker-0", "PET_NNODES": "2"}) is None
    node = NodeIdentity.detect(environ={"POD_NAME": "x"})
    assert node.kubernetes is None and node.job_key is None


def test_a_plain_pod_knows_itself_but_names_no_job(tmp_path):
    identity = KubernetesIdentity.detect(pod("notebook-0", "gpu-node-3"), tmp_path / "none")
    assert identity == KubernetesIdentity("notebook-0", NAMESPACE, "gpu-node-3")
    assert identity.job_key is None and identity.job_attributes() == {"k8s.namespace.name": NAMESPACE}
    assert identity.pod_attributes() == {"k8s.pod.name": "notebook-0", "k8s.node.name": "gpu-node-3"}
    assert NodeIdentity.detect(environ=pod("notebook-0", "gpu-node-3")).job_key is None


def test_without_the_downward_api_the_host_names_the_pod_and_the_service_account_its_namespace(tmp_path):
    namespace_file = tmp_path / "namespace"
    namespace_file.write_text("research\n")
    identity = KubernetesIdentity.detect({**KUBELET, "HOSTNAME": "trainer-7f9c-x2x4z"}, namespace_file)
    assert identity == KubernetesIdentity("trainer-7f9c-x2x4z", "research", None)


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        ({"MY_POD_NAME": "p", "MY_POD_NAMESPACE": "n", "MY_NODE_NAME": "m"}, ("p", "n", "m")),  # Kubernetes docs
        ({"OTEL_RESOURCE_ATTRIBUTES_POD_NAME": "p", "OTEL_RESOURCE_ATTRIBUTES_NODE_NAME": "m"}, ("p", None, "m")),
        ({"K8S_NODE_NAME": "m", "HOSTNAME": "p"}, ("p", None, "m")),  # the OTel Collector's chart
    ],
)
def test_the_downward_api_spellings_projects_use(variables, expected, tmp_path):
    identity = KubernetesIdentity.detect({**KUBELET, **variables}, tmp_path / "none")
    assert identity is not None
    assert (identity.pod_name, identity.namespace, identity.node_name) == expected


def test_with_host_network_the_host_name_is_the_machines_not_the_pods(tmp_path):
    identity = KubernetesIdentity.detect({**KUBELET, "HOSTNAME": "gpu-node-3", "NODE_NAME": "gpu-node-3"}, tmp_path)
    assert identity is not None and identity.pod_name is None


def test_pytorchjob_master_and_worker_pods_share_the_job_and_name_their_node_by_rank():
    master, worker = pytorchjob_pod("llama", "master", 0), pytorchjob_pod("llama", "worker", 0)
    assert owner(KubernetesIdentity.detect(master)) == ("PyTorchJob", "llama", None, "master", 0)
    assert owner(KubernetesIdentity.detect(worker)) == ("PyTorchJob", "llama", None, "worker", 0)
    # `otel-forge run -- python train.py` in each pod: the operator's RANK / PET_NODE_RANK, no torchrun.
    nodes = [NodeIdentity.detect(environ=env) for env in (master, worker)]
    assert [(n.node_id, n.node_id_source, n.is_global_zero) for n in nodes] == [
        ("node_0", "launcher PET_NODE_RANK", True),
        ("node_1", "launcher PET_NODE_RANK", False),
    ]
    assert {n.job_key for n in nodes} == {f"k8s-{NAMESPACE}/pytorchjob/llama"}
    assert nodes[0].job_key_source == "kubernetes PyTorchJob operator's pod name and PET_NNODES"
    assert job_label(master) == job_label(worker) == "llama"


def test_torchrun_in_a_pytorchjob_pod_reads_the_operators_pet_variables_and_its_workers_agree():
    """``otel-forge run -- torchrun train.py``: torchrun's options come from PET_*; its static
    rendezvous id is "none", so the pods' one run is found by the PyTorchJob's name."""
    for replica, index, node_rank in (("master", 0, 0), ("worker", 0, 1)):
        env = pytorchjob_pod("llama", replica, index)
        launch = read_launch(["torchrun", "train.py"], env)
        wrapper = NodeIdentity.detect(environ={**env, **launch.environ})
        worker = NodeIdentity.detect(environ=torchrun_worker(env, 2 * node_rank + 1, node_rank, 2, "none"))
        assert (wrapper.node_id, wrapper.rank) == (f"node_{node_rank}", 2 * node_rank)
        assert wrapper.is_global_zero == (node_rank == 0)
        assert wrapper.node_id == worker.node_id
        assert wrapper.job_key == worker.job_key == f"k8s-{NAMESPACE}/pytorchjob/llama"


def test_elastic_pytorchjob_workers_find_the_rendezvous_host_and_the_job():
    first, second = elastic_pod("gpt", 0), elastic_pod("gpt", 1)
    assert owner(KubernetesIdentity.detect(second)) == ("PyTorchJob", "gpt", None, "worker", 1)
    launch = read_launch(["torchrun", "train.py"], second)  # no node rank: handed out at rendezvous
    assert launch.host_named and launch.environ["GROUP_WORLD_SIZE"] == "4"
    worker = NodeIdentity.detect(environ=torchrun_worker(first, 0, 0, 2, "none"))
    assert worker.job_key == f"k8s-{NAMESPACE}/pytorchjob/gpt"


def test_a_rendezvous_id_the_user_set_wins_over_the_job_and_slurm_and_mpi_over_both():
    env = elastic_pod("gpt", 1, PET_RDZV_ID="exp-42")
    assert read_launch(["torchrun", "train.py"], env).environ["TORCHELASTIC_RUN_ID"] == "exp-42"
    assert NodeIdentity.detect(environ=torchrun_worker(env, 2, 1, 2, "exp-42")).job_key == "torchrun-exp-42"
    slurm = NodeIdentity.detect(environ={**pytorchjob_pod("llama", "master", 0), "SLURM_JOB_ID": "77"})
    assert slurm.job_key == "slurm-77"
    mpi = NodeIdentity.detect(environ={**pytorchjob_pod("llama", "master", 0), "PMIX_NAMESPACE": "prterun-x@1"})
    assert mpi.job_key == "mpi-prterun-x@1"


def test_a_statefulset_pod_named_like_a_replica_is_no_pytorchjob():
    env = pod("train-worker-0", "n1", PET_NNODES="2", PET_MASTER_ADDR="train-leader-0.train")
    identity = KubernetesIdentity.detect(env)
    assert identity is not None and identity.job_kind is None


def test_a_trainjob_is_named_by_the_trainers_master_address():
    env = pod(
        "tj-node-0-1-k2x9q",
        "gpu-node-1",
        host="tj-node-0-1",
        JOB_COMPLETION_INDEX="1",
        PET_NNODES="2",
        PET_NPROC_PER_NODE="auto",
        PET_NODE_RANK="1",
        PET_MASTER_ADDR="tj-node-0-0.tj",
        PET_MASTER_PORT="29400",
    )
    assert owner(KubernetesIdentity.detect(env)) == ("TrainJob", "tj", "tj-node-0", "node", 1)
    node = NodeIdentity.detect(environ=env)
    assert (node.node_id, node.job_key) == ("node_1", f"k8s-{NAMESPACE}/trainjob/tj")


def jobset_pod(replicated: str, job_index: int, completion_index: int, **more: str) -> dict[str, str]:
    """A JobSet's pod: its Indexed child Job <jobset>-<replicated job>-<i>; JOBSET_NAME from the
    jobset.sigs.k8s.io/jobset-name annotation through the downward API."""
    host = f"pretrain-{replicated}-{job_index}-{completion_index}"
    return pod(
        f"{host}-h7m2c",
        f"gpu-node-{completion_index}",
        host=host,
        JOBSET_NAME="pretrain",
        JOB_COMPLETION_INDEX=str(completion_index),
        **more,
    )


def test_a_jobsets_pods_share_the_jobset_and_know_their_child_job():
    env = jobset_pod("workers", 1, 3)
    identity = KubernetesIdentity.detect(env)
    assert owner(identity) == ("JobSet", "pretrain", "pretrain-workers-1", "workers", 3)
    assert identity is not None
    assert identity.pod_attributes()["k8s.job.name"] == "pretrain-workers-1"  # per pod: not the run's
    assert "k8s.job.name" not in identity.job_attributes()
    # torchrun --nnodes=4 --node_rank=$JOB_COMPLETION_INDEX in every pod (JobSet's PyTorch example): one job.
    spanning = {**env, "GROUP_RANK": "3", "GROUP_WORLD_SIZE": "4", "RANK": "6", "LOCAL_RANK": "0"}
    assert NodeIdentity.detect(environ=spanning).job_key == f"k8s-{NAMESPACE}/jobset/pretrain"
    # One process per pod and nothing saying they are one world: a sweep, one run per pod.
    assert NodeIdentity.detect(environ=env).job_key is None and job_label(env) is None


def test_an_indexed_job_is_named_from_the_host_or_under_host_network_the_pod():
    env = pod("train-3-x7k2p", "gpu-node-3", host="train-3", JOB_COMPLETION_INDEX="3")
    host_network = {**env, "HOSTNAME": "gpu-node-3"}
    for environ in (env, host_network):
        identity = KubernetesIdentity.detect(environ)
        assert owner(identity) == ("Job", "train", "train", None, 3)
        assert identity is not None
        assert identity.job_attributes()["k8s.job.name"] == "train"
    spanning = {**env, "GROUP_RANK": "3", "GROUP_WORLD_SIZE": "4"}
    assert NodeIdentity.detect(environ=spanning).job_key == f"k8s-{NAMESPACE}/job/train"
    assert job_label(spanning) == "train"
    no_pod_name = {k: v for k, v in env.items() if k != "POD_NAME"}
    identity = KubernetesIdentity.detect(no_pod_name)
    assert identity is not None and identity.pod_name is None and identity.job_name == "train"


def test_the_run_tags_the_job_and_each_node_its_pod():
    node = NodeIdentity.detect(environ=pytorchjob_pod("llama", "worker", 0))
    tags = job_tags(node.world_size, node.node_count, {}, node_id=node.node_id, kubernetes=node.kubernetes)
    assert tags["k8s.namespace.name"] == NAMESPACE
    assert (tags["otel_forge.k8s.job.kind"], tags["otel_forge.k8s.job.name"]) == ("PyTorchJob", "llama")
    assert tags["otel_forge.node.node_1.k8s.pod.name"] == "llama-worker-0"
    assert tags["otel_forge.node.node_1.k8s.node.name"] == "gpu-node-1"
    assert "k8s.pod.name" not in tags  # the run is the job's: a pod's name is its node's
    alone = job_tags(1, None, {}, kubernetes=KubernetesIdentity("notebook-0", NAMESPACE, "gpu-node-3"))
    assert (alone["k8s.pod.name"], alone["k8s.node.name"]) == ("notebook-0", "gpu-node-3")


def test_the_resource_carries_the_pods_semantic_convention_attributes_and_the_users_win():
    node = NodeIdentity.detect(environ=jobset_pod("workers", 0, 1))
    attributes = build_resource(ForgeConfig.resolve(environ={}), node).attributes
    assert attributes["k8s.pod.name"] == "pretrain-workers-0-1-h7m2c"
    assert attributes["k8s.namespace.name"] == NAMESPACE and attributes["k8s.node.name"] == "gpu-node-1"
    assert attributes["k8s.job.name"] == "pretrain-workers-0"
    assert (attributes["otel_forge.k8s.job.kind"], attributes["otel_forge.k8s.job.name"]) == ("JobSet", "pretrain")
    # The OpenTelemetry Operator's OTEL_RESOURCE_ATTRIBUTES say it too: theirs win.
    config = ForgeConfig.resolve(environ={"OTEL_RESOURCE_ATTRIBUTES": "k8s.namespace.name=from-operator"})
    assert build_resource(config, node).attributes["k8s.namespace.name"] == "from-operator"


def test_the_identity_survives_the_json_a_run_plan_and_the_watchdog_carry():
    node = NodeIdentity.detect(environ=pytorchjob_pod("llama", "master", 0))
    assert NodeIdentity(**json.loads(json.dumps(dataclasses.asdict(node)))) == node


def test_the_inventory_and_doctor_say_which_pod_and_a_run_of_one_node_is_tagged_with_it():
    identity = KubernetesIdentity.detect(pytorchjob_pod("llama", "worker", 0))
    assert identity is not None
    inventory = node_inventory([], identity)
    assert inventory["kubernetes"]["pod_name"] == "llama-worker-0"
    assert json.loads(json.dumps(inventory))["kubernetes"]["replica_type"] == "worker"
    tags = inventory_tags(inventory)
    assert (tags["k8s.pod.name"], tags["otel_forge.k8s.job.name"]) == ("llama-worker-0", "llama")
    assert node_inventory([])["kubernetes"] is None and "k8s.pod.name" not in inventory_tags(node_inventory([]))
    assert identity.describe() == (
        f"pod llama-worker-0 in namespace {NAMESPACE} on node gpu-node-1; PyTorchJob llama (worker 0)"
    )


@dataclasses.dataclass
class _Run:
    run_id: str | None = "r1"
    experiment_id: str | None = "7"
    run_name: str | None = "train-llama"


def test_the_run_info_metric_names_the_pod_and_the_job():
    identity = KubernetesIdentity.detect(pytorchjob_pod("llama", "worker", 0))
    assert identity is not None
    readings = Readings()
    RunInfoCollector(lambda: [_Run()], "node_1", identity.attributes()).read(readings)
    [(attributes, value)] = readings.get("otel_forge.run.info")
    assert value == 1 and attributes["otel_forge.node.id"] == "node_1" and attributes["mlflow.run.id"] == "r1"
    assert attributes["k8s.pod.name"] == "llama-worker-0" and attributes["otel_forge.k8s.job.name"] == "llama"
    from otel_forge.names import METRICS

    [spec] = [spec for spec in METRICS if spec.name == "otel_forge.run.info"]
    assert set(attributes) <= set(spec.attributes)
    plain = Readings()
    RunInfoCollector(lambda: [_Run()], None).read(plain)
    assert not any(name.startswith("k8s.") for name, _ in plain.get("otel_forge.run.info")[0][0].items())
