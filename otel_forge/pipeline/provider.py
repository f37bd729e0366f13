"""The MeterProvider as the agent builds it: its readers, its resource, and no exemplars."""

from __future__ import annotations

import logging
from collections.abc import Sequence
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


def parent_only_reader(exporter: Any, first_collect_s: float | None = None, **options: Any) -> MetricReader:
    """A ``PeriodicExportingMetricReader`` whose timer stays in the process that made it, and whose
    first collect comes ``first_collect_s`` after its start (then one each interval): a run's first
    window need not wait a whole interval.

    The SDK restarts a reader's timer thread in every forked child (``os.register_at_fork``): each
    ``DataLoader`` worker would sample the node and export into the parent's run and spool. A
    child owns none of the agent (``otel_forge.forking``): no thread there.
    """
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    class _ParentOnlyReader(PeriodicExportingMetricReader):
        def _at_fork_reinit(self) -> None:
            pass

        def _ticker(self) -> None:
            if first_collect_s is not None and not self._shutdown_event.wait(first_collect_s):
                try:
                    self.collect(timeout_millis=self._export_timeout_millis)
                except Exception:  # a timeout, as the SDK's ticker would: the ticker goes on
                    _logger.warning("the first metric collection failed", exc_info=True)
            super()._ticker()

    return _ParentOnlyReader(exporter, **options)
