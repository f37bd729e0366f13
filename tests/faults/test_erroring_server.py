"""A tracking server that answers, but with errors: 500 for ~2 s, then 429 (rate limited, with
Retry-After) for ~1 s or until a request met it, then normally again. The exporter retries and
delivers every window, in order, none dropped."""

from __future__ import annotations

import time

from faultkit import NODE, assert_every_window, create_run

import otel_forge
from testkit.proxy import MlflowProxy
from testkit.servers import wait_for

INTERVAL_S = 0.2


def test_500_then_429_are_retried_and_nothing_is_lost(pausable_server, tmp_path, exports) -> None:
    server = pausable_server
    run_id = create_run(server.uri)
    with MlflowProxy(server.uri, plain_429=True) as proxy:
        agent = otel_forge.monitor(
            in_process=True,
            run_id=run_id,
            tracking_uri=proxy.uri,
            sampling_interval=INTERVAL_S,
            samples_per_window=1,
            prometheus=False,
            node_id=NODE,
            collectors=["cpu", "memory"],
            queue_size=4,
            call_deadline_s=1,
            drain_deadline_s=10,
            spool_dir=str(tmp_path / "spool"),
        )
        exporter = agent.exporter
        stats = exporter.worker.stats
        try:
            wait_for(lambda: stats.delivered >= 3, 15, 0.05, message="the first windows to arrive through the proxy")
            proxy.set_mode("500")
            time.sleep(2.0)
            retried_on_500 = stats.retried
            proxy.set_mode("429")
            time.sleep(1.0)
            # The worker backs off (0.5 s, 1 s, 2 s, ...): 429s last until one request has met them.
            wait_for(lambda: proxy.answered["429"] >= 1, 10, 0.05, message="a request answered 429")
            proxy.set_mode("pass")
            wait_for(
                lambda: exporter.worker.pending() == 0 and stats.delivered >= exports.windows,
                30,
                0.05,
                message="the backlog to be delivered once the server answers normally",
            )
        finally:
            agent.stop()

    print(
        f"\n500/429: {exports.windows} windows, {stats.retried} retries ({retried_on_500} during 500s), "
        f"{stats.spooled} spooled, proxy answered {dict(proxy.answered)}"
    )
    assert proxy.answered["500"] > 0 and proxy.answered["429"] > 0, dict(proxy.answered)
    assert retried_on_500 > 0
    assert stats.retried > retried_on_500, "the 429s should have been retried too"
    assert stats.dropped == 0, "a 500 or a 429 is transient: it must be retried, never dropped"
    # A delivery per window, and one more when the close sends what the last window held back
    # (at that window's step: every chart ends at the last step).
    assert stats.delivered - exports.windows in (0, 1), (stats.delivered, exports.windows)
    assert_every_window(server.uri, run_id, exports.windows)
    assert not exporter.spool.path.exists()
