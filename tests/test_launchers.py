"""What ``otel-forge run`` reads from a launcher's own command line (otel_forge/cli/launchers.py)."""

from __future__ import annotations

import socket

import pytest

from otel_forge.cli.launchers import read_launch
from otel_forge.node import NodeIdentity


@pytest.mark.parametrize(
    "command",
    [
        ["torchrun", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "4", "--rdzv-id", "j7", "train.py"],
        ["torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--rdzv_id=j7", "train.py", "--nnodes", "9"],
        [
            "/venv/bin/python3",
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            "1",
            "--nproc-per-node",
            "4",
            "--rdzv-id",
            "j7",
            "train.py",
        ],
    ],
)
def test_torchrun_arguments_give_the_node_and_the_job(command):
    launch = read_launch(command)
    node = NodeIdentity.detect(environ=launch.environ)
    assert (node.node_id, node.rank, node.local_rank, node.job_key) == ("node_1", 4, 0, "torchrun-j7")
    assert not node.is_global_zero and node.runs_agent


def test_torchrun_on_the_first_node_creates_the_run():
    launch = read_launch(["torchrun", "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "gpu", "t.py"])
    node = NodeIdentity.detect(environ=launch.environ)
    assert node.is_global_zero and node.node_id == "node_0" and node.job_key is None


def test_elastic_torchrun_without_node_rank_uses_host_names_and_the_rendezvous_host_creates():
    here = read_launch(
        ["torchrun", "--nnodes", "1:4", "--rdzv-endpoint", f"{socket.gethostname()}:29400", "--standalone", "t.py"]
    )
    there = read_launch(["torchrun", "--nnodes", "1:4", "--rdzv-endpoint", "other-host.invalid:29400", "t.py"])
    assert here.host_named and NodeIdentity.detect(environ=here.environ, host_named=True).is_global_zero
    assert not NodeIdentity.detect(environ=there.environ, host_named=True).is_global_zero


def test_mpi_launchers_name_nodes_by_host_and_others_add_nothing():
    assert read_launch(["mpirun", "-np", "16", "python", "t.py"]).host_named
    assert read_launch(["/opt/ompi/bin/mpiexec", "python", "t.py"]).host_named
    assert read_launch(["python", "t.py"]) == read_launch(["srun", "python", "t.py"])
    assert read_launch(["python", "t.py"]).environ == {}
