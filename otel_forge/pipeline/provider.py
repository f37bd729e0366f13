"""The MeterProvider as the agent builds it: its readers, its resource, and no exemplars."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader


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
