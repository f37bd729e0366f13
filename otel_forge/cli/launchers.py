"""What ``otel-forge run`` learns from a launcher it wraps, read from the launcher's own arguments.

``otel-forge run -- torchrun --nnodes 2 --node-rank 1 --rdzv-id job7 train.py`` runs on each node
before torchrun has set any variable: the node's place in the job is on torchrun's command line.
It is turned into the variables torchrun gives its workers, so ``NodeIdentity`` reads it as it
reads any launcher. What the command line leaves out, torchrun takes from ``PET_<OPTION>`` (as a
Kubeflow PyTorchJob's pods give it: ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_RDZV_ENDPOINT``), and
so do we. Under an MPI launcher the node ids are host names (MPI has no node index).

Elastic torchrun (no ``--node-rank``) hands node ranks out at rendezvous, after we start: the node
that hosts the rendezvous endpoint (named or given as an address) creates the run, and the node is
named by its host name, which CMD's workers inherit (``Launch.cmd_environ``) so that the wrapper
and its workers sample and log under one node id.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import psutil

from otel_forge.config import env_name

if TYPE_CHECKING:
    from otel_forge.node import NodeIdentity

_logger = logging.getLogger(__name__)

_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "mpiexec.hydra")
_PYTHON_LAUNCHERS = ("torchrun", "accelerate", "deepspeed")  # console scripts whose workers are Python
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_TORCHRUN_FLAGS = ("--standalone", "--no-python", "--no_python", "--module", "-m", "--run-path", "--run_path")
# A resolver that does not answer must not hold the job's start: past this, the endpoint is not ours.
_RESOLVE_TIMEOUT_S = 3.0

_T = TypeVar("_T")
_NONE: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Launch:
    """The launcher's view of this node: variables as its workers here will see them.

    ``workers_here``: the launcher starts its workers on this node (torchrun), so they must name
    the node as this process does (``cmd_environ``). ``rank_pending``: the node was not found to
    host the rendezvous, yet may hold global rank 0: its workers' ranks tell (``RankZeroWatch``).
    """

    environ: dict[str, str] = field(default_factory=dict)
    host_named: bool = False
    workers_here: bool = False
    rank_pending: bool = False  # whether this node holds global rank 0 is known only once its workers run

    def cmd_environ(self, node: NodeIdentity) -> dict[str, str]:
        """What CMD inherits so its workers on this node take this process's node id. Elastic
        torchrun's workers would name it ``node_<GROUP_RANK>`` after the rendezvous, while we
        named it before (by host name): two prefixes, two samplers for one node otherwise."""
        if not self.workers_here or node.node_id is None:
            return {}
        return {env_name("node_id"): node.node_id}


def runs_python(command: Sequence[str]) -> bool:
    """Whether CMD's processes that could use the run are Python (a Python program, or a launcher
    whose workers are): each starts with ``otel-forge run``'s bootstrap, which can tell it the run once
    the run is open. Any other program reads its environment at its start."""
    name = os.path.basename(command[0])
    if name in _PYTHON_LAUNCHERS or re.fullmatch(r"python[0-9.]*", name) or command[0] == sys.executable:
        return not any(flag in command for flag in ("--no-python", "--no_python"))  # torchrun's own
    return False


def _torchrun_args(command: Sequence[str]) -> list[str] | None:
    """torchrun's own arguments, or None when ``command`` does not run torchrun."""
    name = os.path.basename(command[0])
    if name == "torchrun":
        return list(command[1:])
    if name.startswith("python") and len(command) > 2 and command[1] == "-m" and command[2] in _TORCHRUN_MODULES:
        return list(command[3:])
    return None


def _torchrun_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)

    def option(*names: str, dest: str, default: str | None = None) -> None:
        # torchrun's own default for an option left out: PET_<DEST> (torch.distributed.argparse_util.env).
        parser.add_argument(*names, dest=dest, default=environ.get(f"PET_{dest.upper()}") or default)

    # Both spellings, as torchrun accepts them.
    option("--nnodes", dest="nnodes", default="1")
    option("--node-rank", "--node_rank", dest="node_rank")
    option("--rdzv-id", "--rdzv_id", dest="rdzv_id")
    option("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1")
    option("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint")
    option("--master-addr", "--master_addr", dest="master_addr")
    return parser


def _max_nodes(text: str) -> int:
    """``--nnodes 2`` or an elastic ``1:4`` (the most it may span)."""
    try:
        return int(text.split(":")[-1])
    except ValueError:
        return 1


def endpoint_host(endpoint: str) -> str:
    """The host of a rendezvous endpoint, as torchrun reads it: ``host:port``, ``[v6]:port``,
    ``[v6]``, ``host``; a bare IPv6 address (no port) is taken whole."""
    text = endpoint.strip()
    if text.startswith("["):
        return text[1:].split("]", 1)[0]
    if _address(text) is not None:  # "fd00::2": its last group is not a port
        return text
    return text.rsplit(":", 1)[0]


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as an IP address (an IPv6 zone ``%eth0`` dropped), or None for a name."""
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _bounded(call: Callable[[], _T], default: _T, timeout_s: float) -> _T:
    """``call()``, or ``default`` when it fails or does not return within ``timeout_s`` (a daemon
    thread: a hung resolver neither holds the start nor the exit)."""
    result: list[_T] = []

    def run() -> None:
        try:
            result.append(call())
        except (OSError, UnicodeError, ValueError) as error:
            _logger.debug("name lookup failed: %s", error)

    thread = threading.Thread(target=run, name="otel-forge-resolve", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return result[0] if result else default


def _resolved(host: str) -> frozenset[str]:
    """The addresses ``host`` resolves to (empty if it does not)."""
    found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return frozenset(str(address) for info in found if (address := _address(str(info[4][0]))) is not None)


def _local_addresses() -> frozenset[str]:
    """This machine's addresses: its interfaces', and those its host name resolves to (a name
    mapped to 127.0.1.1 in /etc/hosts, as Debian does)."""
    addresses = frozenset(
        str(address)
        for entries in psutil.net_if_addrs().values()
        for entry in entries
        if entry.family in (socket.AF_INET, socket.AF_INET6) and (address := _address(entry.address)) is not None
    )
    return addresses | _bounded(lambda: _resolved(socket.gethostname()), _NONE, _RESOLVE_TIMEOUT_S)


def _host_names() -> set[str]:
    """This machine's names, lower case (host names are not case sensitive)."""
    hostname = socket.gethostname()
    fqdn = _bounded(socket.getfqdn, hostname, _RESOLVE_TIMEOUT_S)
    return {name.lower() for name in (hostname, hostname.split(".")[0], fqdn)}


def is_this_host(endpoint: str | None, timeout_s: float = _RESOLVE_TIMEOUT_S) -> bool:
    """Whether the rendezvous endpoint is on this machine: by name (this host's, ``localhost``),
    or by address (the endpoint's, or those its name resolves to, among this machine's). No
    endpoint is torchrun's default, ``localhost``. A name that does not resolve in time: not here."""
    host = endpoint_host(endpoint) if endpoint and endpoint.strip() else "localhost"
    if host in _LOCAL_HOSTS or host.lower() in _host_names():
        return True
    address = _address(host)
    wanted = frozenset({str(address)}) if address is not None else _bounded(lambda: _resolved(host), _NONE, timeout_s)
    if not wanted:
        _logger.info("rendezvous endpoint %s: %s did not resolve; taken as another node's", endpoint, host)
    return bool(wanted & _local_addresses())


def _torchrun_launch(args: list[str], process_environ: Mapping[str, str]) -> Launch:
    known, _ = _torchrun_parser(process_environ).parse_known_args(_before_script(args))
    nodes = _max_nodes(known.nnodes)
    environ = {"LOCAL_RANK": "0", "GROUP_WORLD_SIZE": str(nodes)}
    if known.rdzv_id:
        environ["TORCHELASTIC_RUN_ID"] = known.rdzv_id
    if known.node_rank is not None:
        environ["GROUP_RANK"] = known.node_rank
        try:
            per_node = int(known.nproc_per_node)
        except ValueError:  # "gpu", "auto": only rank 0's node matters here
            per_node = 1
        environ["RANK"] = str(int(known.node_rank) * per_node)
        return Launch(environ, workers_here=True)
    if nodes == 1:  # one node (--standalone, or no --nnodes): it is rank 0's
        environ["RANK"] = "0"
        return Launch(environ, workers_here=True)
    # Node ranks are handed out at rendezvous: the rendezvous host's node creates the run; any
    # other rank number (none is known yet) makes this node one that finds it.
    here = is_this_host(known.rdzv_endpoint or known.master_addr)
    environ["RANK"] = "0" if here else "-1"
    # Not here by name or address may still be here (a service address, NAT): rank 0 once known.
    return Launch(environ, host_named=True, workers_here=True, rank_pending=not here)


def _before_script(args: list[str]) -> list[str]:
    """torchrun's options end at the training script (its own options may reuse the names)."""
    for index, arg in enumerate(args):
        previous = args[index - 1] if index else ""
        takes_value = previous.startswith("-") and "=" not in previous and previous not in _TORCHRUN_FLAGS
        if not arg.startswith("-") and not takes_value:
            return args[:index]
    return args


def read_launch(command: Sequence[str], environ: Mapping[str, str] | None = None) -> Launch:
    """What the launcher in ``command`` (torchrun, an MPI launcher) says of this node; empty otherwise.
    ``environ``: where torchrun would find what its command line leaves out (this process's)."""
    if (torchrun := _torchrun_args(command)) is not None:
        return _torchrun_launch(torchrun, os.environ if environ is None else environ)
    if os.path.basename(command[0]) in _MPI_LAUNCHERS:
        return Launch(host_named=True)
    return Launch()
