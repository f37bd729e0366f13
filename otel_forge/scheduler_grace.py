"""How long the scheduler waits between its SIGTERM and its SIGKILL, where it can be known.

SLURM's ``KillWait`` (``scontrol show config``); a Kubernetes pod's ``terminationGracePeriodSeconds``
(the pod read from the API server with its service account, where its role may ``get`` pods). A
close's deadline stays inside it: past it, the kernel ends the agent mid-call.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from otel_forge.config import ForgeConfig
from otel_forge.kubernetes import KubernetesIdentity

_logger = logging.getLogger(__name__)

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
_ASK_TIMEOUT_S = 2.0  # both answer in milliseconds; a hung controller must not delay the start
_KILL_WAIT = re.compile(r"^KillWait\s*=\s*(\d+)\s*sec", re.MULTILINE)


@dataclass(frozen=True)
class Grace:
    """``seconds`` from the scheduler's SIGTERM to its SIGKILL, and what said so."""

    seconds: float
    source: str


def close_deadline(
    config: ForgeConfig, node_count: int | None, kubernetes: KubernetesIdentity | None
) -> tuple[float, str]:
    """How long a close waits for the last window, and why: the setting, else by the job's size
    within the scheduler's grace (asked only then)."""
    if config.drain_deadline_s is not None:
        return config.drain_deadline_s, f"drain_deadline_s from {config.source('drain_deadline_s')}"
    grace = scheduler_grace(kubernetes=kubernetes)
    seconds = config.close_deadline_s(node_count, grace.seconds if grace else None)
    within = f", within {grace.source} ({grace.seconds:g} s)" if grace else ""
    return seconds, f"a job of {node_count or 1} node(s){within}"


def scheduler_grace(
    environ: Mapping[str, str] | None = None,
    kubernetes: KubernetesIdentity | None = None,
    account_dir: Path = SERVICE_ACCOUNT_DIR,
) -> Grace | None:
    """The grace of the scheduler this process runs under, or None where none is known."""
    environ = os.environ if environ is None else environ
    if environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID"):
        return slurm_kill_wait()
    if kubernetes is not None:
        return pod_termination_grace(kubernetes, environ, account_dir)
    return None


def slurm_kill_wait() -> Grace | None:
    """``KillWait`` from ``scontrol show config`` (SLURM's default is 30 s)."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return None
    try:
        done = subprocess.run(
            [scontrol, "show", "config"], capture_output=True, text=True, timeout=_ASK_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        _logger.debug("scontrol show config: %s", error)
        return None
    found = _KILL_WAIT.search(done.stdout)
    return Grace(float(found.group(1)), "SLURM KillWait") if found else None


def pod_termination_grace(
    pod: KubernetesIdentity, environ: Mapping[str, str], account_dir: Path = SERVICE_ACCOUNT_DIR
) -> Grace | None:
    """The pod's ``spec.terminationGracePeriodSeconds``, read with its service account's token."""
    host, port = environ.get("KUBERNETES_SERVICE_HOST"), environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not (host and pod.pod_name and pod.namespace):
        return None
    try:
        token = (account_dir / "token").read_text().strip()
        context = ssl.create_default_context(cafile=str(account_dir / "ca.crt"))
        url = f"https://{_host(host)}:{port}/api/v1/namespaces/{pod.namespace}/pods/{pod.pod_name}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, timeout=_ASK_TIMEOUT_S, context=context) as answer:
            seconds = json.load(answer)["spec"]["terminationGracePeriodSeconds"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        # No token, no role to read pods, an old API: the grace stays unknown.
        _logger.debug("pod %s/%s not read: %s", pod.namespace, pod.pod_name, error)
        return None
    return Grace(float(seconds), "the pod's terminationGracePeriodSeconds")


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host  # an IPv6 service address
