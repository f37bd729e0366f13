"""Who am I: node id and ranks from the launcher (SLURM, torchrun, MPI), the job on Kubernetes, and
the OTel Resource."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from otel_forge.config import ARGUMENT_SOURCE, Source
from otel_forge.kubernetes import KubernetesIdentity

if TYPE_CHECKING:
    from opentelemetry.sdk.resources import Resource

    from otel_forge.config import ForgeConfig

# Launcher variables, most specific first. torchrun sets RANK/LOCAL_RANK/GROUP_RANK; SLURM its
# own; Open MPI, MPICH/PMI and Intel MPI theirs.
_RANK_VARS = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PALS_LOCAL_RANKID")
_WORLD_SIZE_VARS = ("WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
# Last: the Kubeflow PyTorchJob operator's (and Trainer's) for torchrun, in the pod's own environment
# (pkg/controller.v1/pytorch/envvar.go): the pod's node rank (its RANK there) and the node count.
_NODE_RANK_VARS = ("GROUP_RANK", "NODE_RANK", "SLURM_NODEID", "PET_NODE_RANK")
_NODE_COUNT_VARS = ("GROUP_WORLD_SIZE", "NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "PET_NNODES")
# MPI has no node index; its processes per host tell whether the job spans hosts.
_MPI_LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
# The MPI job's identity: the PMIx namespace (Open MPI 4/5, PRRTE), else Open MPI 4's job id.
_MPI_JOB_VARS = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid")
# torchrun's rendezvous id; "none" is torchrun's default, shared by every job that did not set one.
_TORCHRUN_UNSET_RUN_ID = "none"
# torchrun's attempt, in its workers: this attempt's restart count (0 first), and the most it makes.
TORCHRUN_RESTART_COUNT_VAR = "TORCHELASTIC_RESTART_COUNT"
TORCHRUN_MAX_RESTARTS_VAR = "TORCHELASTIC_MAX_RESTARTS"
# A SLURM array task: the array's job id and this task's index (each task has a job id of its own).
SLURM_ARRAY_JOB_VAR = "SLURM_ARRAY_JOB_ID"
SLURM_ARRAY_TASK_VAR = "SLURM_ARRAY_TASK_ID"

NODE_ID_ATTRIBUTE = "otel_forge.node.id"
UNKNOWN = "none"


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    """(variable, value) of the first of ``names`` set to a non-empty value."""
    for name in names:
        if value := environ.get(name, "").strip():
            return name, value
    return None


def _first_int(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        try:
            return int(environ[name])
        except (KeyError, ValueError):
            continue
    return None


def process_ranks(environ: Mapping[str, str]) -> tuple[int | None, int | None, int | None]:
    """This process's global rank, local rank and world size as its launcher gave them (None: not given)."""
    return _first_int(environ, _RANK_VARS), _first_int(environ, _LOCAL_RANK_VARS), _first_int(environ, _WORLD_SIZE_VARS)


def is_first_process(environ: Mapping[str, str] | None = None) -> bool:
    """Global rank 0 of the job, or a process outside any launcher; read from the variables alone (no
    ``NodeIdentity``). Lightning's DDP gives the ranks it starts ``LOCAL_RANK`` only, so that counts too."""
    environ = os.environ if environ is None else environ
    return _first_int(environ, _RANK_VARS) in (None, 0) and _first_int(environ, _LOCAL_RANK_VARS) in (None, 0)


def host_node_id(hostname: str) -> str:
    """A node id from a host name (``gpu-07.cluster.local`` -> ``gpu-07``): stable, key-safe."""
    short = hostname.split(".")[0] or hostname
    return re.sub(r"[^\w\-]+", "_", short).strip("_") or "host"


def _derived_node_id(
    environ: Mapping[str, str],
    node_rank: int | None,
    node_count: int | None,
    world_size: int | None,
    hostname: str,
    host_named: bool,
) -> tuple[str | None, str]:
    """The launcher's node id and the variables it came from; None on a single node."""
    if node_rank is not None and (node_count or 0) > 1:
        source = next(name for name in _NODE_RANK_VARS if _first_int(environ, (name,)) is not None)
        return f"node_{node_rank}", f"launcher {source}"
    local_size = _first_int(environ, _MPI_LOCAL_SIZE_VARS)
    if host_named or (local_size is not None and world_size is not None and world_size > local_size):
        return host_node_id(hostname), "host name (MPI: no node index)"
    return None, UNKNOWN


def job_key(environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The job every process of one launch shares, and the variables it came from.

    SLURM: job id and step (a requeued job keeps both); torchrun: the rendezvous id; MPI: the
    PMIx namespace or Open MPI's job id; Kubernetes: the namespace and name of the job that owns the
    pods, when they make one distributed job. None outside a launcher that names its job.
    """
    return _job_key(environ, KubernetesIdentity.detect(environ), _first_int(environ, _NODE_COUNT_VARS))


def _kubernetes_job(kubernetes: KubernetesIdentity | None, node_count: int | None) -> KubernetesIdentity | None:
    """The pod's owning job when its pods are one distributed job: by the controller's design (a
    PyTorchJob, a TrainJob), or as the launcher says (it spans nodes). An Indexed Job or a JobSet of
    single-pod tasks (a sweep: one run each) shares no run."""
    if kubernetes is None or kubernetes.job_key is None:
        return None
    return kubernetes if kubernetes.is_distributed or (node_count or 0) > 1 else None


def _job_key(
    environ: Mapping[str, str], kubernetes: KubernetesIdentity | None, node_count: int | None
) -> tuple[str | None, str]:
    # Most specific first. Each launcher's id names one launch, shared by every process it starts:
    # SLURM's job and step (also when slurmd runs in pods), torchrun's rendezvous id when the user
    # set one, the MPI job's (an MPIJob's ranks run in pods whose env the launcher pod's is not). The
    # owning Kubernetes job comes last: coarser (a name can be used again by a later job) and only
    # needed when the launcher names none that all pods share, as torchrun's static rendezvous under a
    # PyTorchJob ("none").
    if slurm := _first(environ, ("SLURM_JOB_ID", "SLURM_JOBID")):
        if step := _first(environ, ("SLURM_STEP_ID", "SLURM_STEPID")):
            return f"slurm-{slurm[1]}.{step[1]}", f"launcher {slurm[0]}, {step[0]}"
        return f"slurm-{slurm[1]}", f"launcher {slurm[0]}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != _TORCHRUN_UNSET_RUN_ID:
        return f"torchrun-{run_id}", "launcher TORCHELASTIC_RUN_ID"
    if mpi := _first(environ, _MPI_JOB_VARS):
        return f"mpi-{mpi[1]}", f"launcher {mpi[0]}"
    if (job := _kubernetes_job(kubernetes, node_count)) is not None:
        return job.job_key, f"kubernetes {job.job_source}"
    return None, UNKNOWN


def job_label(environ: Mapping[str, str] | None = None) -> str | None:
    """A short name of the job for people (a default run name): ``slurm-1234_5`` for task 5 of
    array job 1234 (SLURM's own spelling), ``slurm-1234``, ``torchrun-<rendezvous id>``, the name
    of the Kubernetes job whose pods share a run; None outside a launcher that names its job."""
    environ = os.environ if environ is None else environ
    array = _first(environ, (SLURM_ARRAY_JOB_VAR,))
    task = _first(environ, (SLURM_ARRAY_TASK_VAR,))
    if array and task:
        return f"slurm-{array[1]}_{task[1]}"
    if slurm := _first(environ, ("SLURM_JOB_ID", "SLURM_JOBID")):
        return f"slurm-{slurm[1]}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id and run_id != _TORCHRUN_UNSET_RUN_ID:
        return f"torchrun-{run_id}"
    if _first(environ, _MPI_JOB_VARS) is None:
        job = _kubernetes_job(KubernetesIdentity.detect(environ), _first_int(environ, _NODE_COUNT_VARS))
        return job.job_name if job is not None else None
    return None


@dataclass(frozen=True)
class TorchrunAttempt:
    """Which attempt of a torchrun job this worker belongs to (``--max-restarts``)."""

    restart_count: int
    max_restarts: int

    @property
    def restarts_remain(self) -> bool:
        """torchrun restarts every worker once one fails: an end now is not the job's end."""
        return self.restart_count < self.max_restarts

    @property
    def is_retry(self) -> bool:
        """A later attempt: it logs its steps again (from 0, or from its checkpoint)."""
        return self.restart_count > 0


def torchrun_attempt(environ: Mapping[str, str] | None = None) -> TorchrunAttempt | None:
    """The torchrun attempt of this process, or None outside a torchrun worker."""
    environ = os.environ if environ is None else environ
    count = _first_int(environ, (TORCHRUN_RESTART_COUNT_VAR,))
    if count is None:
        return None
    return TorchrunAttempt(count, _first_int(environ, (TORCHRUN_MAX_RESTARTS_VAR,)) or 0)


@dataclass(frozen=True)
class NodeIdentity:
    """This process's place in the job. Unknown values are None (a plain, single process);
    ``kubernetes``: the pod's identity, None outside Kubernetes."""

    node_id: str | None
    rank: int | None
    local_rank: int | None
    world_size: int | None
    node_rank: int | None
    node_count: int | None
    hostname: str
    job_key: str | None = None
    node_id_source: str = UNKNOWN
    job_key_source: str = UNKNOWN
    kubernetes: KubernetesIdentity | None = None

    def __post_init__(self) -> None:
        # Rebuilt from JSON (a run's plan, the watchdog's argument): the pod's identity is a dict there.
        if isinstance(self.kubernetes, Mapping):
            object.__setattr__(self, "kubernetes", KubernetesIdentity(**self.kubernetes))

    @classmethod
    def detect(
        cls,
        explicit_node_id: str | None = None,
        environ: Mapping[str, str] | None = None,
        *,
        explicit_job_id: str | None = None,
        sources: Mapping[str, Source] | None = None,
        host_named: bool = False,
    ) -> NodeIdentity:
        """Read the launcher's variables; explicit ids (already resolved from config) win.

        ``sources`` says where the explicit values came from (``ForgeConfig.sources``);
        ``host_named``: node ids are host names, as under an MPI launcher.
        """
        environ = os.environ if environ is None else environ
        sources = sources or {}
        hostname = socket.gethostname()
        node_rank = _first_int(environ, _NODE_RANK_VARS)
        node_count = _first_int(environ, _NODE_COUNT_VARS)
        world_size = _first_int(environ, _WORLD_SIZE_VARS)
        kubernetes = KubernetesIdentity.detect(environ)
        node_id: str | None
        key: str | None
        if explicit_node_id is not None:
            node_id, node_id_source = explicit_node_id, str(sources.get("node_id", ARGUMENT_SOURCE))
        else:
            node_id, node_id_source = _derived_node_id(environ, node_rank, node_count, world_size, hostname, host_named)
        if explicit_job_id is not None:
            key, key_source = explicit_job_id, str(sources.get("job_id", ARGUMENT_SOURCE))
        else:
            key, key_source = _job_key(environ, kubernetes, node_count)
        return cls(
            node_id=node_id,
            rank=_first_int(environ, _RANK_VARS),
            local_rank=_first_int(environ, _LOCAL_RANK_VARS),
            world_size=world_size,
            node_rank=node_rank,
            node_count=node_count,
            hostname=hostname,
            job_key=key,
            node_id_source=node_id_source,
            job_key_source=key_source,
            kubernetes=kubernetes,
        )

    @classmethod
    def from_config(
        cls, config: ForgeConfig, environ: Mapping[str, str] | None = None, host_named: bool = False
    ) -> NodeIdentity:
        return cls.detect(
            config.node_id, environ, explicit_job_id=config.job_id, sources=config.sources, host_named=host_named
        )

    @property
    def runs_agent(self) -> bool:
        """One agent per node: only local rank 0 (or a process outside any launcher) samples."""
        return self.local_rank in (None, 0)

    @property
    def is_global_zero(self) -> bool:
        return self.rank in (None, 0)

    @property
    def sampling_key(self) -> str:
        """What names this node's sampler: the host and the node id (one host may simulate many)."""
        return f"{self.hostname}/{self.node_id or ''}"


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
    """The OTel Resource of this agent: service, host, node id, the pod's ``k8s.*``, then
    ``OTEL_RESOURCE_ATTRIBUTES`` (the OpenTelemetry Operator's ``k8s.*`` win over ours)."""
    from opentelemetry.sdk.resources import Resource

    # One agent per node: the host names the instance, so a restarted agent continues its series
    # (the SDK's default is a new UUID per process).
    attributes: dict[str, str] = {
        "service.name": config.service_name,
        "service.instance.id": node.hostname,
        "host.name": node.hostname,
    }
    if (machine_id := host_id()) is not None:
        attributes["host.id"] = machine_id
    if node.node_id is not None:
        attributes[NODE_ID_ATTRIBUTE] = node.node_id
    if node.kubernetes is not None:
        attributes.update(node.kubernetes.attributes())
    attributes.update(config.resource_attributes)
    if not config.source("service_name").is_default:
        # The spec: OTEL_SERVICE_NAME wins over a service.name in OTEL_RESOURCE_ATTRIBUTES.
        attributes["service.name"] = config.service_name
    # Resource.create adds the SDK's telemetry.sdk.* attributes.
    return Resource.create(attributes)
