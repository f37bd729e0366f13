"""What the fake ``pynvml`` and the fake ``amdsmi`` share: reading the scenario, counting calls and
serving values. A plain module beside them: whoever finds a fake (tests/fakes on ``sys.path`` or
``PYTHONPATH``) finds this one too."""

from __future__ import annotations

import json
import os
from collections import Counter
from typing import Any

ENV_VAR = "OTEL_FORGE_FAKE_GPUS"


def load_scenario(override: dict | None, vendor: str, off_key: str) -> dict:
    """``override``, else the env var (JSON text, or a path to a JSON file). Keys under ``vendor``
    apply over the top-level ones; ``vendor: false`` makes it ``{off_key: True}``."""
    if override is not None:
        scenario = dict(override)
    else:
        text = os.environ.get(ENV_VAR, "").strip() or "{}"
        if not text.startswith("{"):
            with open(text, encoding="utf-8") as file:
                text = file.read()
        scenario = json.loads(text)
    own = scenario.pop(vendor, {})
    return {off_key: True} if own is False else {**scenario, **own}


class FakeState:
    """The simulation's state: ``lock`` guards it; ``calls``, ``variant_calls`` and ``ticks`` count."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock
        self.scenario: dict = {}
        self.initialized = 0
        self.calls: Counter = Counter()  # (function, gpu index or None) -> calls
        self.variant_calls: Counter = Counter()  # (function, variant, gpu index) -> calls
        self.ticks: Counter = Counter()  # (value key, gpu index) -> values served

    def count_calls(self, function: str | None = None, index: int | None = None) -> int:
        """How many times ``function`` (any, if None) was called, for GPU ``index`` (any, if None)."""
        with self.lock:
            return sum(
                count for (name, gpu), count in self.calls.items() if function in (None, name) and index in (None, gpu)
            )

    def call_counts(self) -> dict[tuple[str, int | None], int]:
        with self.lock:
            return dict(self.calls)

    def reset_counts(self) -> None:
        with self.lock:
            self.calls.clear()

    def value(self, gpu: Any, key: str, default: Any) -> Any:
        """The next value of ``key`` for ``gpu``: its scenario sequence, else ``default(n, index)``."""
        with self.lock:
            n = self.ticks[(key, gpu.index)]
            self.ticks[(key, gpu.index)] += 1
        sequence = self.scenario.get("sequences", {}).get(str(gpu.index), {}).get(key)
        # default() takes a number: a device keyed by text (a MIG instance) gives its ``ordinal``.
        return sequence[n % len(sequence)] if sequence else default(n, getattr(gpu, "ordinal", gpu.index))
