"""The block of ``with TrainingRun(config=...)`` begins once the run is open; the process's own MLflow
calls wait for the run's description instead.

A new run's description (tags, config.json, the config's params) is delivered by another process, and
a large config's params take seconds to store (MLflow takes 100 per call, and each call reads every
param the run already holds). A framework in the block that logs the same params (accelerate's
``init_trackers(config=)``) must find them in: MLflow refuses one of two writers inserting a param at
once, and the loser would be the framework's call. So, until the description is in (at most until
the enter's start wait is over), each MLflow REST call of this process waits for it first.

MLflow asks its request-header providers for headers before each REST call, on the calling thread:
``DescriptionGate`` is one, registered in the process once (the first ``hold``), and adds no header.
otel_forge's own threads never wait (one of them may be delivering the description). A local store
(``sqlite:``, ``file:``) makes no REST call: ``hold`` says so, and the enter waits for the description
itself, as it does where MLflow has no such registry.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from urllib.parse import urlsplit

from otel_forge.mlflow.training.journal_cursor import wait_described
from otel_forge.progress.import_hooks import when_imported

# The threads that never wait: otel_forge's (a delivery thread, the sampler's), the run's opener.
OWN_THREADS = ("otel-forge", "mlflow-run-owner", "mlflow-system-metrics")
_REGISTRY = "mlflow.tracking.request_header.registry"
_REST_SCHEMES = frozenset({"http", "https", "databricks"})  # URIs MLflow's client calls over REST


@dataclass(eq=False)
class _Pending:
    directory: Path  # the journal whose delivery describes the run (its cursor says when it has)
    deadline: float  # time.monotonic() when the calls stop waiting
    lock: threading.Lock = field(default_factory=threading.Lock)  # one caller reads the cursor, the others wait


_pending: _Pending | None = None
_registered = False
_registering = threading.Lock()


def hold(directory: Path, deadline: float, tracking_uri: str) -> bool:
    """Until the journal in ``directory`` has described its run, or ``deadline`` (``time.monotonic``),
    this process's MLflow calls wait for it; False where they cannot be held (a local store, an
    MLflow without request-header providers): the caller waits now."""
    global _pending
    if urlsplit(tracking_uri).scheme not in _REST_SCHEMES or not _register():
        return False
    _pending = _Pending(directory, deadline)
    return True


def hold_or_wait(directory: Path, deadline: float, tracking_uri: str) -> None:
    """``hold``; where the calls cannot be held, wait for the description now (until ``deadline``)."""
    if not hold(directory, deadline, tracking_uri):
        wait_described(directory, deadline - time.monotonic())


def release(directory: Path | None) -> None:
    """The calls stop waiting for ``directory``'s description (the run is closed, or described)."""
    global _pending
    if (pending := _pending) is not None and pending.directory == directory:
        _pending = None


def held() -> Path | None:
    """The journal whose description this process's MLflow calls wait for, if any."""
    return _pending.directory if _pending is not None else None


def _register() -> bool:
    """The gate in MLflow's registry: now, where MLflow is imported; else once it is (a process that
    never imports it makes no call to hold)."""
    global _registered
    with _registering:
        if not _registered:
            if "mlflow" in sys.modules:
                try:
                    _register_in(importlib.import_module(_REGISTRY))
                except ImportError:
                    return False
            elif importlib.util.find_spec("mlflow") is None:
                return False
            else:
                when_imported(_REGISTRY, _register_in)
            _registered = True
    return True


def _register_in(registry: ModuleType) -> None:
    registry._request_header_provider_registry.register(DescriptionGate)  # noqa: SLF001 - its only name


def _wait(pending: _Pending) -> None:
    """Wait for the description: one caller reads the cursor, the others wait for it to be done."""
    if pending.lock.acquire(timeout=max(pending.deadline - time.monotonic(), 0.0)):
        try:
            if _pending is pending:
                wait_described(pending.directory, pending.deadline - time.monotonic())
        finally:
            pending.lock.release()
    release(pending.directory)  # described, or past the deadline: no call waits again


class DescriptionGate:
    """A request-header provider (MLflow's ``RequestHeaderProvider``: its registry asks these two) that
    adds nothing: it makes the call wait for the description. MLflow is imported only to register it."""

    def in_context(self) -> bool:
        if (pending := _pending) is not None and not threading.current_thread().name.startswith(OWN_THREADS):
            _wait(pending)
        return False

    def request_headers(self) -> dict[str, str]:
        return {}


def _forget() -> None:
    """A forked child (a DataLoader worker) waits for nothing of its parent's."""
    global _pending
    _pending = None


os.register_at_fork(after_in_child=_forget)
