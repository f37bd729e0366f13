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
from typing import Any

_logger = logging.getLogger(__name__)

GIT_COMMIT_TAG = "mlflow.source.git.commit"
GIT_DIRTY_TAG = "mlflow.source.git.dirty"
NOTE_TAG = "mlflow.note.content"
# Set once a run holds a job's params, tags and config: a resume never records them again.
DESCRIBED_TAG = "otel_forge.described"
PARAM_VALUE_MAX_CHARS = 6000  # MLflow's limit for a param value
PARAMS_PER_BATCH = 100
LAUNCH_CONFIG_SUFFIXES = (".toml", ".yaml", ".yml", ".json")
_GIT_TIMEOUT_S = 10.0
_GIT_SHA = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def config_as_dict(config: Any) -> Any:
    """Dataclasses, pydantic models, argparse namespaces and mappings as plain nested data."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return {f.name: config_as_dict(getattr(config, f.name)) for f in dataclasses.fields(config)}
    if hasattr(config, "model_dump") and callable(config.model_dump):  # pydantic v2
        return config_as_dict(config.model_dump())
    if hasattr(config, "dict") and hasattr(config, "__fields__"):  # pydantic v1
        return config_as_dict(config.dict())
    if isinstance(config, argparse.Namespace):
        return config_as_dict(vars(config))
    if isinstance(config, Mapping):
        return {str(key): config_as_dict(value) for key, value in config.items()}
    if isinstance(config, (list, tuple)):
        return [config_as_dict(item) for item in config]
    return config


def flatten_params(config: Any, max_chars: int = PARAM_VALUE_MAX_CHARS) -> dict[str, str]:
    """Dotted params: ``{"model": {"dim": 8}, "lr": [1, 2]}`` -> ``model.dim``, ``lr.0``, ``lr.1``.

    None is skipped; other values are stringified and cut to ``max_chars``.
    """
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(f"{prefix}.{index}" if prefix else str(index), item)
        else:
            flat[prefix or "value"] = str(value)[:max_chars]

    walk("", config_as_dict(config))
    return flat


def batches(params: Mapping[str, str], size: int = PARAMS_PER_BATCH) -> list[dict[str, str]]:
    items = list(params.items())
    return [dict(items[start:start + size]) for start in range(0, len(items), size)]


def _git(*args: str, cwd: str | None = None) -> str | None:
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, errors="replace", cwd=cwd,
                              stdin=subprocess.DEVNULL, timeout=_GIT_TIMEOUT_S,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})
    except (OSError, subprocess.SubprocessError) as error:
        _logger.debug("git %s did not run: %s", args[0], error)
        return None
    if done.returncode != 0:
        _logger.debug("git %s exited %d", args[0], done.returncode)
        return None
    return done.stdout.strip()


def git_tags(cwd: str | None = None) -> dict[str, str]:
    """``mlflow.source.git.commit`` and ``.dirty`` of the repository at ``cwd``; {} outside one."""
    commit = _git("rev-parse", "HEAD", cwd=cwd)
    if commit is None or not _GIT_SHA.fullmatch(commit):
        return {}
    tags = {GIT_COMMIT_TAG: commit}
    changes = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
    if changes is not None:
        tags[GIT_DIRTY_TAG] = str(bool(changes)).lower()
    return tags


def job_tags(world_size: int | None, node_count: int | None, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    environ = os.environ if environ is None else environ
    tags = {"host": socket.gethostname()}
    if environ.get("SLURM_JOB_ID"):
        tags["slurm_job_id"] = environ["SLURM_JOB_ID"]
    if world_size is not None:
        tags["world_size"] = str(world_size)
    if node_count is not None:
        tags["node_count"] = str(node_count)
    return tags


def launch_config_path(argv: Sequence[str]) -> Path | None:
    """The first ``.toml`` / ``.yaml`` / ``.yml`` / ``.json`` file named on a command line."""
    for arg in argv[1:]:
        candidate = arg.split("=", 1)[-1]  # --config=train.toml
        if candidate.lower().endswith(LAUNCH_CONFIG_SUFFIXES) and os.path.isfile(candidate):
            return Path(candidate).absolute()
    return None


def load_launch_config(path: Path) -> Any:
    """The launch file's content as data (TOML, YAML or JSON); None if it cannot be read."""
    try:
        text = path.read_text()
        suffix = path.suffix.lower()
        if suffix == ".toml":
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib

            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as error:  # noqa: BLE001 - a config we cannot parse is uploaded as is, not flattened
        _logger.warning("launch config %s not parsed: %s", path, error)
        return None
