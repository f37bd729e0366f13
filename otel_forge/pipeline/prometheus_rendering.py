"""``PrometheusRendering``: the agent's last collect, as the bodies a ``/metrics`` scrape is answered with.

A sink of the agent's one collect: it keeps the latest ``MetricsData``. The first scrape after a collect
translates it to Prometheus families with opentelemetry-exporter-prometheus's own translation and
encodes them with prometheus_client (text or OpenMetrics, as the scraper's ``Accept`` negotiates; gzip
when accepted); later scrapes of that collect get the same bytes. Any number of scrapers cost at most
one translation and one encoding per format per collect, no SDK collect (none at all when nobody
scrapes). A scrape before the first collect triggers that collect, once.

prometheus_client encodes a body family after family; a family equal to the one of the last collect
(its samples unchanged: limits, totals, idle counters) keeps its bytes, so a collect costs the encoding
of what changed.
"""

from __future__ import annotations

import functools
import gzip
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExportResult, MetricsData
from prometheus_client.exposition import choose_encoder, gzip_accepted
from prometheus_client.openmetrics import exposition as openmetrics

from otel_forge.pipeline.fanout import NonBlockingExporter
from otel_forge.pipeline.prometheus_translation import PrometheusTranslation, memoize

Encoder = Callable[[Any], bytes]  # prometheus_client's: a registry (anything with collect()) -> body
Answer = tuple[bytes, tuple[tuple[str, str], ...]]  # a scrape's body and its headers

# Level 1: a tenth of the default level's CPU for a metrics page, most of its compression.
_GZIP_LEVEL = 1


@dataclass
class _Families:
    """Prometheus families, as prometheus_client's encoders read a registry."""

    families: Sequence[Any] = ()

    def collect(self) -> Iterable[Any]:
        return self.families


@dataclass
class _Rendered(_Families):
    """One collect: its data until the first scrape that needs them translates it to families, and the
    bodies made from them so far, by (content type, gzip)."""

    data: MetricsData | None = None
    bodies: dict[tuple[str, bool], bytes] = field(default_factory=dict)


def _cheapest(encoder: Encoder) -> Encoder:
    """``encoder`` (prometheus_client's, as negotiated), or one giving the same bytes for less CPU.

    OpenMetrics asked for without an ``escaping`` (Prometheus 2's ``Accept``) means "underscores",
    which prometheus_client applies to every sample name a character at a time (a third of the
    encoding's CPU). The OTel translation already gives legacy names (runs of other characters made
    one ``_``: no ``:``, no leading ``__``), which that escaping leaves as they are, and so does
    allow-utf-8's plain pass over them: the same bytes, cheaper.
    """
    if isinstance(encoder, functools.partial) and encoder.keywords.get("escaping") == openmetrics.UNDERSCORES:
        return functools.partial(encoder, escaping=openmetrics.ALLOWUTF8)
    return encoder


@functools.lru_cache(maxsize=64)
def _negotiated(accept: str, accept_encoding: str) -> tuple[str, bool]:
    """(content type, gzip) for a scraper's ``Accept`` and ``Accept-Encoding``, as prometheus_client
    negotiates them; a scraper sends the same headers every time."""
    return choose_encoder(accept)[1], gzip_accepted(accept_encoding)


@functools.lru_cache(maxsize=64)
def _headers(content_type: str, compressed: bool) -> tuple[tuple[str, str], ...]:
    return (("Content-Type", content_type), *((("Content-Encoding", "gzip"),) if compressed else ()))


# prometheus_client's escaping of names and label values (regexes and replaces, a label at a time, for
# every sample of every family it encodes): pure functions, looked up in the module at each call.
_ESCAPES = ("escape_metric_name", "escape_label_name", "_escape", "_is_valid_legacy_metric_name")


class _FamilyEncoding:
    """One format's encoder, fed one collect's families after another: a family equal to the last
    collect's family of that name is not encoded again, its bytes are."""

    def __init__(self, encoder: Encoder) -> None:
        memoize(openmetrics, _ESCAPES)
        self._encoder = _cheapest(encoder)
        self._trailer = self._encoder(_Families())  # OpenMetrics' "# EOF" line; nothing for text
        self._last: dict[str, tuple[Any, bytes]] = {}
        self.families_encoded = 0

    def encode(self, families: Sequence[Any]) -> bytes:
        last, self._last = self._last, {}
        parts = []
        for family in families:
            kept = last.get(family.name)
            if kept is None or kept[0] != family:  # prometheus_client compares name, type, help, samples
                kept = (family, self._encode_one(family))
            self._last[family.name] = kept
            parts.append(kept[1])
        return b"".join([*parts, self._trailer])

    def _encode_one(self, family: Any) -> bytes:
        self.families_encoded += 1
        encoded = self._encoder(_Families([family]))
        return encoded[: len(encoded) - len(self._trailer)]


class PrometheusRendering(NonBlockingExporter):
    """The latest collect, and the bodies a scrape is answered with, made once per collect."""

    def __init__(self) -> None:
        super().__init__()
        self._translation = PrometheusTranslation()
        self._encodings: dict[str, _FamilyEncoding] = {}  # by content type
        self._latest: _Rendered | None = None
        self._lock = threading.Lock()
        self._first_collect = threading.Lock()  # two scrapes before any collect trigger one
        self.collect_now: Callable[[], None] | None = None  # the agent's reader: a scrape before any collect
        self.renderings = 0  # collects translated (at most one per collect; none when nobody scrapes)
        self.encodings = 0  # bodies made (once per collect, format and compression asked for)

    @property
    def families_encoded(self) -> int:
        """Families encoded, all formats: those unchanged since the last collect are not."""
        return sum(encoding.families_encoded for encoding in self._encodings.values())

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: object) -> MetricExportResult:
        # One store, no lock: a scrape rendering the last collect holds its own reference to it, and the
        # collect (the agent's reader) never waits for that rendering.
        self._latest = _Rendered(data=metrics_data)
        return MetricExportResult.SUCCESS

    def made_body(self, accept: str | None, accept_encoding: str | None) -> Answer | None:
        """The answer to a scrape with these headers if this collect's body for them is made, else None
        (``body`` makes it): a cheap look, for a caller that must not wait on a translation."""
        rendered = self._latest
        if rendered is None:
            return None
        key = _negotiated(accept or "", accept_encoding or "")
        body = rendered.bodies.get(key)
        return None if body is None else (body, _headers(*key))

    def body(self, accept: str | None, accept_encoding: str | None) -> Answer:
        """The body and headers answering a scrape with these ``Accept`` headers."""
        rendered = self._latest or self._first()
        key = content_type, compressed = _negotiated(accept or "", accept_encoding or "")
        with self._lock:  # scrapes at once: one renders, the others wait for its bytes
            body = rendered.bodies.get(key)
            if body is None:
                self._translate(rendered)
                encoding = self._encodings.get(content_type)
                if encoding is None:
                    encoding = self._encodings[content_type] = _FamilyEncoding(choose_encoder(accept or "")[0])
                body = encoding.encode(rendered.families)
                rendered.bodies[key] = body = gzip.compress(body, _GZIP_LEVEL) if compressed else body
                self.encodings += 1
        return body, _headers(content_type, compressed)

    def _translate(self, rendered: _Rendered) -> None:
        if rendered.data is not None:
            rendered.families, rendered.data = self._translation.translate(rendered.data), None
            self.renderings += 1

    def _first(self) -> _Rendered:
        with self._first_collect:
            if self._latest is None and self.collect_now is not None:
                self.collect_now()  # exports inline, to us: sets _latest
            return self._latest or _Rendered()

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: object) -> None:
        pass
