"""What ``otel-forge run`` reads from a launcher's own command line (otel_forge/cli/launchers.py)."""

from __future__ import annotations

import ipaddress
import socket
import time

import psutil
import pytest

from otel_forge.cli.launchers import endpoint_host, is_this_host, read_launch
from otel_forge.config import ForgeConfig
from otel_forge.node import NodeIdentity, host_node_id


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


def _own_addresses(family: socket.AddressFamily) -> list[str]:
    """This machine's interface addresses of ``family``, loopback and link-local left out."""
    found = []
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family != family:
                continue
            address = ipaddress.ip_address(entry.address.split("%")[0])
            if not (address.is_loopback or address.is_link_local):
                found.append(str(address))
    return found


def _not_here() -> str:
    """A documentation address (TEST-NET) that no interface of this machine has."""
    here = set(_own_addresses(socket.AF_INET))
    return next(a for a in ("198.51.100.7", "203.0.113.9", "192.0.2.1") if a not in here)


def _elastic(endpoint: str) -> list[str]:
    return ["torchrun", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "train.py"]


@pytest.mark.parametrize("endpoint", ["127.0.0.1:29500", "[::1]:29500", "localhost:29500", "::1"])
def test_a_loopback_endpoint_is_this_host(endpoint):
    assert is_this_host(endpoint)


def test_an_endpoint_given_as_this_machines_address_makes_this_node_create_the_run():
    own = _own_addresses(socket.AF_INET)
    if not own:
        pytest.skip("no non-loopback IPv4 address on this machine")
    launch = read_launch(_elastic(f"{own[0]}:29500"))
    assert launch.environ["RANK"] == "0" and launch.host_named
    assert NodeIdentity.detect(environ=launch.environ, host_named=True).is_global_zero


def test_this_machines_ipv6_address_in_brackets_or_bare_is_this_host():
    own = _own_addresses(socket.AF_INET6)
    if not own:
        pytest.skip("no non-loopback IPv6 address on this machine")
    assert is_this_host(f"[{own[0]}]:29500") and is_this_host(f"[{own[0]}]") and is_this_host(own[0])


def test_an_address_of_another_machine_is_not_this_host():
    other = _not_here()
    launch = read_launch(_elastic(f"{other}:29500"))
    assert launch.environ["RANK"] == "-1"
    assert not NodeIdentity.detect(environ=launch.environ, host_named=True).is_global_zero
    assert not is_this_host("[2001:db8::7]:29500")  # IPv6 documentation prefix


def test_a_name_is_compared_by_the_addresses_it_resolves_to(monkeypatch):
    own = _own_addresses(socket.AF_INET)
    if not own:
        pytest.skip("no non-loopback IPv4 address on this machine")
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if host == "rdzv.example.test":  # this machine under another name (a DNS alias)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (own[0], 0))]
        if host == "elsewhere.example.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (_not_here(), 0))]
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    assert is_this_host("rdzv.example.test:29500")
    assert not is_this_host("elsewhere.example.test:29500")
    assert is_this_host(f"{socket.gethostname().upper()}:29500")  # host names are not case sensitive


def test_a_name_that_does_not_resolve_in_time_is_another_nodes(monkeypatch):
    real = socket.getaddrinfo

    def hung(host, *args, **kwargs):
        if host == "slow.example.test":
            time.sleep(5)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hung)
    started = time.monotonic()
    assert not is_this_host("slow.example.test:29500", timeout_s=0.2)
    assert time.monotonic() - started < 4
    assert not is_this_host("no-such-host.invalid:29500")


def test_the_wrapper_and_its_workers_agree_on_the_node_id_under_elastic_rendezvous():
    """The wrapper names the node by host name before the rendezvous; the workers, which would
    name it node_<GROUP_RANK> after it, inherit that name."""
    launch = read_launch(_elastic(f"{_not_here()}:29500"))
    wrapper = NodeIdentity.from_config(ForgeConfig.resolve(environ={}), launch.environ, host_named=launch.host_named)
    assert wrapper.node_id == host_node_id(socket.gethostname())
    cmd_environ = launch.cmd_environ(wrapper)
    assert cmd_environ == {"OTEL_FORGE_NODE_ID": wrapper.node_id}
    torchrun_sets = {"RANK": "3", "LOCAL_RANK": "1", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "4"}
    worker_environ = {**cmd_environ, **torchrun_sets}
    worker = NodeIdentity.from_config(ForgeConfig.resolve(environ=worker_environ), worker_environ)
    assert worker.node_id == wrapper.node_id and worker.sampling_key == wrapper.sampling_key
    assert worker.rank == 3


def test_only_torchrun_hands_its_node_id_down():
    node = NodeIdentity.detect("gpu-07", environ={})
    # mpirun's processes run on other hosts too: each names its own.
    assert read_launch(["mpirun", "-np", "16", "python", "t.py"]).cmd_environ(node) == {}
    assert read_launch(["python", "t.py"]).cmd_environ(node) == {}
    single = read_launch(["torchrun", "--nproc-per-node", "2", "t.py"])
    assert single.cmd_environ(NodeIdentity.detect(environ=single.environ)) == {}  # one node: no node id


@pytest.mark.parametrize(
    "command",
    [["torchrun", "--nproc-per-node", "2", "t.py"], ["torchrun", "--standalone", "--nproc_per_node=2", "t.py"]],
)
def test_single_node_torchrun_without_node_rank_creates_the_run(command):
    launch = read_launch(command)
    node = NodeIdentity.detect(environ=launch.environ, host_named=launch.host_named)
    assert node.is_global_zero and node.node_id is None and not launch.host_named


@pytest.mark.parametrize(
    ("endpoint", "host"),
    [
        ("10.1.2.3:29500", "10.1.2.3"),
        ("[fe80::1%eth0]:29500", "fe80::1%eth0"),
        ("[::1]", "::1"),
        ("fd00::2", "fd00::2"),
        ("node-7.cluster:29400", "node-7.cluster"),
        ("node-7", "node-7"),
    ],
)
def test_endpoint_host_reads_the_forms_torchrun_accepts(endpoint, host):
    assert endpoint_host(endpoint) == host


def test_torchrun_options_left_out_come_from_pet_variables_as_torchrun_reads_them():
    # torch.distributed.argparse_util.env: an option's default is PET_<DEST>; the command line wins.
    environ = {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "4", "PET_RDZV_ID": "j7"}
    node = NodeIdentity.detect(environ=read_launch(["torchrun", "train.py"], environ).environ)
    assert (node.node_id, node.rank, node.node_count, node.job_key) == ("node_1", 4, 2, "torchrun-j7")
    told = read_launch(["torchrun", "--node-rank", "0", "--rdzv-id=j8", "train.py"], environ)
    assert (told.environ["GROUP_RANK"], told.environ["TORCHELASTIC_RUN_ID"]) == ("0", "j8")
    assert read_launch(["torchrun", "train.py"], {}).environ["GROUP_WORLD_SIZE"] == "1"
