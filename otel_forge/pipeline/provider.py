"""The MeterProvider as the agent builds it: its readers, its resource, and no exemplars."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader

_logger = logging.getLogger(__name__)


def _no_exemplar_views() -> list:
    """Views giving every instrument a reservoir that keeps nothing.

    Exemplars tie synchronous measurements to traces; observable readings have none, yet the SDK
    still offers and collects a reservoir per data point (a tenth of a reader's collect).
    """
    from opentelemetry.sdk.metrics import ExemplarReservoir
    from opentelemetry.sdk.metrics.view import View

    class _NoExemplars(ExemplarReservoir):
        def offer(self, value: Any, time_unix_nano: int, attributes: Any, context: Any) -> None:
            pass

        def collect(self, point_attributes: Any) -> list:
            return []

    return [View(instrument_name="*", exemplar_reservoir_factory=lambda aggregation: lambda **_: _NoExemplars())]


def build_meter_provider(readers: Sequence[MetricReader], resource: Any = None) -> MeterProvider:
    """A MeterProvider as the agent builds it: ``readers``, ``resource``, and no exemplars."""
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider

    options: dict[str, Any] = {"resource": resource} if resource is not None else {}
    return MeterProvider(
        metric_readers=readers, views=_no_exemplar_views(), exemplar_filter=AlwaysOffExemplarFilter(), **options
    )


def begin_sampling(readers: Sequence[MetricReader], expire: Callable[[], None]) -> None:
    """The instruments exist: the readers' first collects count from now, each reading the hardware
    afresh (``expire``: the instruments' cached snapshots), however close together."""
    for reader in readers:
        if (begin := getattr(reader, "begin", None)) is not None:
            begin(expire)


def parent_only_reader(exporter: Any, first_collects_s: Sequence[float] = (), **options: Any) -> MetricReader:
    """A ``PeriodicExportingMetricReader`` whose timer stays in the process that made it, and whose
    first collects come ``first_collects_s`` after ``begin()`` (then one each interval after the last
    of them): a run's first window need not wait a whole interval.

    The SDK restarts a reader's timer thread in every forked child (``os.register_at_fork``): each
    ``DataLoader`` worker would sample the node and export into the parent's run and spool. A
    child owns none of the agent (``otel_forge.forking``): no thread there.
    """
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    class _ParentOnlyReader(PeriodicExportingMetricReader):
        def __init__(self) -> None:
            self._begun = threading.Event()  # before the SDK starts the ticker's thread
            self._expire: Callable[[], None] = lambda: None
            super().__init__(exporter, **options)

        def _at_fork_reinit(self) -> None:
            pass

        def begin(self, expire: Callable[[], None]) -> None:
            """The instruments exist: the first collects count from now."""
            self._expire = expire
            self._begun.set()

        def _ticker(self) -> None:
            if first_collects_s:
                while not self._begun.wait(0.05):
                    if self._shutdown_event.is_set():
                        return
                begun = time.monotonic()
                for offset_s in first_collects_s:
                    if self._shutdown_event.wait(max(0.0, begun + offset_s - time.monotonic())):
                        break  # the loop below collects one last time
                    self._expire()
                    self._collect_now()
            interval_s = self._export_interval_millis / 1000
            while not self._shutdown_event.wait(interval_s):
                self._collect_now()
            # The last collect (a run's last sample) gets the export timeout too: the SDK's ticker gives
            # it the interval, which a loaded machine outlasts at a short one, and the sample is lost.
            self._collect_now()

        def _collect_now(self) -> None:
            try:
                self.collect(timeout_millis=self._export_timeout_millis)
            except Exception:  # a timeout, as the SDK's ticker would: the ticker goes on
                _logger.warning("a metric collection failed", exc_info=True)

    return _ParentOnlyReader()
