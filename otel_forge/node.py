"""Who am I: node id and ranks from the launcher (SLURM, torchrun, MPI), and the OTel Resource."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

    from otel_forge.config import ForgeConfig

# Launcher variables, most specific first. torchrun sets RANK/LOCAL_RANK/GROUP_RANK; SLURM its
# own; Open MPI, MPICH/PMI and Intel MPI theirs.
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                    "PALS_LOCAL_RANKID")
_WORLD_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
_NODE_RANK_VARS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
_NODE_COUNT_VARS = ("GROUP_WORLD_SIZE", "NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")

NODE_ID_ATTRIBUTE = "otel_forge.node.id"


def _first_int(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        try:
            return int(environ[name])
        except (KeyError, ValueError):
            continue
    return None


@dataclass(frozen=True)
class NodeIdentity:
    """This process's place in the job. Unknown values are None (a plain, single process)."""

    node_id: str | None
    rank: int | None
    local_rank: int | None
    world_size: int | None
    node_rank: int | None
    node_count: int | None
    hostname: str

    @classmethod
    def detect(cls, explicit_node_id: str | None = None, environ: Mapping[str, str] | None = None) -> NodeIdentity:
        """Read the launcher's variables; ``explicit_node_id`` (already resolved from config) wins."""
        environ = os.environ if environ is None else environ
        node_rank = _first_int(environ, _NODE_RANK_VARS)
        node_count = _first_int(environ, _NODE_COUNT_VARS)
        node_id = explicit_node_id
        if node_id is None and node_rank is not None and (node_count or 0) > 1:
            node_id = f"node_{node_rank}"
        return cls(
            node_id=node_id,
            rank=_first_int(environ, _RANK_VARS),
            local_rank=_first_int(environ, _LOCAL_RANK_VARS),
            world_size=_first_int(environ, _WORLD_SIZE_VARS),
            node_rank=node_rank,
            node_count=node_count,
            hostname=socket.gethostname(),
        )

    @property
    def runs_agent(self) -> bool:
        """One agent per node: only local rank 0 (or a process outside any launcher) samples."""
        return self.local_rank in (None, 0)

    @property
    def is_global_zero(self) -> bool:
        return self.rank in (None, 0)


def host_id() -> str | None:
    """The machine id (semconv ``host.id`` on Linux), or None where there is none."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text:
            return text
    return None


def build_resource(config: ForgeConfig, node: NodeIdentity) -> Resource:
    """The OTel Resource of this agent: service, host, node id, then ``OTEL_RESOURCE_ATTRIBUTES``."""
    from opentelemetry.sdk.resources import Resource

    # One agent per node: the host names the instance, so a restarted agent continues its series
    # (the SDK's default is a new UUID per process).
    attributes: dict[str, str] = {"service.name": config.service_name, "service.instance.id": node.hostname,
                                  "host.name": node.hostname}
    if (machine_id := host_id()) is not None:
        attributes["host.id"] = machine_id
    if node.node_id is not None:
        attributes[NODE_ID_ATTRIBUTE] = node.node_id
    attributes.update(config.resource_attributes)
    if config.sources.get("service_name", "default") != "default":
        # The spec: OTEL_SERVICE_NAME wins over a service.name in OTEL_RESOURCE_ATTRIBUTES.
        attributes["service.name"] = config.service_name
    # Resource.create adds the SDK's telemetry.sdk.* attributes.
    return Resource.create(attributes)
