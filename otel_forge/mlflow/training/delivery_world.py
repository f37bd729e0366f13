"""``DeliveryWorld``: what a journal's delivery takes from the world around it: the time, a client
of the tracking server, whether the journal's writer lives, the pause a server asks for, whether it
takes connections. The delivery runs in the real one; the simulation test gives it a fake clock, an
in-memory server and a writer it kills at will."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from otel_forge.mlflow.client import TrackingClient, asked_pause_s, make_client
from otel_forge.mlflow.server_probe import check_connects
from otel_forge.mlflow.spool_files import writer_alive


@dataclass(frozen=True)
class DeliveryWorld:
    clock: Callable[[], float] = time.monotonic
    make_client: Callable[[str | None], TrackingClient] = make_client
    writer_alive: Callable[[Mapping[str, object]], bool] = writer_alive  # given the journal's header
    # The server's Retry-After, where ``error`` is its 429 or 503 (the tracking URI is the delivery's).
    asked_pause: Callable[[str | None, BaseException], float | None] = asked_pause_s
    check_connects: Callable[[str | None], None] = check_connects


REAL_WORLD = DeliveryWorld()
