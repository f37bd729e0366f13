"""``ProgressCollector``: the training's progress as readings, beside the hardware's.

It reads the node's latest look at its ranks (``progress.tracker.JobProgress``, taken by the
process that watches them once a second) and the node's GPUs (energy, models) from the hardware
collectors' cached snapshots: nothing is read twice. ``JobEnergy`` keeps the node's GPU energy over
the job, for the per-step figure and for the end's ``energy/<host>.json`` (the watch writes it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from otel_forge.collectors.base import Collector, Readings
from otel_forge.config import ForgeConfig
from otel_forge.progress.throughput import flops_per_step, mfu
from otel_forge.progress.tracker import Activity, JobProgress, RankView

RANK = "otel_forge.training.rank"
NO_RANK = "none"


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


class ProgressCollector(Collector):
    name = "progress"

    def __init__(
        self,
        latest: Callable[[], JobProgress | None],
        config: ForgeConfig,
        host: str,
        gpus: Callable[[], NodeGpus] = lambda: NodeGpus(None, ()),
        energy: JobEnergy | None = None,
    ) -> None:
        self._latest = latest
        self._config = config
        self._host = host
        self._gpus = gpus
        # The job's energy: the one the watch whose look ``latest`` is keeps (its ``energy``), which
        # writes the end's figure; else one of our own.
        self.energy = energy or _energy_of(latest)
        self.energy.read_through(gpus)

    def read(self, readings: Readings) -> None:
        self.energy.add_gpus(self._gpus())  # from the first collect on: the job's energy starts before CMD
        progress = self._latest()
        if progress is None:
            return
        for view in progress.ranks:
            _add_rank(readings, view, self._host, view is progress.slow_rank or _same(view, progress.slow_rank))
        self._add_job(readings, progress)
        self._add_time(readings, progress)
        self._add_energy(readings, progress)

    def _add_job(self, readings: Readings, progress: JobProgress) -> None:
        rate = progress.steps_per_s
        readings.add("otel_forge.training.steps.rate", rate)
        config = self._config
        if config.samples_per_step is not None:
            readings.add("otel_forge.training.samples.rate", rate * config.samples_per_step)
        if config.tokens_per_step is not None:
            readings.add("otel_forge.training.tokens.rate", rate * config.tokens_per_step)
        step_flops = flops_per_step(config.flops_per_step, config.model_parameters, config.tokens_per_step)
        models = self._gpus().models if step_flops is not None else ()
        utilisation = mfu(rate, step_flops, models, progress.world_size, config.gpu_peak_flops)
        readings.add("otel_forge.training.mfu", utilisation)
        stalled = progress.activity is Activity.STALLED
        suspect = str(progress.suspect_rank) if stalled and progress.suspect_rank is not None else NO_RANK
        readings.add("otel_forge.training.stalled", int(stalled), {RANK: suspect, "host.name": self._host})

    def _add_time(self, readings: Readings, progress: JobProgress) -> None:
        for activity, seconds in progress.time_s.items():
            readings.add("otel_forge.training.time", seconds, {"otel_forge.training.activity": activity.value})
            if activity is not Activity.RESTART_LOST:
                current = int(activity is progress.activity)
                readings.add("otel_forge.training.activity", current, {"otel_forge.training.activity": activity.value})
        readings.add("otel_forge.training.goodput", progress.goodput)

    def _add_energy(self, readings: Readings, progress: JobProgress) -> None:
        self.energy.add_steps(progress)
        if (per_step := self.energy.per_step) is not None:
            readings.add("otel_forge.training.energy.per_step", per_step)


def _energy_of(latest: Callable[[], JobProgress | None]) -> JobEnergy:
    energy = getattr(getattr(latest, "__self__", None), "energy", None)
    return energy if isinstance(energy, JobEnergy) else JobEnergy()


def _same(view: RankView, other: RankView | None) -> bool:
    return other is not None and other.rank == view.rank


def _add_rank(readings: Readings, view: RankView, host: str, slow: bool) -> None:
    rank = {RANK: str(view.rank)}
    progress = view.progress
    readings.add("otel_forge.training.step", max(progress.steps, progress.logged_step), rank)
    readings.add("otel_forge.training.step.duration", view.p50_s, {**rank, "otel_forge.training.quantile": "p50"})
    readings.add("otel_forge.training.step.duration", view.p95_s, {**rank, "otel_forge.training.quantile": "p95"})
    readings.add("otel_forge.training.step.work", view.work_s, rank)
    readings.add("otel_forge.training.step.work.ratio", view.work_ratio, rank)
    readings.add("otel_forge.training.step.age", view.age_s, rank)
    readings.add("otel_forge.training.slow_rank", int(slow), {**rank, "host.name": host})


def gpus_from(snapshots: Callable[[], Iterable[Readings]]) -> Callable[[], NodeGpus]:
    """``NodeGpus`` from the hardware collectors' latest readings (``hw.energy``, their ``hw.model``)."""

    def read() -> NodeGpus:
        energy: float | None = None
        by_gpu: dict[str, float] = {}
        models: list[str] = []
        for readings in snapshots():
            for attributes, joules in readings.get("hw.energy"):
                energy = (energy or 0.0) + joules
                if "hw.parent" not in attributes:  # a whole GPU's counter (a MIG instance has none of its own)
                    by_gpu[f"{attributes.get('hw.vendor', '')}:{attributes.get('hw.id', len(by_gpu))}"] = joules
            for attributes, _ in readings.get("hw.gpu.utilization"):
                if model := str(attributes.get("hw.model") or attributes.get("hw.name") or ""):
                    models.append(model)
        return NodeGpus(energy, tuple(models), by_gpu)

    return read
