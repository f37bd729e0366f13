"""A hung tracking server (SIGSTOP: it accepts connections and never answers) costs the exporter call
threads and warnings, never the OTel reader thread; once it answers again every window arrives."""

from __future__ import annotations

import os
import time
import tracemalloc
from pathlib import Path

import psutil
from faultkit import NODE, assert_every_window, create_run

import otel_forge
from testkit.servers import wait_for

INTERVAL_S = 0.1
CALL_DEADLINE_S = 1.0
HANG_S = 4.0
QUEUE_SIZE = 4


def _monitor(run_id: str, uri: str, tmp_path: Path, drain_deadline_s: float = 10.0):  # type: ignore[no-untyped-def]
    return otel_forge.monitor(
        in_process=True,
        run_id=run_id,
        tracking_uri=uri,
        sampling_interval=INTERVAL_S,
        samples_per_window=1,
        prometheus=False,
        node_id=NODE,
        collectors=["cpu", "memory"],
        queue_size=QUEUE_SIZE,
        call_deadline_s=CALL_DEADLINE_S,
        drain_deadline_s=drain_deadline_s,
        spool_dir=str(tmp_path / "spool"),
    )


def test_hung_server_never_blocks_the_reader_and_loses_nothing(
    pausable_server, tmp_path, exports, socket_io, call_threads
) -> None:
    server = pausable_server
    run_id = create_run(server.uri)
    agent = _monitor(run_id, server.uri, tmp_path)
    exporter = agent.exporter
    stats = exporter.worker.stats
    try:
        wait_for(lambda: stats.delivered >= 3, 15, 0.05, message="the first windows to arrive")

        server.pause()
        hung_at = time.monotonic()
        windows_at_pause = exports.windows
        try:
            wait_for(lambda: stats.hung_calls >= 1, 30, 0.05, message="a call to pass its deadline")
            # The reader keeps sampling through the hang: more windows than the queue holds.
            wait_for(
                lambda: exports.windows - windows_at_pause > QUEUE_SIZE,
                30,
                0.05,
                message="the reader to go on sampling while the server hangs",
            )
            time.sleep(max(0.0, HANG_S - (time.monotonic() - hung_at)))
            windows_during_hang = exports.windows - windows_at_pause
            spooled_during_hang = stats.spooled
        finally:
            server.resume()
            windows_at_resume = exports.windows

        # Every window sampled up to SIGCONT is delivered while the agent runs on (the reader keeps
        # adding one per interval: the stop delivers the last ones).
        wait_for(
            lambda: stats.delivered >= windows_at_resume,
            30,
            0.05,
            message=lambda: (
                f"the backlog to be delivered after SIGCONT: {stats.delivered} of {windows_at_resume} delivered, "
                f"{exporter.worker.pending()} pending, {stats.retried} retries, {stats.hung_calls} hung calls"
            ),
        )
    finally:
        agent.stop()

    peak_threads = call_threads.stop()
    print(
        f"\nhung {HANG_S:.0f} s: {exports.windows} windows ({windows_during_hang} during the hang), "
        f"{exports.calls} exports, "
        f"{stats.hung_calls} hung calls, {stats.retried} retries, "
        f"{spooled_during_hang} spooled, peak call threads {peak_threads}"
    )

    # The reader thread never waited on the server.
    assert (socket_io.watched_calls, socket_io.operations) == (exports.calls, 0)
    assert stats.hung_calls >= 1
    assert stats.dropped == 0
    assert spooled_during_hang > 0, "the queue of 4 should have overflowed into the spool"
    # A hung call costs one thread: its retries await it rather than send the window again.
    assert peak_threads == 1
    # Every window, once, in order; each delivered exactly once as the worker counts it.
    # A delivery per window, and one more when the close sends what the last window held back
    # (at that window's step: every chart ends at the last step).
    assert stats.delivered - exports.windows in (0, 1), (stats.delivered, exports.windows)
    assert_every_window(server.uri, run_id, exports.windows)
    assert not exporter.spool.path.exists(), list(exporter.spool.path.iterdir())


def test_memory_and_threads_stay_bounded_while_the_server_hangs(
    pausable_server, tmp_path, exports, socket_io, call_threads, monkeypatch
) -> None:
    """A long hang, with MLflow's in-process HTTP timeout (30 s) so that no hung call ends by itself:
    the deadline (1 s) passes again and again and the worker keeps awaiting the one call. Memory is
    measured, not asserted (run with -s): the queue stays in memory, the rest of the windows go to
    disk; heap and RSS at 3 s and at the end."""
    hang_s = 13.0
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    server = pausable_server
    run_id = create_run(server.uri)
    process = psutil.Process(os.getpid())
    tracemalloc.start()
    agent = _monitor(run_id, server.uri, tmp_path, drain_deadline_s=1.0)
    exporter = agent.exporter
    stats = exporter.worker.stats
    try:
        wait_for(lambda: stats.delivered >= 3, 15, 0.05, message="the first windows to arrive")
        base_heap, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        base_rss = process.memory_info().rss
        server.pause()
        try:
            time.sleep(3.0)
            early_heap, _ = tracemalloc.get_traced_memory()
            early_rss, early_windows = process.memory_info().rss, exports.windows
            time.sleep(hang_s - 3.0)
            late_heap, peak_heap = tracemalloc.get_traced_memory()
            late_rss, late_windows = process.memory_info().rss, exports.windows
            spool_files = len(list(exporter.spool.path.glob("*.window.json")))
            spool_bytes = exporter.spool.size_bytes
            hung_calls = stats.hung_calls
        finally:
            server.resume()
    finally:
        tracemalloc.stop()
        agent.stop()
    peak_threads = call_threads.stop()

    kib, mib = 1024, 1 << 20
    print(
        f"\nhung {hang_s:.0f} s at {INTERVAL_S} s: windows {early_windows} at 3 s, {late_windows} at {hang_s:.0f} s; "
        f"queue {QUEUE_SIZE}, spool {spool_files} files / {spool_bytes / kib:.1f} KiB on disk\n"
        f"  python heap over baseline: {(early_heap - base_heap) / kib:.1f} KiB at 3 s, "
        f"{(late_heap - base_heap) / kib:.1f} KiB at {hang_s:.0f} s, peak {(peak_heap - base_heap) / kib:.1f} KiB\n"
        f"  RSS over baseline: {(early_rss - base_rss) / mib:.2f} MiB at 3 s, {(late_rss - base_rss) / mib:.2f} MiB "
        f"at {hang_s:.0f} s (baseline {base_rss / mib:.1f} MiB)\n"
        f"  hung calls {hung_calls}, peak call threads {peak_threads}"
    )
    assert late_windows > early_windows  # the reader sampled on through the hang
    assert (socket_io.watched_calls, socket_io.operations) == (exports.calls, 0)  # export() only queued
    assert hung_calls >= 4
    # However long the hang, one call thread: the deadline passes, the same call is awaited.
    assert peak_threads == 1
