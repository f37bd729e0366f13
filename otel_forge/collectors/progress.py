"""``ProgressCollector``: the training's progress as readings, beside the hardware's.

It reads the node's latest look at its ranks (``progress.tracker.JobProgress``, taken by the
process that watches them once a second) and the node's GPUs (energy, models) from the hardware
collectors' cached snapshots: nothing is read twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from otel_forge.collectors.base import Collector, Readings
from otel_forge.config import ForgeConfig
from otel_forge.progress.energy import JobEnergy, NodeGpus
from otel_forge.progress.throughput import flops_per_step, mfu
from otel_forge.progress.tracker import Activity, JobProgress, RankView

RANK = "otel_forge.training.rank"
NO_RANK = "none"


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
        self.energy = energy or JobEnergy()  # the watch's, which writes the end's figure
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
        readings.add("otel_forge.training.steps", rate)
        config = self._config
        if config.samples_per_step is not None:
            readings.add("otel_forge.training.samples", rate * config.samples_per_step)
        if config.tokens_per_step is not None:
            readings.add("otel_forge.training.tokens", rate * config.tokens_per_step)
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
