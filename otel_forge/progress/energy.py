"""``JobEnergy``: the node's GPU energy over the job, for the per-step figure and the end's
``energy/<host>.json`` (``TrainingWatch`` writes it; ``ProgressCollector`` adds each collect's readings)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from otel_forge.progress.tracker import JobProgress


@dataclass(frozen=True)
class NodeGpus:
    """What the progress figures need of the node's GPUs: their energy so far (J) and models;
    ``energy_by_gpu``: each whole GPU's counter (J), by vendor and ``hw.id``."""

    energy_j: float | None
    models: tuple[str, ...]
    energy_by_gpu: Mapping[str, float] = field(default_factory=dict)


class JobEnergy:
    """The node's GPU energy over the job: each GPU's counter from its first reading (``otel-forge
    run``'s first read of the node's GPUs, before CMD starts) to its latest, summed over the GPUs; per
    step: over the optimizer steps the job took (each attempt's most steps of a rank on the node,
    summed over torchrun's attempts). A GPU that stops answering keeps its last reading. The agent's
    collects add readings; the watch takes the end's figure (``at_end``) after a last read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: dict[str, float] = {}
        self._latest: dict[str, float] = {}
        self._steps: dict[int, int] = {}  # attempt (torchrun's restart count) -> most steps of a rank
        self._read: Callable[[], NodeGpus] | None = None

    def read_through(self, gpus: Callable[[], NodeGpus]) -> None:
        """Where ``at_end`` takes its last reading of the GPUs."""
        self._read = gpus

    def add_gpus(self, gpus: NodeGpus) -> None:
        with self._lock:
            for gpu, joules in gpus.energy_by_gpu.items():
                self._first.setdefault(gpu, joules)
                self._latest[gpu] = joules

    def add_steps(self, progress: JobProgress) -> None:
        with self._lock:
            for view in progress.ranks:
                attempt = view.progress.identity.restart
                self._steps[attempt] = max(self._steps.get(attempt, 0), view.progress.steps)

    @property
    def joules(self) -> float | None:
        """The node's GPU energy since the job's start (J); None: no GPU energy read."""
        with self._lock:
            if not self._latest:
                return None
            return sum(joules - self._first[gpu] for gpu, joules in self._latest.items())

    @property
    def steps(self) -> int:
        with self._lock:
            return sum(self._steps.values())

    @property
    def per_step(self) -> float | None:
        joules, steps = self.joules, self.steps
        return joules / steps if joules is not None and steps > 0 else None

    def at_end(self, host: str, progress: JobProgress | None) -> dict[str, object] | None:
        """The job's figure for ``energy/<host>.json``, after a last read of the GPUs and the last
        look's steps; None where no GPU energy was read."""
        if self._read is not None:
            # The agent may be stopping: a read that fails leaves the last collect's reading.
            with contextlib.suppress(Exception):
                self.add_gpus(self._read())
        if progress is not None:
            self.add_steps(progress)
        joules = self.joules
        if joules is None:
            return None
        with self._lock:
            gpus = len(self._latest)
        return {
            "node": host,
            "gpus": gpus,
            "kwh": joules / 3.6e6,
            "joules": joules,
            "steps": self.steps,
            "joules_per_step": self.per_step,
        }
