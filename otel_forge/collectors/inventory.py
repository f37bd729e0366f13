"""What the machine is, read once: CPU, memory, GPUs, kernel, Python and the training stack's versions,
and on Kubernetes which pod it is.

The node's agent records it beside the node's system metrics (``<prefix>inventory.json`` in the run,
a few tags on a run of one node) and ``otel-forge doctor`` prints it. Versions come from the
installed distributions' metadata: nothing here imports torch (seconds, and CUDA) to ask.
"""

from __future__ import annotations

import importlib.metadata
import logging
import platform
import socket
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

from otel_forge.kubernetes import KubernetesIdentity

_logger = logging.getLogger(__name__)

# The distributions whose versions the inventory names (NCCL ships as a pip wheel beside torch).
PACKAGES = {
    "torch": ("torch",),
    "nccl": ("nvidia-nccl-cu12", "nvidia-nccl-cu13", "nvidia-nccl-cu11"),
    "otel-forge": ("otel-forge",),
}


def node_inventory(collectors: Iterable[Any], kubernetes: KubernetesIdentity | None = None) -> dict[str, Any]:
    """The machine's inventory; ``collectors``: the agent's open collectors (GPU ones give theirs);
    ``kubernetes``: the pod's identity (``NodeIdentity.kubernetes``), None outside Kubernetes."""
    memory = psutil.virtual_memory().total
    return {
        "host": socket.gethostname(),
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "cpu": {
            "model": cpu_model(),
            "logical_cores": psutil.cpu_count(),
            "physical_cores": psutil.cpu_count(logical=False),
        },
        "memory_bytes": memory,
        "gpus": [inventory for collector in collectors if (inventory := _gpu_inventory(collector)) is not None],
        "packages": {name: _version(distributions) for name, distributions in PACKAGES.items()},
        "kubernetes": asdict(kubernetes) if kubernetes is not None else None,
    }


def inventory_tags(inventory: dict[str, Any]) -> dict[str, str]:
    """A few tags for a run of one node: what its charts were measured on (on Kubernetes, in which
    pod, namespace and job: ``k8s.pod.name``, ``k8s.namespace.name``, ``otel_forge.k8s.job.name``...)."""
    tags = {"otel_forge.host": str(inventory["host"])}
    if inventory.get("kubernetes"):
        tags.update(KubernetesIdentity(**inventory["kubernetes"]).attributes())
    if inventory["cpu"]["model"]:
        tags["otel_forge.cpu.model"] = str(inventory["cpu"]["model"])
    for vendor in inventory["gpus"]:
        gpus = vendor.get("gpus") or []
        names = sorted({gpu.get("name") or "unknown" for gpu in gpus})
        if names:
            tags["otel_forge.gpu.model"] = f"{len(gpus)} x {', '.join(names)}"
        if vendor.get("driver_version"):
            tags["otel_forge.gpu.driver"] = str(vendor["driver_version"])
    return tags


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU's model name as the kernel reports it (``platform.processor()`` is often empty)."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                return value.strip() or None
    except OSError:
        pass
    return platform.processor() or None


def _gpu_inventory(collector: Any) -> dict[str, Any] | None:
    read = getattr(collector, "inventory", None)
    if read is None:
        return None
    try:
        return dict(read())
    except Exception as error:  # noqa: BLE001 - an inventory without GPUs beats none
        _logger.debug("GPU inventory of %s not read: %s", getattr(collector, "name", collector), error)
        return None


def _version(distributions: tuple[str, ...]) -> str | None:
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
