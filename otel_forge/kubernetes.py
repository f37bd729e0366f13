"""Who am I on Kubernetes: the pod, its namespace and node, and the job that owns it.

Read from the pod's environment alone (no API server call, no RBAC to grant): the downward API's
variables that the pod spec sets (``valueFrom.fieldRef``), and what Kubernetes and the training
controllers put in every container. Each name below says where it comes from; none is our own.

The owning job, as its controller leaves it in the pod:

- a Kubeflow **PyTorchJob** (training-operator v1, ``pkg/controller.v1/pytorch``): pods named
  ``<job>-master-0`` and ``<job>-worker-<i>`` (``common.GenGeneralName``), ``PET_NNODES`` in every
  pod (``envvar.go``, ``elastic.go``), ``PET_MASTER_ADDR`` = ``<job>-master-0`` with a Master (``master.go``);
- a Kubeflow **TrainJob** (Trainer v2, ``pkg/runtime/framework/plugins/torch/torch.go``): a JobSet
  of replicated job ``node`` whose ``PET_MASTER_ADDR`` is ``<job>-node-0-0.<job>``;
- a **JobSet**: it sets no variable; ``JOBSET_NAME``, from the ``jobset.sigs.k8s.io/jobset-name``
  annotation through the downward API, as JobSet's own in-place-restart agent reads it
  (``cmd/in-place-restart-agent``). Its child Jobs are ``<jobset>-<replicated job>-<index>``;
- an **Indexed batch Job**: the Job controller sets ``JOB_COMPLETION_INDEX``, names the pod
  ``<job>-<index>-<random>`` and its host ``<job>-<index>`` (KEP-2214).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# The kubelet sets it in every container (the API server's service), whatever the pod spec says.
KUBERNETES_VAR = "KUBERNETES_SERVICE_HOST"
# The namespace, where the service account's token is mounted (the default; not with
# automountServiceAccountToken: false).
NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")

# The variables read, by what they say; the first set wins. The downward API's names are the pod
# spec's choice: these are the spellings of projects users copy from.
#   POD_NAME, POD_NAMESPACE: ingress-nginx, flannel, JobSet's in-place-restart agent (POD_NAME);
#   NODE_NAME: NVIDIA dcgm-exporter's DaemonSet; MY_*: the Kubernetes docs' downward-API example
#   (dapi-envars-pod.yaml); K8S_NODE_NAME: the OpenTelemetry Collector's Helm chart;
#   OTEL_RESOURCE_ATTRIBUTES_POD_NAME / _NODE_NAME: what the OpenTelemetry Operator injects.
# The rest are set by Kubernetes and the controllers named in the module's docstring.
VARIABLES: dict[str, tuple[str, ...]] = {
    "pod": ("POD_NAME", "MY_POD_NAME", "OTEL_RESOURCE_ATTRIBUTES_POD_NAME"),
    "namespace": ("POD_NAMESPACE", "MY_POD_NAMESPACE"),
    "node": ("NODE_NAME", "MY_NODE_NAME", "K8S_NODE_NAME", "OTEL_RESOURCE_ATTRIBUTES_NODE_NAME"),
    "host": ("HOSTNAME",),  # the container runtime's: the pod's host name (its name, unless the spec sets one)
    "completion_index": ("JOB_COMPLETION_INDEX",),  # the Job controller's, in an Indexed Job's pods
    "jobset": ("JOBSET_NAME",),  # the pod spec's, from the jobset.sigs.k8s.io/jobset-name annotation
    "pytorchjob_nodes": ("PET_NNODES",),  # the PyTorchJob operator's (and Trainer v2's) node count for torchrun
    "master": ("PET_MASTER_ADDR",),  # the PyTorchJob operator's (with a Master) and Trainer v2's
}

# OpenTelemetry's semantic-convention resource attributes, and ours for what they have no name for
# (a PyTorchJob or a JobSet is no batch Job: ``k8s.job.name`` names only those).
POD_NAME_ATTRIBUTE = "k8s.pod.name"
NAMESPACE_ATTRIBUTE = "k8s.namespace.name"
NODE_NAME_ATTRIBUTE = "k8s.node.name"
BATCH_JOB_ATTRIBUTE = "k8s.job.name"
JOB_KIND_ATTRIBUTE = "otel_forge.k8s.job.kind"
JOB_NAME_ATTRIBUTE = "otel_forge.k8s.job.name"

PYTORCHJOB, TRAINJOB, JOBSET, BATCH_JOB = "PyTorchJob", "TrainJob", "JobSet", "Job"
# Kinds whose pods are, by the controller's design, one distributed job (one torchrun world).
_DISTRIBUTED_KINDS = (PYTORCHJOB, TRAINJOB)

_PYTORCHJOB_POD = re.compile(r"(?P<job>.+)-(?P<type>master|worker)-(?P<index>\d+)")
_TRAINJOB_MASTER = re.compile(r"(?P<job>[^.]+)-node-0-0\.(?P=job)")
_GENERATED_SUFFIX = re.compile(r"-[a-z0-9]{5}")  # generateName's 5 characters


@dataclass(frozen=True)
class KubernetesIdentity:
    """This pod's place on Kubernetes. Unknown values are None.

    ``job_kind``/``job_name``: the workload that owns the pod (PyTorchJob, TrainJob, JobSet or an
    Indexed batch ``Job``); ``batch_job``: the batch Job that runs the pod (a JobSet's or TrainJob's
    child Job; an Indexed Job itself); ``replica_type``/``replica_index``: the pod's place in it
    (PyTorchJob: ``master``/``worker`` and the replica's index; JobSet, TrainJob: the replicated
    job and the completion index; Indexed Job: the completion index). ``job_source``: what named the job.
    """

    pod_name: str | None = None
    namespace: str | None = None
    node_name: str | None = None
    job_kind: str | None = None
    job_name: str | None = None
    batch_job: str | None = None
    replica_type: str | None = None
    replica_index: int | None = None
    job_source: str = "none"

    @classmethod
    def detect(
        cls, environ: Mapping[str, str] | None = None, namespace_file: Path = NAMESPACE_FILE
    ) -> KubernetesIdentity | None:
        """The pod's identity, or None outside Kubernetes (no ``KUBERNETES_SERVICE_HOST``);
        ``namespace_file``: where the namespace is read when no variable says it."""
        environ = os.environ if environ is None else environ
        if not _get(environ, (KUBERNETES_VAR,)):
            return None
        node = _get(environ, VARIABLES["node"])
        host = _get(environ, VARIABLES["host"])
        if host is not None and node is not None and _short(host) == _short(node):
            host = None  # hostNetwork: the host name is the machine's, not the pod's
        index_text = _get(environ, VARIABLES["completion_index"])
        index = int(index_text) if index_text is not None and index_text.isdigit() else None
        # An Indexed Job's pod is host <job>-<index>, not its name; any other pod's host is its name.
        pod = _get(environ, VARIABLES["pod"]) or (host if index_text is None else None)
        namespace = _get(environ, VARIABLES["namespace"]) or _read(namespace_file)
        owner = (
            _pytorchjob(environ, pod, host)
            or _trainjob(environ, index)
            or _jobset(environ, _indexed_host(pod, host, index_text), index)
            or _indexed_job(_indexed_host(pod, host, index_text), index_text, index)
            or cls()
        )
        return dataclasses.replace(owner, pod_name=pod, namespace=namespace, node_name=node)

    @property
    def is_distributed(self) -> bool:
        """The owner is one distributed job by its controller's design (a PyTorchJob, a TrainJob)."""
        return self.job_kind in _DISTRIBUTED_KINDS

    @property
    def job_key(self) -> str | None:
        """``k8s-<namespace>/<kind>/<name>``: what every pod of the owning job shares; None without one."""
        if self.job_kind is None or self.job_name is None:
            return None
        where = f"{self.namespace}/" if self.namespace else ""
        return f"k8s-{where}{self.job_kind.lower()}/{self.job_name}"

    def job_attributes(self) -> dict[str, str]:
        """What every pod of the job shares: the namespace and the owning job."""
        attributes = _known(
            {NAMESPACE_ATTRIBUTE: self.namespace, JOB_KIND_ATTRIBUTE: self.job_kind, JOB_NAME_ATTRIBUTE: self.job_name}
        )
        if self.job_kind == BATCH_JOB and self.batch_job:
            attributes[BATCH_JOB_ATTRIBUTE] = self.batch_job
        return attributes

    def pod_attributes(self) -> dict[str, str]:
        """What this pod alone has: its name, its node, and its batch Job where that is not the job's."""
        attributes = _known({POD_NAME_ATTRIBUTE: self.pod_name, NODE_NAME_ATTRIBUTE: self.node_name})
        if self.job_kind != BATCH_JOB and self.batch_job:
            attributes[BATCH_JOB_ATTRIBUTE] = self.batch_job
        return attributes

    def attributes(self) -> dict[str, str]:
        """All of it, as resource attributes (semantic-convention names where there are some)."""
        return {**self.job_attributes(), **self.pod_attributes()}

    def describe(self) -> str:
        """One line for people: ``pod p in namespace n on node m; PyTorchJob j (worker 1)``."""
        where = f"pod {self.pod_name or '?'} in namespace {self.namespace or '?'} on node {self.node_name or '?'}"
        if self.job_kind is None:
            return f"{where}; no owning job found"
        place = " ".join(str(part) for part in (self.replica_type, self.replica_index) if part is not None)
        return f"{where}; {self.job_kind} {self.job_name or '?'}" + (f" ({place})" if place else "")


def _get(environ: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for name in names:
        if value := environ.get(name, "").strip():
            return value
    return None


def _read(path: Path, max_chars: int = 253) -> str | None:
    """The file's first line, at most ``max_chars`` (a name's length at most): bounded, whatever is there."""
    try:
        with path.open(errors="replace") as file:
            return file.readline(max_chars).strip() or None
    except OSError:
        return None


def _short(host: str) -> str:
    return host.split(".")[0].lower()


def _known(attributes: Mapping[str, str | None]) -> dict[str, str]:
    return {name: value for name, value in attributes.items() if value}


def _pytorchjob(environ: Mapping[str, str], pod: str | None, host: str | None) -> KubernetesIdentity | None:
    """``<job>-master-0`` / ``<job>-worker-<i>`` with the operator's ``PET_NNODES`` (and, with a
    Master, its ``PET_MASTER_ADDR``: a StatefulSet's ``x-worker-0`` with a hand-set PET_NNODES is not one)."""
    if _get(environ, VARIABLES["pytorchjob_nodes"]) is None:
        return None
    master = _get(environ, VARIABLES["master"])
    for name in (pod, host):
        match = _PYTORCHJOB_POD.fullmatch(name or "")
        if match is None or (master is not None and master != f"{match['job']}-master-0"):
            continue
        return KubernetesIdentity(
            job_kind=PYTORCHJOB,
            job_name=match["job"],
            replica_type=match["type"],
            replica_index=int(match["index"]),
            job_source="PyTorchJob operator's pod name and PET_NNODES",
        )
    return None


def _trainjob(environ: Mapping[str, str], index: int | None) -> KubernetesIdentity | None:
    """Trainer v2's ``PET_MASTER_ADDR`` = ``<job>-node-0-0.<job>`` (the JobSet's first pod)."""
    match = _TRAINJOB_MASTER.fullmatch(_get(environ, VARIABLES["master"]) or "")
    if match is None:
        return None
    job = match["job"]
    return KubernetesIdentity(
        job_kind=TRAINJOB,
        job_name=job,
        batch_job=f"{job}-node-0",
        replica_type="node",
        replica_index=index,
        job_source="Trainer's PET_MASTER_ADDR",
    )


def _indexed_host(pod: str | None, host: str | None, index_text: str | None) -> str | None:
    """``<job>-<index>``, an Indexed Job's pod host name: from the pod's name less its random
    suffix (the name stays the pod's under hostNetwork), else from the host name."""
    if index_text is None:
        return None
    named = pod[:-6] if pod and _GENERATED_SUFFIX.fullmatch(pod[-6:]) else None
    for name in (named, host):
        if name and name.endswith(f"-{index_text}") and len(name) > len(index_text) + 1:
            return name
    return None


def _jobset(environ: Mapping[str, str], indexed_host: str | None, index: int | None) -> KubernetesIdentity | None:
    """``JOBSET_NAME``; its child Job and replicated job from the host ``<jobset>-<rjob>-<i>-<index>``."""
    name = _get(environ, VARIABLES["jobset"])
    if name is None:
        return None
    batch_job = replicated = None
    if indexed_host is not None and indexed_host.startswith(f"{name}-"):
        child = indexed_host.rsplit("-", 1)[0]  # less the completion index
        replicated, _, job_index = child[len(name) + 1 :].rpartition("-")
        if replicated and job_index.isdigit():
            batch_job = child
        else:
            replicated = None
    return KubernetesIdentity(
        job_kind=JOBSET,
        job_name=name,
        batch_job=batch_job,
        replica_type=replicated,
        replica_index=index,
        job_source="JOBSET_NAME",
    )


def _indexed_job(indexed_host: str | None, index_text: str | None, index: int | None) -> KubernetesIdentity | None:
    """An Indexed Job: its name is the pod's host name less ``-<JOB_COMPLETION_INDEX>``."""
    if indexed_host is None or index_text is None:
        return None
    job = indexed_host[: -len(index_text) - 1]
    return KubernetesIdentity(
        job_kind=BATCH_JOB,
        job_name=job,
        batch_job=job,
        replica_index=index,
        job_source="JOB_COMPLETION_INDEX and the pod's host name",
    )
