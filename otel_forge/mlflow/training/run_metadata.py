"""What a new run records about its job: flattened config, git state, launch file, host tags.

Everything here is plain Python run on the delivery worker, never on the training thread; every
git failure (no git, no repository, no commit, no answer in time) is silent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

from otel_forge.kubernetes import KubernetesIdentity
from otel_forge.mlflow.keys import node_host_tags
from otel_forge.node import (
    SLURM_ARRAY_JOB_VAR,
    SLURM_ARRAY_TASK_VAR,
    TORCHRUN_RESTART_COUNT_VAR,
)
from otel_forge.scrub import REDACTED, SecretKeys, scrub

if TYPE_CHECKING:
    from yaml import Node

_logger = logging.getLogger(__name__)

# A config as plain data, JSON's own types: what ``config_as_dict`` makes of any config, and what is
# masked, flattened into params and uploaded as config.json.
PlainData: TypeAlias = "None | str | int | float | bool | list[PlainData] | dict[str, PlainData]"

GIT_COMMIT_TAG = "mlflow.source.git.commit"
GIT_DIRTY_TAG = "mlflow.source.git.dirty"
GIT_BRANCH_TAG = "mlflow.source.git.branch"
GIT_REPO_URL_TAG = "mlflow.source.git.repoURL"
NOTE_TAG = "mlflow.note.content"
# Set once a run holds a job's params, tags and config: a resume never records them again.
DESCRIBED_TAG = "otel_forge.described"
# How many values log() or the server refused (each warned): the count a user finds on the run.
REJECTED_TAG = "otel_forge.log.rejected"
# The launcher's word on the job, as tags: its place in a SLURM array, which attempt this is.
SLURM_ARRAY_JOB_TAG = "otel_forge.slurm.array_job_id"
SLURM_ARRAY_TASK_TAG = "otel_forge.slurm.array_task_id"
SLURM_RESTART_TAG = "otel_forge.slurm.restart_count"  # how many times SLURM requeued the job
TORCHRUN_RESTART_TAG = "otel_forge.torchrun.restart_count"  # the attempt of torchrun --max-restarts
_ARRAY_TAGS = ((SLURM_ARRAY_JOB_VAR, SLURM_ARRAY_JOB_TAG), (SLURM_ARRAY_TASK_VAR, SLURM_ARRAY_TASK_TAG))
_ATTEMPT_TAGS = (("SLURM_RESTART_COUNT", SLURM_RESTART_TAG), (TORCHRUN_RESTART_COUNT_VAR, TORCHRUN_RESTART_TAG))
PARAM_VALUE_MAX_CHARS = 6000  # MLflow's limit for a param value
PARAMS_PER_BATCH = 100
# A config text value past this is cut, with a marker, before anything else reads it.
CONFIG_VALUE_MAX_CHARS = 64 * 1024
# A launch file past these is neither parsed nor uploaded (one warning): bounded time and memory.
LAUNCH_CONFIG_MAX_BYTES = 4 * 1024 * 1024
LAUNCH_CONFIG_MAX_VALUES = 100_000  # YAML aliases expanded
LAUNCH_CONFIG_SUFFIXES = (".toml", ".yaml", ".yml", ".json")  # the first three also without a config option
_CUT_MARKER = re.compile(r"\.\.\.\[(\d+) more characters\]$")  # what cut_with_marker ends a cut text with
_GIT_TIMEOUT_S = 10.0
_GIT_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def config_as_dict(config: object) -> PlainData:
    """Dataclasses, pydantic models, argparse namespaces and mappings as plain nested data.

    Whatever cannot be read costs only itself: a value whose ``str`` raises becomes a marker, a
    cycle becomes ``<cycle>``; leaves that are not JSON scalars become their text.
    """
    return _plain(config, set())


def _plain(value: object, seen: set[int]) -> PlainData:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if id(value) in seen:
        return "<cycle>"
    seen.add(id(value))
    try:
        return _container(value, seen)
    except Exception as error:  # noqa: BLE001 - a config object that cannot be read loses only itself
        _logger.warning("config value of type %s not recorded: %s", type(value).__name__, _text(error))
        return f"<unreadable {type(value).__name__}>"
    finally:
        seen.discard(id(value))


def _container(value: object, seen: set[int]) -> PlainData:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name), seen) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump") and callable(value.model_dump):  # pydantic v2
        return _plain(value.model_dump(), seen)
    if hasattr(value, "dict") and hasattr(value, "__fields__"):  # pydantic v1
        return _plain(value.dict(), seen)
    if isinstance(value, argparse.Namespace):
        return _plain(vars(value), seen)
    if isinstance(value, Mapping):
        return {_text(key): _plain(item, seen) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, seen) for item in value]
    return _text(value)


def _text(value: object) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - an object whose __str__ raises
        return f"<unprintable {type(value).__name__}>"


def redact(data: PlainData, secret: SecretKeys, max_chars: int = CONFIG_VALUE_MAX_CHARS) -> PlainData:
    """Plain data with every value under a secret-naming key masked, text scrubbed of
    credentials, and text past ``max_chars`` cut with a marker (before it is scrubbed: linear)."""
    if isinstance(data, Mapping):
        return {key: REDACTED if secret(key) else redact(item, secret, max_chars) for key, item in data.items()}
    if isinstance(data, list):
        # ["--api-key", "v"]: the value after a flag that names a secret is one.
        return [
            REDACTED if index and _secret_flag(data[index - 1], secret) else redact(item, secret, max_chars)
            for index, item in enumerate(data)
        ]
    if isinstance(data, str):
        return scrub(cut_with_marker(data, max_chars))
    return data


def cut_with_marker(text: str, max_chars: int) -> str:
    """``text``, or where it is longer than ``max_chars``, its start and a marker saying how much is
    missing, in ``max_chars`` characters at most (a marker it ends with already is counted in)."""
    if len(text) <= max_chars:
        return text
    missing_before = 0
    if (marker := _CUT_MARKER.search(text)) is not None:
        text, missing_before = text[: marker.start()], int(marker.group(1))
    whole = len(text) + missing_before
    longest = f"...[{whole} more characters]"  # the marker is never longer than this one
    if len(longest) >= max_chars:
        return text[:max_chars]  # no room for a marker
    kept = max_chars - len(longest)
    return f"{text[:kept]}...[{whole - kept} more characters]"


def _secret_flag(item: PlainData, secret: SecretKeys) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and secret(item.lstrip("-"))


def flatten_params(config: object, max_chars: int = PARAM_VALUE_MAX_CHARS) -> dict[str, str]:
    """Dotted params: ``{"model": {"dim": 8}, "lr": [1, 2]}`` -> ``model.dim``, ``lr.0``, ``lr.1``.

    None is skipped; other values are stringified and cut to ``max_chars``, with a marker.
    """
    flat: dict[str, str] = {}

    def walk(prefix: str, value: PlainData) -> None:
        if value is None:
            return
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, list):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}" if prefix else str(index), item)
        else:
            flat[prefix or "value"] = cut_with_marker(str(value), max_chars)

    walk("", config_as_dict(config))
    return flat


def batches(params: Mapping[str, str], size: int = PARAMS_PER_BATCH) -> list[dict[str, str]]:
    items = list(params.items())
    return [dict(items[start : start + size]) for start in range(0, len(items), size)]


def _git(*args: str, cwd: str | None = None) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            errors="replace",
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            timeout=_GIT_TIMEOUT_S,
            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"},
        )
    except (OSError, subprocess.SubprocessError) as error:
        _logger.debug("git %s did not run: %s", args[0], error)
        return None
    if done.returncode != 0:
        _logger.debug("git %s exited %d", args[0], done.returncode)
        return None
    return done.stdout.strip()


def git_tags(cwd: str | None = None) -> dict[str, str]:
    """``mlflow.source.git.commit``, ``.dirty``, ``.branch`` and ``.repoURL`` (origin's, as git has it:
    the caller scrubs it) of the repository at ``cwd``; {} outside one, a tag left out where git cannot
    say (a detached HEAD has no branch, a repository without origin no URL)."""
    commit = _git("rev-parse", "HEAD", cwd=cwd)
    if commit is None or not _GIT_SHA.fullmatch(commit):
        return {}
    tags = {GIT_COMMIT_TAG: commit}
    changes = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
    if changes is not None:
        tags[GIT_DIRTY_TAG] = str(bool(changes)).lower()
    if branch := _git("symbolic-ref", "--short", "-q", "HEAD", cwd=cwd):
        tags[GIT_BRANCH_TAG] = branch
    if url := _git("remote", "get-url", "origin", cwd=cwd):
        tags[GIT_REPO_URL_TAG] = url
    return tags


def job_tags(
    world_size: int | None,
    node_count: int | None,
    environ: Mapping[str, str] | None = None,
    node_id: str | None = None,
    kubernetes: KubernetesIdentity | None = None,
) -> dict[str, str]:
    """The job's tags as the process describing the run sees it: its host (and, with ``node_id``,
    which node that host is), the job's size, the launcher's ids and attempt counts. On Kubernetes:
    the namespace and owning job (``k8s.namespace.name``, ``otel_forge.k8s.job.kind``, ``.name``),
    and its pod's name and node, the run's own on one node, else its node's (``otel_forge.node.<id>.k8s.*``)."""
    environ = os.environ if environ is None else environ
    tags = {"host": socket.gethostname()}
    pod = kubernetes.pod_attributes() if kubernetes is not None else {}
    if kubernetes is not None:
        tags.update(kubernetes.job_attributes())
    if node_id is not None:
        tags.update(node_host_tags(node_id, pod=pod))
    else:
        tags.update(pod)
    if environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = environ["SLURM_JOB_ID"]
    tags.update(_from_environ(environ, _ARRAY_TAGS))
    tags.update(attempt_tags(environ))
    if world_size is not None:
        tags["world_size"] = str(world_size)
    if node_count is not None:
        tags["node_count"] = str(node_count)
    return tags


def attempt_tags(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Which attempt of the job this is: SLURM's requeue count, torchrun's restart count (a new
    attempt sets them again: a resumed run is not described twice)."""
    return _from_environ(os.environ if environ is None else environ, _ATTEMPT_TAGS)


def _from_environ(environ: Mapping[str, str], pairs: tuple[tuple[str, str], ...]) -> dict[str, str]:
    return {tag: value for variable, tag in pairs if (value := environ.get(variable, "").strip())}


def launch_config_path(argv: Sequence[str]) -> Path | None:
    """The launch config named on a command line, by a rule a user can predict:

    1. the value of a config option: ``--config x.json``, ``--config=x.yaml``, ``--cfg``,
       ``--config-file``, or a ``config=x.yaml`` / ``train.config=x.toml`` override;
    2. else the first ``.toml`` / ``.yaml`` / ``.yml`` file named on it. A bare ``.json`` is
       taken only by rule 1: it is as often a data file as a config.
    """
    args = list(argv[1:])
    for index, arg in enumerate(args):
        name, sep, value = arg.partition("=")
        option, override = name.startswith("-"), bool(sep) and "/" not in name
        if not (option or override) or not _names_config(name):
            continue
        if not sep:  # --config x.json: the next word
            value = args[index + 1] if index + 1 < len(args) else ""
        if value.lower().endswith(LAUNCH_CONFIG_SUFFIXES) and os.path.isfile(value):
            return Path(value).absolute()
    for arg in args:
        candidate = arg.split("=", 1)[-1]
        if candidate.lower().endswith(LAUNCH_CONFIG_SUFFIXES[:3]) and os.path.isfile(candidate):
            return Path(candidate).absolute()
    return None


def _names_config(name: str) -> bool:
    """``--config``, ``--cfg``, ``--config-file``, ``config``, ``train.config``: it names the config."""
    return bool({"config", "cfg", "conf"} & set(re.split(r"[^a-z]+", name.lower())))


def launch_file_text(path: Path) -> str | None:
    """The launch file's text, unless it is past ``LAUNCH_CONFIG_MAX_BYTES`` (said once): a data
    file or a generated dump is no config to flatten into params, nor to upload."""
    try:
        size = path.stat().st_size
        if size > LAUNCH_CONFIG_MAX_BYTES:
            _logger.warning(
                "launch config %s not read: %d bytes, past the %d read from a launch file",
                path,
                size,
                LAUNCH_CONFIG_MAX_BYTES,
            )
            return None
        return path.read_text(errors="replace")
    except OSError as error:
        _logger.warning("launch config %s not read: %s", path, error)
        return None


def load_launch_config(path: Path) -> object:
    """The launch file's content as its parser made it (TOML, YAML or JSON: plain data, dates too: a
    config for ``config_as_dict``); None if it cannot be read, or holds
    more than ``LAUNCH_CONFIG_MAX_VALUES`` values once YAML's aliases are expanded (an alias bomb)."""
    if (text := launch_file_text(path)) is None:
        return None
    try:
        data = _parse(text, path.suffix.lower())
    except Exception as error:  # noqa: BLE001 - a config we cannot parse is uploaded as is, not flattened
        _logger.warning("launch config %s not parsed: %s", path, error)
        return None
    if data is _TOO_MANY_VALUES or _values(data) > LAUNCH_CONFIG_MAX_VALUES:
        _logger.warning(
            "launch config %s not parsed: more than %d values once aliases are expanded", path, LAUNCH_CONFIG_MAX_VALUES
        )
        return None
    return data


_TOO_MANY_VALUES = object()


def _parse(text: str, suffix: str) -> object:
    if suffix == ".toml":
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib

        return tomllib.loads(text)
    if suffix == ".json":
        return json.loads(text)
    import yaml

    # Sized on the node graph first: an alias is one node there, its expansion is what flattening costs.
    if _expanded_nodes(yaml.compose(text, Loader=yaml.SafeLoader), {}) > LAUNCH_CONFIG_MAX_VALUES:
        return _TOO_MANY_VALUES
    return yaml.safe_load(text)


def _expanded_nodes(node: Node | None, sizes: dict[int, int]) -> int:
    """How many nodes ``node`` stands for with every alias expanded; linear in the graph (memoised)."""
    if node is None:
        return 0
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = 0  # a cycle counts once
    children = node.value if isinstance(node.value, list) else []
    flat = [part for child in children for part in (child if isinstance(child, tuple) else (child,))]
    sizes[id(node)] = size = min(1 + sum(_expanded_nodes(child, sizes) for child in flat), 2**62)
    return size


def _values(data: object) -> int:
    """How many values plain (parsed) data holds, at most LAUNCH_CONFIG_MAX_VALUES + 1 counted."""
    count, stack = 0, [data]
    while stack and count <= LAUNCH_CONFIG_MAX_VALUES:
        item = stack.pop()
        count += 1
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count
