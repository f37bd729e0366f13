"""Deliver a spool left behind by a close while the server was down: an exporter's system-metrics
windows, or a run's journal (a TrainingRun's metrics, records and end)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.mlflow.client import RunGone, RunInfo, make_client
from otel_forge.mlflow.delivery.engine import Delivery, DeliveryStats, Policy
from otel_forge.mlflow.delivery.outbox import Outbox
from otel_forge.mlflow.delivery.retry import Outcome
from otel_forge.mlflow.spool_files import HEADER, SpoolBusy, claim, remove_if_empty, writer_alive
from otel_forge.mlflow.spool_scan import is_launchers_journal, left_in, spools_in
from otel_forge.mlflow.system_metrics.window_logger import WindowLogger
from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
from otel_forge.mlflow.system_metrics.windows import Window
from otel_forge.mlflow.training.journal_cursor import undelivered
from otel_forge.mlflow.training.journal_delivery import Delivered, DeliveryPace, JournalDelivery
from otel_forge.mlflow.training.rendezvous import find_experiment, published_run_id
from otel_forge.mlflow.training.run_journal import is_journal

_logger = logging.getLogger(__name__)

VALUES, WINDOWS = "metric value(s)", "window(s)"  # what a journal's and a windows spool's replay count


@dataclass(frozen=True)
class ReplayResult:
    delivered: int
    remaining: int
    run_id: str
    set_aside: int = 0  # files that were not windows, kept beside the spool as *.corrupt
    ended: str | None = None  # the status the run was ended with (a training spool)
    unit: str = WINDOWS  # what ``delivered`` counts


# Told the spool's unit ("metric value(s)", "window(s)") and how many were delivered since the last call.
Progress = Callable[[str, int], None]


def _no_progress(unit: str, count: int) -> None:
    pass


def replay(
    path: Path, tracking_uri: str | None = None, job_run_id: str | None = None, progress: Progress = _no_progress
) -> ReplayResult:
    """Deliver whichever spool ``path`` is; ``job_run_id``: the job's run, where a journal leaves its
    run to its launcher (``otel-forge run``'s, delivered first); ``progress``: told as it goes."""
    if is_journal(path):
        return replay_journal(path, tracking_uri, job_run_id, progress)
    return replay_spool(path, tracking_uri, progress)


def replay_in(
    path: Path, tracking_uri: str | None = None, progress: Progress = _no_progress
) -> Iterator[tuple[Path, ReplayResult | None]]:
    """Deliver one spool or a job's directory of them, in order, yielding each spool and what it
    delivered (None: another process delivers it now, left to it); a job's directory is removed once
    all of it is delivered. The first failure raises, and what is left stays."""
    job_run_id: str | None = None  # the run `otel-forge run`'s journal opened: its command's journals go there
    for spool in spools_in(path):
        launchers = is_launchers_journal(spool)
        try:
            result = replay(spool, tracking_uri, job_run_id, progress)
        except SpoolBusy:
            yield spool, None
            continue
        if launchers:
            job_run_id = result.run_id
        yield spool, result
    remove_if_empty(path)


def kept_in(path: Path) -> tuple[int, int]:
    """The metric values (in runs' journals) and system-metrics windows the spools in ``path`` keep."""
    values = windows = 0
    for spool in spools_in(path) if path.is_dir() else []:
        if is_journal(spool):
            values += undelivered(spool).values
        else:
            windows += len(WindowSpool.pending_files(spool))
    return values, windows


def replay_journal(
    path: Path, tracking_uri: str | None = None, job_run_id: str | None = None, progress: Progress = _no_progress
) -> ReplayResult:
    """A run's journal, delivered as its delivery process would have: the run opened as the training
    process would have opened it, every record in order, the run ended as it ended (KILLED where
    its process died without ending it)."""
    delivery = JournalDelivery(
        path, tracking_uri=tracking_uri, pace=DeliveryPace(fsync_s=0.0, patience_s=0.0), job_run=lambda: job_run_id,
        caller_reports=True, on_delivered=lambda count: progress(VALUES, count),
    )  # fmt: skip
    outcome = delivery.run()
    if outcome is Delivered.BUSY:
        raise SpoolBusy(f"another process is delivering {path} now")
    if outcome is not Delivered.ALL:
        raise RuntimeError(f"MLflow at {delivery.where}: {delivery.cause or 'delivery stopped'}")
    return ReplayResult(delivery.delivered_values, 0, delivery.run_id or "", 0, delivery.ended, VALUES)


def replay_spool(path: Path, tracking_uri: str | None = None, progress: Progress = _no_progress) -> ReplayResult:
    """Send the spool's windows in order to its run; delivered windows leave the spool.

    Stops at the first delivery failure (the rest stays for another try); a file that is not a
    window is set aside and skipped. Removes the spool once nothing is left in it.
    ``tracking_uri`` overrides the one recorded (which has no credentials).
    """
    with claim(path):
        return _replay_windows(path, tracking_uri, progress)


def _replay_windows(path: Path, tracking_uri: str | None, progress: Progress) -> ReplayResult:
    spool = WindowSpool.open(path)
    header = spool.header
    if "prefix" not in header:
        raise LookupError(f"{path} is no spool this version reads (its {HEADER} names no key prefix)")
    uri = tracking_uri or header.get("tracking_uri")
    run_id = header["run_id"] or _job_run_id(make_client(uri), header)
    spool.update_header(run_id=run_id)
    # Where the exporter never reached the server, the logger finds where the node's steps continue
    # (and opens the node's own run), as the exporter would have.
    log_window = WindowLogger(
        run_id,
        uri,
        header["prefix"],
        header.get("first_step"),
        node_run=header.get("node_run"),
        node_run_id=header.get("node_run_id"),
    )
    log_window.attach(run_id, RunInfo(None, "", header.get("experiment")))
    log_window.on_first_step.append(
        lambda step: spool.update_header(first_step=step, node_run_id=log_window.node_run_id)
    )
    delivered, ended = _deliver_windows(spool, log_window, progress)
    if not ended and log_window.node_run_id is not None and not writer_alive(header):
        # Its agent died without its last window (SIGKILL, a node lost): the node's run ends here.
        make_client(uri).set_terminated(log_window.node_run_id, "KILLED")
    if not spool.set_aside:
        spool.remove_if_empty()
    return ReplayResult(delivered, len(spool), run_id, spool.set_aside)


def _deliver_windows(spool: WindowSpool, log_window: WindowLogger, progress: Progress) -> tuple[int, bool]:
    """The spool's windows through the delivery engine, a backlog in few calls (the windows after the
    oldest that fit in the same one); the first failure ends it and is raised (the rest stays for
    another try). How many were delivered, and whether the last window was among them."""
    failures: list[BaseException] = []
    last: list[bool] = []

    def send(window: Window) -> None:
        log_window(window)
        last.append(window.last)

    def fail_fast(error: BaseException) -> Outcome:
        failures.append(error)
        return Outcome.STOP

    outbox = Outbox("replay", DeliveryStats(), max_queue=0, overflow=spool, write_ahead=True, join=WindowLogger.joined)
    outbox.on_delivered = lambda count: progress(WINDOWS, count)
    # The failure is raised to the command, which says it: the engine's own line is for debugging.
    policy = Policy(classify=fail_fast, notice_level=lambda: logging.DEBUG)
    delivery = Delivery(outbox, send, name="replay", policy=policy)
    delivery.finish(math.inf)  # everything there, at once
    delivery.run()
    if failures:
        raise failures[-1]
    return delivery.stats.delivered, any(last)


def _job_run_id(client: Any, header: dict[str, Any]) -> str:
    """The run of windows sampled before their job's run opened: the one the job key names."""
    job_run = header.get("job_run") or {}
    experiment, key = job_run.get("experiment"), job_run.get("job_key")
    if not (experiment and key):
        raise LookupError("the spool names no run (its run never opened)")
    run_id = published_run_id(find_experiment(client, experiment), key)
    if run_id is None:
        raise LookupError(f"job {key} has no run in experiment {experiment} yet: replay the job's run spool first")
    return str(run_id)


__all__ = [
    "ReplayResult",
    "RunGone",
    "SpoolBusy",
    "left_in",
    "replay",
    "replay_in",
    "replay_spool",
    "replay_journal",
    "spools_in",
]
