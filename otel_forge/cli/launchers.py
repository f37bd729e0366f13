"""What ``otel-forge run`` learns from a launcher it wraps, read from the launcher's own arguments.

``otel-forge run -- torchrun --nnodes 2 --node-rank 1 --rdzv-id job7 train.py`` runs on each node
before torchrun has set any variable: the node's place in the job is on torchrun's command line.
It is turned into the variables torchrun gives its workers, so ``NodeIdentity`` reads it as it
reads any launcher. Under an MPI launcher the node ids are host names (MPI has no node index).
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field

_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_MPI_LAUNCHERS = ("mpirun", "mpiexec", "orterun", "prterun", "mpiexec.hydra")
_LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
_TORCHRUN_FLAGS = ("--standalone", "--no-python", "--no_python", "--module", "-m", "--run-path", "--run_path")


@dataclass(frozen=True)
class Launch:
    """The launcher's view of this node: variables as its workers here will see them."""

    environ: dict[str, str] = field(default_factory=dict)
    host_named: bool = False


def _torchrun_args(command: Sequence[str]) -> list[str] | None:
    """torchrun's own arguments, or None when ``command`` does not run torchrun."""
    name = os.path.basename(command[0])
    if name == "torchrun":
        return list(command[1:])
    if name.startswith("python") and len(command) > 2 and command[1] == "-m" and command[2] in _TORCHRUN_MODULES:
        return list(command[3:])
    return None


def _torchrun_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    # Both spellings, as torchrun accepts them.
    parser.add_argument("--nnodes", "--nnodes", default="1")
    parser.add_argument("--node-rank", "--node_rank", dest="node_rank")
    parser.add_argument("--rdzv-id", "--rdzv_id", dest="rdzv_id")
    parser.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", default="1")
    parser.add_argument("--rdzv-endpoint", "--rdzv_endpoint", dest="rdzv_endpoint")
    parser.add_argument("--master-addr", "--master_addr", dest="master_addr")
    return parser


def _max_nodes(text: str) -> int:
    """``--nnodes 2`` or an elastic ``1:4`` (the most it may span)."""
    try:
        return int(text.split(":")[-1])
    except ValueError:
        return 1


def _is_this_host(endpoint: str | None) -> bool:
    host = (endpoint or "").rsplit(":", 1)[0].strip("[]")
    return (
        host in _LOCAL_HOSTS
        or host in (socket.gethostname(), socket.getfqdn())
        or host == socket.gethostname().split(".")[0]
    )


def _torchrun_launch(args: list[str]) -> Launch:
    known, _ = _torchrun_parser().parse_known_args(_before_script(args))
    environ = {"LOCAL_RANK": "0", "GROUP_WORLD_SIZE": str(_max_nodes(known.nnodes))}
    if known.rdzv_id:
        environ["TORCHELASTIC_RUN_ID"] = known.rdzv_id
    if known.node_rank is not None:
        environ["GROUP_RANK"] = known.node_rank
        try:
            per_node = int(known.nproc_per_node)
        except ValueError:  # "gpu", "auto": only rank 0's node matters here
            per_node = 1
        environ["RANK"] = str(int(known.node_rank) * per_node)
        return Launch(environ)
    # Node ranks are handed out at rendezvous: the rendezvous host's node creates the run; any
    # other rank number (none is known yet) makes this node one that finds it.
    environ["RANK"] = "0" if _is_this_host(known.rdzv_endpoint or known.master_addr) else "-1"
    return Launch(environ, host_named=_max_nodes(known.nnodes) > 1)


def _before_script(args: list[str]) -> list[str]:
    """torchrun's options end at the training script (its own options may reuse the names)."""
    for index, arg in enumerate(args):
        previous = args[index - 1] if index else ""
        takes_value = previous.startswith("-") and "=" not in previous and previous not in _TORCHRUN_FLAGS
        if not arg.startswith("-") and not takes_value:
            return args[:index]
    return args


def read_launch(command: Sequence[str]) -> Launch:
    """What the launcher in ``command`` (torchrun, an MPI launcher) says of this node; empty otherwise."""
    if (torchrun := _torchrun_args(command)) is not None:
        return _torchrun_launch(torchrun)
    if os.path.basename(command[0]) in _MPI_LAUNCHERS:
        return Launch(host_named=True)
    return Launch()
