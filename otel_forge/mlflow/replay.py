"""Deliver a spool left behind by an exporter that closed while the server was down."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from otel_forge.mlflow.client import RunGone, WindowLogger, live_run, make_client, next_system_step
from otel_forge.mlflow.spool import WindowSpool

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayResult:
    delivered: int
    remaining: int
    run_id: str
    set_aside: int = 0  # files that were not windows, kept beside the spool as *.corrupt


def replay_spool(path: Path, tracking_uri: str | None = None) -> ReplayResult:
    """Send the spool's windows in order to its run; delivered windows leave the spool.

    Stops at the first delivery failure (the rest stays for another try); a file that is not a
    window is set aside and skipped. Removes the spool once nothing is left in it.
    ``tracking_uri`` overrides the one recorded (which has no credentials).
    """
    spool = WindowSpool.open(path)
    header = spool.header
    uri = tracking_uri or header.get("tracking_uri")
    run_id, prefix = header["run_id"], header["prefix"]
    first_step = header.get("first_step")
    if first_step is None:
        # The exporter never reached the server: continue after what the node has in the run.
        first_step = next_system_step(live_run(make_client(uri), run_id), prefix)
        spool.update_header(first_step=first_step)
    log_window = WindowLogger(run_id, uri, prefix, first_step)
    delivered = 0
    while (window := spool.peek()) is not None:
        log_window(window)
        spool.pop()
        delivered += 1
    if not spool.set_aside:
        spool.remove_if_empty()
    return ReplayResult(delivered, len(spool), run_id, spool.set_aside)


__all__ = ["ReplayResult", "RunGone", "replay_spool"]
