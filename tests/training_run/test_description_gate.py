"""While a new run's description is delivered, the training process's MLflow calls wait for it
(``description_gate``), asked as MLflow asks before each REST call; otel_forge's own threads never
wait, and a local store is not held (the enter waits instead). No server: the delivery's cursor is
written by the test."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from mlflow.tracking.request_header.registry import resolve_request_headers

from otel_forge.mlflow.training import description_gate
from otel_forge.mlflow.training.journal_cursor import Cursor

RUN = {"run_id": "r1", "experiment": "e"}


@pytest.fixture
def journal(tmp_path: Path):
    Cursor(run=RUN, undescribed=True).save(tmp_path)  # the run is open, its description on the way
    yield tmp_path
    description_gate.release(tmp_path)


def _call_from(name: str) -> threading.Thread:
    """An MLflow REST call's header resolution on a thread named ``name``."""
    thread = threading.Thread(target=resolve_request_headers, name=name, daemon=True)
    thread.start()
    return thread


def test_the_process_calls_wait_for_the_description_and_otel_forges_own_do_not(journal: Path) -> None:
    assert description_gate.hold(journal, time.monotonic() + 60, "http://127.0.0.1:5000")
    framework, delivery = _call_from("MainThread-framework"), _call_from("otel-forge-journal")
    delivery.join(10)
    assert not delivery.is_alive()
    framework.join(0.5)
    assert framework.is_alive(), "a call before the description is in waits for it"

    Cursor(run=RUN).save(journal)  # described
    framework.join(10)
    assert not framework.is_alive()
    assert description_gate.held() is None  # the calls after it do not wait


def test_the_calls_wait_no_longer_than_the_deadline(journal: Path) -> None:
    assert description_gate.hold(journal, time.monotonic() + 0.3, "https://mlflow.example")
    _call_from("worker").join(10)
    assert description_gate.held() is None  # the description follows in the background; nothing waits


def test_a_closed_run_holds_no_call(journal: Path) -> None:
    assert description_gate.hold(journal, time.monotonic() + 60, "http://127.0.0.1:5000")
    description_gate.release(journal)
    call = _call_from("worker")
    call.join(10)
    assert not call.is_alive()


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "file:///tmp/mlruns", "/tmp/mlruns"])
def test_a_local_store_is_not_held_the_enter_waits(journal: Path, uri: str) -> None:
    assert not description_gate.hold(journal, time.monotonic() + 60, uri)
    assert description_gate.held() is None
