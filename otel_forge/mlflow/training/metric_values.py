"""What ``log()`` checks before it journals a value: a step and values MLflow can store, under keys it
accepts, so that one bad value costs only itself, never the batch it would join."""

from __future__ import annotations

import logging
import math
from collections.abc import Hashable, Mapping
from typing import TypeVar

from otel_forge.mlflow.keys import sanitize_key
from otel_forge.mlflow.training.run_metadata import REJECTED_TAG
from otel_forge.ratelimit import RateLimitedLogger

_logger = logging.getLogger(__name__)

MAX_KEY_CHARS = 250  # MLflow's limit for a metric key
MAX_STEP = 2**63 - 1  # MLflow stores steps as int64
_Key = TypeVar("_Key", bound=Hashable)  # log() takes any key it can name with str()


def checked_step(step: object) -> int | None:
    """``step`` as MLflow can store it (an integer from 0 to int64's max, integral floats and
    numpy/torch scalars included); None otherwise."""
    if hasattr(step, "item") and not isinstance(step, (int, float)):
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, (int, float)):
        return None
    if isinstance(step, float) and not step.is_integer():
        return None
    return int(step) if 0 <= step <= MAX_STEP else None


def checked_value(value: object) -> float | None:
    """A number MLflow can store: finite, or NaN (a diverged loss is worth seeing); else None."""
    try:
        # float() is the judge: whatever it refuses raises, and is refused here.
        number = float(value.item() if hasattr(value, "item") else value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):
        return None
    return None if math.isinf(number) else number


_MAX_REMEMBERED_KEYS = 10_000


class MetricChecker:
    """Checks one ``log()`` call's values; counts and warns (rate-limited) what it refuses."""

    def __init__(self, warnings: RateLimitedLogger) -> None:
        self.refused = 0  # values refused as bad input, each warned (at most once a minute)
        self.lost = 0  # good values the journal could not keep (a full or failing disk)
        self._lost_why = ""
        self._warned = 0  # the count the last warning said
        self._warnings = warnings
        self._key_names: dict[Hashable, str | None] = {}

    def values(self, metrics: Mapping[_Key, object]) -> dict[str, float]:
        values: dict[str, float] = {}
        for key, raw in metrics.items():
            name = self._key_name(key)
            if name is None:
                self.reject(1, "metric key %r is longer than %d characters", str(key)[:80], MAX_KEY_CHARS)
            elif name in values:
                self.reject(1, "metric key %r is %r once sanitised, as another key of the same step", key, name)
            elif (value := checked_value(raw)) is None:
                self.reject(1, "metric %r: %r is not a finite number or NaN", name, str(raw)[:80])
            else:
                values[name] = value
        return values

    @property
    def rejected(self) -> int:
        """Every value ``log()`` took and did not keep, whatever the reason."""
        return self.refused + self.lost

    def reject(self, count: int, message: str, *args: object) -> None:
        self.refused += count
        self._warn(message + "; dropped", *args)

    def lose(self, count: int, why: str) -> None:
        """``count`` good values that the journal could not keep, because of ``why``."""
        self.lost += count
        self._lost_why = why
        self._warn("the run's journal cannot be written (%s): values dropped", why)

    def _warn(self, message: str, *args: object) -> None:
        if self._warnings.warning("log-rejected", "MLflow: " + message + " (%d value(s) so far)", *args, self.rejected):
            self._warned = self.rejected

    def say_total(self) -> None:
        """The warnings per value are rate-limited: the total, once the run is closed."""
        if self.rejected == self._warned:
            return
        reasons = [f"{self.refused} refused (bad step, key or value)"] if self.refused else []
        reasons += [f"{self.lost} lost (the run's journal could not be written: {self._lost_why})"] if self.lost else []
        _logger.warning(
            "MLflow: %d metric value(s) were dropped in all: %s; tag %s of the run holds the count",
            self.rejected,
            ", ".join(reasons),
            REJECTED_TAG,
        )

    def _key_name(self, key: Hashable) -> str | None:
        """The key as MLflow accepts it, or None; remembered, since the same keys come every step."""
        if (name := self._key_names.get(key, "")) != "":
            return name
        name = sanitize_key(str(key))
        name = name if len(name) <= MAX_KEY_CHARS else None
        if len(self._key_names) < _MAX_REMEMBERED_KEYS:
            self._key_names[key] = name
        return name
