"""``RunDelivery``: where a run's journal is delivered and its node sampled, out of the training loop's
way: by ``otel-forge run``, which delivers its command's journals (nothing to start here); by this
process on a thread, where it outlives the training (``otel-forge run``'s own journal); else by a
``CompanionProcess``, which samples the node too where this process is its local rank 0."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from otel_forge.mlflow.client import RunInfo
from otel_forge.mlflow.companion import CompanionProcess
from otel_forge.mlflow.training.journal_delivery import JournalDelivery
from otel_forge.mlflow.training.run_journal import RunEnd
from otel_forge.mlflow.training.run_owner import OpenRun
from otel_forge.mlflow.training.run_plan import RunPlan
from otel_forge.scrub import error_line

_logger = logging.getLogger(__name__)


class RunDelivery:
    """Delivers ``journal`` (None: a rank that journals nothing) and samples the plan's node."""

    def __init__(self, plan: RunPlan, journal: Path | None, here: bool) -> None:
        self._plan = plan
        self._journal = None if plan.delivered_by_launcher else journal
        self._here = here
        self._thread: tuple[JournalDelivery, threading.Thread] | None = None
        self._companion: CompanionProcess | None = None
        self._started = False

    def start(self) -> None:
        try:
            self._start()
        finally:
            self._started = True

    def _start(self) -> None:
        plan, journal = self._plan, self._journal
        if journal is not None and self._here:
            delivery = JournalDelivery.for_config(journal, plan.forge_config, plan.tracking_uri)
            self._thread = (delivery, threading.Thread(target=delivery.run, name="otel-forge-journal", daemon=True))
            self._thread[1].start()
            journal = None
        sample = plan.samples_node and bool(plan.owns_run or plan.requested_run_id or plan.node.job_key)
        if not (sample or journal):
            return
        config = plan.forge_config.replace(run_id=None, tracking_uri=plan.tracking_uri)
        try:
            companion = CompanionProcess(
                config, plan.node, sample=sample, journal=journal, tracking_uri=plan.tracking_uri
            )
            self._companion = companion.start()
        except Exception as error:  # noqa: BLE001 - the journal stays for `otel-forge replay`
            _logger.warning("the otel-forge companion did not start: %s", error_line(error))

    def delivers_journal(self) -> bool | None:
        """Another process of ours delivers the journal (and opens the run, where the plan says so);
        None until ``start`` has started it, or failed to."""
        if not self._started:
            return None
        return self._journal is not None and self._companion is not None and self._companion.delivers

    def attach(self, run: OpenRun) -> None:
        """The run is open: the node's windows go to it."""
        if self._companion is not None:
            self._companion.attach(run.run_id, RunInfo(run.experiment_id, run.run_name or "", run.experiment))

    def finish(self, end: RunEnd | None = None) -> bool:
        """The journal has its end (or ``end``: the one it could not keep): deliver it within the drain
        deadline. True once the run's end reached the server; False where it is left in the journal
        (or is delivered elsewhere)."""
        if self._thread is not None:
            delivery, thread = self._thread
            delivery.finish(self._plan.forge_config.close_deadline_s(self._plan.node.node_count), end)
            thread.join()
            return delivery.ended is not None
        if self._companion is not None:
            self._companion.stop(end)
            return self._journal is not None and not self._journal.exists()
        return False
