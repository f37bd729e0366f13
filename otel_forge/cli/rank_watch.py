"""Whether this node holds global rank 0, once the launcher's workers run: read from their
environment (torchrun hands each worker its ``RANK`` at rendezvous, after ``otel-forge run`` started).

A node that could not tell at start (its rendezvous endpoint named by an address or name it does
not recognise as its own) must not leave the job without a run: the node whose worker is rank 0
makes it, as it would have at start.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import psutil

_logger = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.5


def runs_rank_zero(root: psutil.Process) -> bool:
    """Whether a process under ``root`` is the job's global rank 0."""
    for process in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if process.environ().get("RANK") == "0":
                return True
    return False


class RankZeroWatch:
    """Looks, every ``interval_s``, for a worker of global rank 0 under this process, until one
    appears (then ``on_rank_zero`` is called once) or ``stop()``."""

    def __init__(self, on_rank_zero: Callable[[], None], interval_s: float = WATCH_INTERVAL_S) -> None:
        self._on_rank_zero = on_rank_zero
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="otel-forge-rank-watch", daemon=True)

    def start(self) -> RankZeroWatch:
        self._thread.start()
        return self

    def _watch(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(self._interval_s):
            if runs_rank_zero(me):
                _logger.info("this node runs global rank 0: it opens the job's run")
                self._on_rank_zero()
                return

    def stop(self) -> None:
        self._stop.set()
