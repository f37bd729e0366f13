"""What the collector tests share: open a collector against a GPU fake, read a collector once, pick values."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from otel_forge.collectors.base import Readings
from otel_forge.config import ForgeConfig


@contextlib.contextmanager
def opened_with(
    fake: Callable[[dict], contextlib.AbstractContextManager[Any]],
    collector_class: Any,
    scenario: dict,
    **settings: Any,
) -> Iterator[tuple[Any, Any]]:
    """(the fake module, a collector created on it with ``settings``), closed at the end."""
    with fake(scenario) as module:
        collector = collector_class.create(ForgeConfig.resolve(environ={}, **settings))
        try:
            yield module, collector
        finally:
            collector.close()


def read(collector: Any) -> Readings:
    readings = Readings()
    collector.read(readings)
    return readings


def by_gpu(readings: Readings, metric: str, **attributes: str) -> dict[str, float]:
    """Values of ``metric`` keyed by hw.id, among readings carrying ``attributes``."""
    return {
        attrs["hw.id"]: value
        for attrs, value in readings.get(metric)
        if all(attrs.get(key) == wanted for key, wanted in attributes.items())
    }


def messages(caplog: pytest.LogCaptureFixture, level: int, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == level and text in r.getMessage()]
