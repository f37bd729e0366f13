"""Samples -> windows: ``samples_per_window`` samples fold into one MLflow step; what a window
sends (only the values that changed) and when (each node at its own phase of the window)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass

from otel_forge.mlflow.keys import Sample
from otel_forge.names import Fold


@dataclass(frozen=True)
class Window:
    """One MLflow step's worth of metrics. ``step`` = the exporter's first step + ``index``.

    ``before``: values of the previous step (at ``before_timestamp_ms``) that were held back there,
    sent now that they change: MLflow draws 100, 100, 90 as a step, not as a slope from the last 100 sent.

    ``earlier``: windows that go to the server in the same call, before this one (``joined``): windows
    due together (a close after a window not yet sent, a backlog after an outage) cost the server one
    call, and one update of each key's latest value, instead of one per window.
    """

    index: int
    timestamp_ms: int
    values: tuple[tuple[str, float], ...]
    last: bool = False  # the exporter's last: a node's own run ends with it
    before: tuple[tuple[str, float], ...] = ()
    before_timestamp_ms: int = 0
    earlier: tuple[Window, ...] = ()  # never spooled: each stays in the spool until the call answers

    @property
    def parts(self) -> tuple[Window, ...]:
        """The windows this one delivers, oldest first."""
        return (*self.earlier, dataclasses.replace(self, earlier=())) if self.earlier else (self,)

    @property
    def size(self) -> int:
        """The MLflow metrics it makes."""
        return sum(len(part.values) + len(part.before) for part in self.parts)

    def joined(self, later: Window) -> Window:
        """This window, then ``later``, as one delivery."""
        return dataclasses.replace(later, earlier=(*self.parts, *later.earlier))

    def to_json(self) -> dict:
        data: dict = {"index": self.index, "timestamp_ms": self.timestamp_ms, "values": [list(v) for v in self.values]}
        if self.before:
            data.update(before=[list(v) for v in self.before], before_timestamp_ms=self.before_timestamp_ms)
        return {**data, "last": True} if self.last else data

    @classmethod
    def from_json(cls, data: dict) -> Window:
        values = tuple((str(k), float(v)) for k, v in data["values"])
        before = tuple((str(k), float(v)) for k, v in data.get("before", ()))
        return cls(
            int(data["index"]), int(data["timestamp_ms"]), values, bool(data.get("last", False)), before,
            int(data.get("before_timestamp_ms", 0)),
        )  # fmt: skip


class WindowFolder:
    """Folds samples into windows: gauges to mean (and max/min), counters to growth or rates.

    Rates span from the last sample of the previous window, so consecutive windows cover time
    without gaps; ``since_start`` values grow from the first sample the exporter ever saw. The first
    window may close sooner (``first_window_samples``) than the later ones: a run holds its hardware
    from its first seconds, at any job size.
    """

    def __init__(
        self, samples_per_window: int, stats: tuple[str, ...] = ("mean",), first_window_samples: int | None = None
    ) -> None:
        self.samples_per_window = samples_per_window
        self.first_window_samples = first_window_samples or samples_per_window
        self._extra_stats = tuple(s for s in stats if s != "mean")
        self._next_index = 0
        self._count = 0
        self._gauges: dict[str, list[float]] = {}
        self._latest: dict[str, tuple[Fold, float, float]] = {}  # key -> (fold, time_s, value)
        self._rate_start: dict[str, tuple[float, float]] = {}  # key -> (time_s, value) the window starts from
        self._baseline: dict[str, float] = {}
        self._last_time_s = 0.0
        self._last_timestamp_ms = -1

    def add(self, sample: Sample, time_s: float) -> Window | None:
        """Add one sample taken at wall-clock ``time_s``; returns the window it completes."""
        if not sample:
            return None  # an export before any instrument observed: not a sample of the hardware
        for key, (fold, value) in sample.items():
            if fold is Fold.MEAN:
                self._gauges.setdefault(key, []).append(value)
                continue
            self._baseline.setdefault(key, value)
            self._rate_start.setdefault(key, (time_s, value))
            self._latest[key] = (fold, time_s, value)
        self._count += 1
        self._last_time_s = time_s
        window_samples = self.first_window_samples if self._next_index == 0 else self.samples_per_window
        return self.flush() if self._count >= window_samples else None

    def flush(self) -> Window | None:
        """Close the current window now (at shutdown); None when it holds no sample."""
        if self._count == 0:
            return None
        values = self._gauge_values() + self._counter_values()
        # Strictly rising with the steps: the last collect at shutdown may follow a periodic one
        # within the same millisecond.
        self._last_timestamp_ms = max(int(self._last_time_s * 1000), self._last_timestamp_ms + 1)
        window = Window(self._next_index, self._last_timestamp_ms, tuple(values))
        self._next_index += 1
        self._count = 0
        self._gauges = {}
        return window

    def _gauge_values(self) -> list[tuple[str, float]]:
        values = []
        for key, samples in self._gauges.items():
            values.append((key, sum(samples) / len(samples)))
            if "max" in self._extra_stats:
                values.append((f"{key}_max", max(samples)))
            if "min" in self._extra_stats:
                values.append((f"{key}_min", min(samples)))
        return values

    def _counter_values(self) -> list[tuple[str, float]]:
        values = []
        for key, (fold, time_s, value) in self._latest.items():
            if fold is Fold.LAST:
                values.append((key, value))
                continue
            if fold is Fold.SINCE_START:
                if value >= self._baseline[key]:
                    values.append((key, value - self._baseline[key]))
                continue
            start_s, start_value = self._rate_start[key]
            if time_s > start_s and value >= start_value:
                values.append((key, (value - start_value) / (time_s - start_s)))
            self._rate_start[key] = (time_s, value)  # the next window's rate starts here
        return values


class ChangedValues:
    """Keeps, of each window, the values that changed since they were last sent: a memory total or a
    power limit is sent once, not every window. Every value is sent again after ``refresh_windows``
    windows, so a chart's line goes on. The anchor (the smallest key) is sent every window: it
    counts the node's windows, and a resumed node finds its last step in that one key's history.
    A key's first window sends it; its last sends it too (``ended``, ``close``): every key's chart
    runs from its first step to its last, a line, never a lone point. A held value that changes is
    sent at the step before too (``Window.before``): a chart's history holds the change points."""

    def __init__(self, refresh_windows: int) -> None:
        self.refresh_windows = refresh_windows
        self._sent: dict[str, tuple[float, int]] = {}  # key -> (value, window index) last sent
        self._last: Window | None = None  # the last window kept, whole

    def keep(self, window: Window, *, whole: bool = False) -> Window:
        """``window`` with only the values to send (all of them if ``whole``)."""
        if not window.values:
            return window
        previous, self._last = self._last, window
        follows = previous is not None and previous.index == window.index - 1
        anchor = min(key for key, _ in window.values)
        kept, before = [], []
        for key, value in window.values:
            sent = self._sent.get(key)
            changed = sent is not None and sent[0] != value
            if sent is not None and changed and follows and sent[1] < window.index - 1:
                before.append((key, sent[0]))  # held back at the previous step, where it still had this value
            if whole or key == anchor or sent is None or changed or window.index - sent[1] >= self.refresh_windows:
                kept.append((key, value))
                self._sent[key] = (value, window.index)
        before_ms = previous.timestamp_ms if previous is not None and before else 0
        return Window(
            window.index, window.timestamp_ms, tuple(kept), before=tuple(before), before_timestamp_ms=before_ms
        )

    def ended(self, window: Window) -> Window | None:
        """What the last window held back of the keys ``window`` no longer has, at the last window's
        step: a key's line ends where the key did (a command's process keys, once it exits)."""
        present = {key for key, _ in window.values}
        return self._held_back(lambda key: key not in present)

    def close(self, window: Window | None) -> Window | None:
        """The close's values: ``window`` (the one the close completes) whole; without one, what the
        last window held back, at its step (its other values are already sent). None: nothing to send."""
        if window is not None:
            return self.keep(window, whole=True)
        return self._held_back(lambda key: True)

    def _held_back(self, chosen: Callable[[str], bool]) -> Window | None:
        last = self._last
        if last is None:
            return None
        held = tuple((key, value) for key, value in last.values if chosen(key) and self._sent[key][1] != last.index)
        for key, value in held:
            self._sent[key] = (value, last.index)
        return Window(last.index, last.timestamp_ms, held) if held else None


# The nodes' first windows spread over this long at most, whatever the window: every node run holds its
# hardware within seconds of the start. Not less: 32 agents sharing 2 cores, each importing MLflow's
# client at its first window, all held a window after 25-28 s at 20 s, 33-35 s at 15 s.
FIRST_WINDOW_SPREAD_S = 20.0
# A job's nodes, stopped together, spread their last calls over this share of the close's deadline.
CLOSE_SPREAD_SHARE = 0.5


def delivery_phase_s(node: str, window_s: float) -> float:
    """When in each window this node delivers, from 0 to ``window_s``: spread evenly by a hash of the
    node's name, so nodes started together do not all call the server at once, every window."""
    fraction = int.from_bytes(hashlib.sha256(node.encode()).digest()[:8], "big") / 2**64
    return fraction * window_s
