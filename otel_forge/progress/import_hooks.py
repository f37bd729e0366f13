"""Post-import hooks: run a function once a module has been imported, without importing it first.

The rank's hooks must reach torch (and safetensors, MLflow) only where the script imports them: a
finder on ``sys.meta_path`` wraps the module's loader, and calls the hooks when its code has run
(wrapt's and OpenTelemetry's auto-instrumentation use the same approach).
"""

from __future__ import annotations

import importlib.abc
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

_logger = logging.getLogger(__name__)

Hook = Callable[[ModuleType], None]
_hooks: dict[str, list[Hook]] = {}
_lock = threading.Lock()


def when_imported(name: str, hook: Hook) -> None:
    """Call ``hook(module)`` once ``name`` is imported: now if it is already."""
    with _lock:
        module = sys.modules.get(name)
        if module is None:
            _hooks.setdefault(name, []).append(hook)
            if not any(isinstance(finder, _PostImportFinder) for finder in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder())
            return
    _run(hook, module)


def _run(hook: Hook, module: ModuleType) -> None:
    try:
        hook(module)
    except Exception as error:  # noqa: BLE001 - a hook of ours must never fail the user's import
        _logger.debug("progress hook on %s failed: %s", module.__name__, error)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a hooked module, the spec the other finders give, its loader wrapped."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader)
                return spec
        return None


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        # The module keeps its own loader: code that inspects it (importlib.resources, isinstance) sees no trace of us.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        with _lock:
            hooks = _hooks.pop(module.__name__, [])
        for hook in hooks:
            _run(hook, module)
