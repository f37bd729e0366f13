"""A Python that sees only what ``pip install otel-forge`` installs (mlflow-skinny, not mlflow).

The closure of pyproject.toml's core dependencies is walked through the installed distributions'
own metadata; every other installed package's top-level modules (sklearn, scipy, pandas, numpy,
pyarrow, matplotlib, flask, sqlalchemy, alembic, ... and the dev tools) are hidden from every finder
on ``sys.meta_path``, by a ``sitecustomize`` on PYTHONPATH, in the child and in every Python it
starts (TrainingRun's sampler process is one), so nothing of the full MLflow stack is used by
accident. Each such Python appends its ``sys.orig_argv`` to a log, so a test can see which ran.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

REPO_ROOT = Path(__file__).resolve().parents[1]

_SITECUSTOMIZE = '''\
import json, sys

_UNINSTALLED = frozenset({uninstalled})


class _Hiding:
    """A finder that does not see the modules the lean install lacks: to an import they are missing,
    and importlib.util.find_spec answers None for them (MLflow asks it of sqlalchemy)."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _UNINSTALLED:
            return None
        return self._finder.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self._finder, name)


sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
with open({log!r}, "a") as log:
    log.write(json.dumps(sys.orig_argv) + "\\n")
'''


def lean_distributions() -> set[str]:
    """The installed distributions ``pip install otel-forge`` (no extra) pulls in, by canonical name."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    todo = [(Requirement(text), ()) for text in pyproject["project"]["dependencies"]]
    seen: set[str] = set()
    while todo:
        requirement, extras = todo.pop()
        environments = [{"extra": extra} for extra in ("", *extras)]
        if requirement.marker and not any(requirement.marker.evaluate(env) for env in environments):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue  # a dependency for another platform or Python
        seen.add(name)
        todo += [(Requirement(text), tuple(requirement.extras)) for text in distribution.requires or []]
    return seen


def _top_level(distribution: metadata.Distribution) -> set[str]:
    listed = distribution.read_text("top_level.txt")
    if listed:
        return {name.strip() for name in listed.split() if name.strip()}
    names = set()
    for file in distribution.files or []:
        parts = Path(file).parts
        if not parts or parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".data", ".pth")):
            continue
        if len(parts) > 1 or parts[0].endswith((".py", ".so", ".pyd")):
            names.add(parts[0].split(".")[0])
    return names


def uninstalled_modules() -> set[str]:
    """Top-level modules installed here that the lean install would not have."""
    lean = lean_distributions()
    kept: set[str] = {"otel_forge"}
    others: set[str] = set()
    for distribution in metadata.distributions():
        name = canonicalize_name(distribution.metadata["Name"] or "")
        (kept if name in lean else others).update(_top_level(distribution))
    # A namespace shared with a lean distribution (google, opentelemetry) stays importable.
    return others - kept - set(sys.stdlib_module_names)


def lean_environ(directory: Path, environ: dict[str, str]) -> tuple[dict[str, str], Path]:
    """``environ`` for a lean child Python, and the log its Pythons append their argv to."""
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / "pythons.log"
    source = _SITECUSTOMIZE.format(uninstalled=sorted(uninstalled_modules()), log=str(log))
    (directory / "sitecustomize.py").write_text(source)
    path = os.pathsep.join(filter(None, [str(directory), str(REPO_ROOT), environ.get("PYTHONPATH")]))
    return {**environ, "PYTHONPATH": path}, log


def started_pythons(log: Path) -> list[list[str]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
