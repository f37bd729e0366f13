"""What earlier otel-forge processes left on this node, delivered in the background by the next one.

A job stopped together leaves its last windows in its nodes' spools when one tracking server cannot
take every node's last calls within the scheduler's grace. Nobody types 2,048 ``otel-forge replay``
commands: any otel-forge process that starts on the node (an agent, ``otel-forge run``, a
``TrainingRun``'s sampler) delivers what ended processes left under its spool root, oldest first.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from otel_forge.mlflow.spool_scan import left_in
from otel_forge.mlflow.system_metrics.windows import delivery_phase_s
from otel_forge.scrub import error_line

_logger = logging.getLogger(__name__)

# At most this many spools (or job directories) a start: a node's leftovers are a job's or two; a
# pile of them is for `otel-forge replay --all`.
MAX_SPOOLS = 64
# The nodes of the next job start together: each begins at its own phase of this spread.
START_SPREAD_S = 15.0


class LeftoverDelivery:
    """One daemon thread: after the node's phase of ``spread_s``, the spools under ``root`` whose
    writers have ended, oldest first, one at a time, at most ``max_spools``, until ``stop()``. What
    cannot be delivered now (its server down, its job's run not replayed yet) is kept for the next
    process or ``otel-forge replay --all``; a spool another process is delivering is left to it.
    Never holds the process's exit."""

    def __init__(
        self, root: Path, node: str, *, max_spools: int = MAX_SPOOLS, spread_s: float = START_SPREAD_S
    ) -> None:
        self.root = root
        self._max_spools = max_spools
        self._delay_s = delivery_phase_s(node, spread_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="otel-forge-leftovers", daemon=True)

    def start(self) -> LeftoverDelivery:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Take no further spool (a call under way ends on its own)."""
        self._stop.set()

    def _run(self) -> None:
        if self._stop.wait(self._delay_s):
            return
        left = left_in(self.root)[: self._max_spools]
        if left:
            _logger.info("delivering %d spool(s) that ended processes left in %s", len(left), self.root)
        for path in left:
            if self._stop.is_set():
                return
            self._deliver(path)

    def _deliver(self, path: Path) -> None:
        from otel_forge.mlflow.replay import replay_in

        try:
            for spool, result in replay_in(path):
                if result is not None:
                    _logger.info("delivered %d %s left in %s", result.delivered, result.unit, spool)
        except Exception as error:  # noqa: BLE001 - kept for the next process; one line says so
            _logger.info(
                "%s is kept (%s): the next otel-forge process on this node or `otel-forge replay --all` delivers it",
                path,
                error_line(error),
            )
            return
