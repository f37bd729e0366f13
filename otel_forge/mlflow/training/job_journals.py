"""``JobJournals``: the journals a launcher's command writes in the job's directory (its
``TrainingRun``s, each in a process that may die at any moment), each delivered by a thread of the
launcher (``otel-forge run``), which outlives them."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.spool_files import HEADER
from otel_forge.mlflow.training.journal_delivery import JournalDelivery
from otel_forge.mlflow.training.run_journal import is_journal, read_header

_SCAN_S = 0.5  # how often the job's directory is looked at for a new journal


class JobJournals:
    """Delivers every journal that appears in ``directory`` (but ``own``) into the job's run."""

    def __init__(
        self, directory: Path, tracking_uri: str, config: ForgeConfig, job_run: Callable[[], str | None]
    ) -> None:
        self._directory = directory
        self._tracking_uri = tracking_uri
        self._config = config
        self._job_run = job_run
        self._deliveries: dict[Path, tuple[JournalDelivery, threading.Thread]] = {}
        self._own: Path | None = None  # the launcher's own journal, which its TrainingRun delivers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._scan, name="otel-forge-job-journals", daemon=True)

    def start(self, own: Path | None = None) -> JobJournals:
        self._own = own
        self._thread.start()
        return self

    def finish(self, deadline_s: float) -> None:
        """The command has exited: deliver what its journals hold within ``deadline_s``."""
        self._stop.set()
        self._thread.join()
        self._look()  # a journal written just before the command exited
        for delivery, _ in self._deliveries.values():
            delivery.finish(deadline_s)
        for _, thread in self._deliveries.values():
            thread.join()

    def _scan(self) -> None:
        while not self._stop.wait(_SCAN_S):
            self._look()

    def _look(self) -> None:
        for header in sorted(self._directory.glob(f"*/{HEADER}")):
            journal = header.parent
            if journal in self._deliveries or journal == self._own or not is_journal(journal):
                continue
            if read_header(journal).get("launcher", False):
                continue  # ours, begun after the command started (the script names the experiment)
            delivery = JournalDelivery.for_config(journal, self._config, self._tracking_uri, job_run=self._job_run)
            thread = threading.Thread(target=delivery.run, name="otel-forge-journal", daemon=True)
            self._deliveries[journal] = (delivery, thread)
            thread.start()
