"""Helpers to run code against the fake GPU libraries in ``tests/fakes`` (pynvml, amdsmi).

In-process::

    from testkit.gpu_fakes import fake_nvml

    def test_something():
        with fake_nvml({"count": 4, "not_supported": {"1": ["power"]}}) as nvml:
            collector = NvidiaCollector.create(ForgeConfig.defaults())
            ...
            assert nvml.calls("nvmlDeviceGetPowerUsage", 1) == 1

In a subprocess (``otel-forge monitor``, ``python -m bench.gpu_check``)::

    subprocess.run([...], env=fake_gpu_env({"count": 2}), ...)

The scenario keys are documented at the top of ``tests/fakes/pynvml.py`` and ``tests/fakes/amdsmi.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

FAKES_DIR = Path(__file__).resolve().parent.parent / "tests" / "fakes"
SCENARIO_ENV = "OTEL_FORGE_FAKE_GPUS"


@contextlib.contextmanager
def fake_nvml(scenario: Mapping[str, Any] | None = None) -> Iterator[ModuleType]:
    """The fake ``pynvml`` as the ``pynvml`` every import sees, with ``scenario`` (default: 2 GPUs).

    Puts tests/fakes first on sys.path, drops a cached ``pynvml``, sets ``OTEL_FORGE_FAKE_GPUS``
    and yields the fake module; everything is restored on exit.
    """
    with _faked("pynvml", scenario) as module:
        yield module


@contextlib.contextmanager
def fake_amdsmi(scenario: Mapping[str, Any] | None = None) -> Iterator[ModuleType | None]:
    """The fake ``amdsmi``, as ``fake_nvml``. When the scenario makes its import fail
    (``import_error``, or ``"amd": false``) the module is not imported here (its import prints
    and raises, which is the point): None is yielded."""
    with _faked("amdsmi", scenario, import_now=not _amdsmi_import_fails(scenario or {})) as module:
        yield module


def fake_gpu_env(scenario: Mapping[str, Any] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a subprocess that should see the fakes: PYTHONPATH starts with
    tests/fakes and OTEL_FORGE_FAKE_GPUS holds ``scenario`` (as JSON)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(FAKES_DIR), env.get("PYTHONPATH"))))
    if scenario is None:
        env.pop(SCENARIO_ENV, None)
    else:
        env[SCENARIO_ENV] = json.dumps(scenario)
    return env


def _amdsmi_import_fails(scenario: Mapping[str, Any]) -> bool:
    own = scenario.get("amd", {})
    return own is False or bool({**scenario, **(own or {})}.get("import_error"))


@contextlib.contextmanager
def _faked(name: str, scenario: Mapping[str, Any] | None, import_now: bool = True) -> Iterator[ModuleType | None]:
    saved_path = list(sys.path)
    saved_module = sys.modules.pop(name, None)
    saved_env = os.environ.get(SCENARIO_ENV)
    sys.path.insert(0, str(FAKES_DIR))
    if scenario is None:
        os.environ.pop(SCENARIO_ENV, None)
    else:
        os.environ[SCENARIO_ENV] = json.dumps(scenario)
    try:
        yield importlib.import_module(name) if import_now else None
    finally:
        sys.modules.pop(name, None)
        if saved_module is not None:
            sys.modules[name] = saved_module
        sys.path[:] = saved_path
        if saved_env is None:
            os.environ.pop(SCENARIO_ENV, None)
        else:
            os.environ[SCENARIO_ENV] = saved_env
