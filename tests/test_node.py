from pathlib import Path

import pytest

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.run_metadata import job_tags, node_host_tags
from otel_forge.node import NODE_ID_ATTRIBUTE, NodeIdentity, build_resource, job_label, torchrun_attempt


def test_plain_process_has_no_node_id_and_runs_the_agent():
    node = NodeIdentity.detect(environ={})
    assert node.node_id is None and node.rank is None
    assert node.runs_agent and node.is_global_zero


def test_torchrun_multi_node():
    env = {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    node = NodeIdentity.detect(environ=env)
    assert (node.rank, node.local_rank, node.world_size) == (9, 1, 16)
    assert node.node_id == "node_1"
    assert not node.runs_agent and not node.is_global_zero


def test_slurm_multi_node_local_zero_runs_the_agent():
    env = {
        "SLURM_PROCID": "8",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "16",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
    }
    node = NodeIdentity.detect(environ=env)
    assert node.node_id == "node_1" and node.runs_agent and node.rank == 8


def test_mpi_ranks():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    node = NodeIdentity.detect(environ=env)
    assert (node.rank, node.local_rank, node.world_size) == (3, 3, 4)
    assert node.node_id is None  # a single node: keys stay system/<key>


def test_single_node_job_has_no_derived_node_id_but_explicit_wins():
    env = {"SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1"}
    assert NodeIdentity.detect(environ=env).node_id is None
    assert NodeIdentity.detect("gpu-box-7", environ=env).node_id == "gpu-box-7"


def test_resource_carries_service_host_node_and_user_attributes(monkeypatch):
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "")
    config = ForgeConfig.resolve(
        environ={"OTEL_RESOURCE_ATTRIBUTES": "team=ml,service.name=ignored", "OTEL_SERVICE_NAME": "trainer"}
    )
    node = NodeIdentity.detect("node_2", environ={})
    attributes = build_resource(config, node).attributes
    assert attributes["service.name"] == "trainer"
    assert attributes["host.name"] == node.hostname
    assert attributes[NODE_ID_ATTRIBUTE] == "node_2"
    assert attributes["team"] == "ml"
    machine_id = Path("/etc/machine-id")
    if machine_id.exists():
        assert attributes["host.id"] == machine_id.read_text().strip()


def test_default_service_name():
    resource = build_resource(ForgeConfig.resolve(environ={}), NodeIdentity.detect(environ={}))
    assert resource.attributes["service.name"] == "otel-forge"
    assert NODE_ID_ATTRIBUTE not in resource.attributes


def test_job_key_and_its_source_per_launcher():
    cases = {
        "slurm": (
            {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "3"},
            "slurm-4242.3",
            "launcher SLURM_JOB_ID, SLURM_STEP_ID",
        ),
        "slurm batch": ({"SLURM_JOB_ID": "4242"}, "slurm-4242", "launcher SLURM_JOB_ID"),
        "torchrun": ({"TORCHELASTIC_RUN_ID": "exp7"}, "torchrun-exp7", "launcher TORCHELASTIC_RUN_ID"),
        "open mpi 5": ({"PMIX_NAMESPACE": "prterun-a-1@1"}, "mpi-prterun-a-1@1", "launcher PMIX_NAMESPACE"),
        "open mpi 4": ({"OMPI_MCA_ess_base_jobid": "39"}, "mpi-39", "launcher OMPI_MCA_ess_base_jobid"),
    }
    for name, (environ, key, source) in cases.items():
        node = NodeIdentity.detect(environ=environ)
        assert (node.job_key, node.job_key_source) == (key, source), name


def test_torchrun_default_rendezvous_id_names_no_job():
    # torchrun's default --rdzv-id is "none", shared by every job that did not set one.
    assert NodeIdentity.detect(environ={"TORCHELASTIC_RUN_ID": "none"}).job_key is None


def test_explicit_job_id_and_node_id_win_with_their_source():
    config = ForgeConfig.resolve(environ={"OTEL_FORGE_JOB_ID": "nightly-7", "OTEL_FORGE_NODE_ID": "rack3"})
    node = NodeIdentity.from_config(
        config, environ={"SLURM_JOB_ID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2"}
    )
    assert (node.job_key, node.job_key_source) == ("nightly-7", "env OTEL_FORGE_JOB_ID")
    assert (node.node_id, node.node_id_source) == ("rack3", "env OTEL_FORGE_NODE_ID")


def test_mpi_across_hosts_names_the_node_by_its_host(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-07.cluster.example")
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    node = NodeIdentity.detect(environ=env)
    assert (node.node_id, node.node_id_source) == ("gpu-07", "host name (MPI: no node index)")
    assert node.sampling_key == "gpu-07.cluster.example/gpu-07"


def test_node_id_source_names_the_launcher_variable():
    node = NodeIdentity.detect(environ={"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"})
    assert (node.node_id, node.node_id_source) == ("node_1", "launcher GROUP_RANK")


@pytest.mark.parametrize(
    ("environ", "label"),
    [
        ({"SLURM_JOB_ID": "1239", "SLURM_ARRAY_JOB_ID": "1234", "SLURM_ARRAY_TASK_ID": "5"}, "slurm-1234_5"),
        ({"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "0"}, "slurm-1234"),
        ({"SLURM_JOBID": "77"}, "slurm-77"),
        ({"TORCHELASTIC_RUN_ID": "exp7", "TORCHELASTIC_RESTART_COUNT": "1"}, "torchrun-exp7"),
        ({"TORCHELASTIC_RUN_ID": "none"}, None),  # torchrun's default: every job's
        ({"PMIX_NAMESPACE": "prterun-a-1@1"}, None),
        ({}, None),
    ],
)
def test_job_label_names_the_job_for_people(environ, label):
    assert job_label(environ) == label


def test_torchrun_attempt_says_whether_restarts_remain_and_whether_this_is_a_retry():
    first = torchrun_attempt({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "1"})
    last = torchrun_attempt({"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_MAX_RESTARTS": "1"})
    no_restarts = torchrun_attempt({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0"})
    assert first is not None and first.restarts_remain and not first.is_retry
    assert last is not None and not last.restarts_remain and last.is_retry
    assert no_restarts is not None and not no_restarts.restarts_remain
    assert torchrun_attempt({"SLURM_RESTART_COUNT": "2"}) is None


def test_job_tags_record_the_slurm_array_requeues_torchrun_restarts_and_the_nodes_host():
    environ = {
        "SLURM_JOB_ID": "1239",
        "SLURM_ARRAY_JOB_ID": "1234",
        "SLURM_ARRAY_TASK_ID": "5",
        "SLURM_RESTART_COUNT": "2",
        "TORCHELASTIC_RESTART_COUNT": "1",
    }
    tags = job_tags(8, 2, environ, node_id="node_1")
    assert tags["otel_forge.slurm.array_job_id"] == "1234"
    assert tags["otel_forge.slurm.array_task_id"] == "5"
    assert tags["otel_forge.slurm.restart_count"] == "2"
    assert tags["otel_forge.torchrun.restart_count"] == "1"
    assert tags["otel_forge.node.node_1.host"] == tags["host"]
    assert not any(key.startswith(("otel_forge.slurm.", "otel_forge.torchrun.")) for key in job_tags(1, 1, {}))
    assert node_host_tags("gpu-07", "gpu-07.cluster") == {"otel_forge.node.gpu-07.host": "gpu-07.cluster"}
