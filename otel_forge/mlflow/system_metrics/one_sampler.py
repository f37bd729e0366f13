"""One sampler per node: where otel_forge samples a run's node, MLflow's own system-metrics monitor
(``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``, ``start_run(log_system_metrics=True)``) stands down, and
says so once. Left on, it samples the node a second time, into the same ``system/`` keys."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Mapping

from otel_forge.config import MLFLOW_SYSTEM_METRICS_VAR

_logger = logging.getLogger(__name__)


def mlflow_sampling_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(MLFLOW_SYSTEM_METRICS_VAR, "").strip().lower() in (
        "true",
        "1",
    )


WATCH_INTERVAL_S = 1.0  # a look at one dict in memory

_lock = threading.Lock()
_sampled_runs: set[str] = set()
_watch: threading.Thread | None = None


def stand_down_mlflow_sampler(run_id: str) -> None:
    """Turn MLflow's sampler off for this process, and stop the one it runs for ``run_id``, now and
    whenever one starts for it later (``start_run(log_system_metrics=True)`` overrides the setting)."""
    if mlflow_sampling_enabled():
        # What mlflow.disable_system_metrics_logging() sets, without importing mlflow for it.
        os.environ[MLFLOW_SYSTEM_METRICS_VAR] = "false"
        _logger.warning(
            "MLflow's own system-metrics logging (%s) is off in this process: otel_forge samples this node into run %s",
            MLFLOW_SYSTEM_METRICS_VAR,
            run_id,
        )
    global _watch
    with _lock:
        _sampled_runs.add(run_id)
        if _watch is None or _watch.ident is None or not _watch.is_alive():  # none yet, or forked
            _watch = threading.Thread(target=_watch_mlflow_samplers, name="otel-forge-mlflow-sampler", daemon=True)
            _watch.start()
    _stop_mlflow_sampler(run_id)


def _watch_mlflow_samplers() -> None:
    while True:
        time.sleep(WATCH_INTERVAL_S)
        with _lock:
            runs = list(_sampled_runs)
        for run_id in runs:
            _stop_mlflow_sampler(run_id)


def _stop_mlflow_sampler(run_id: str) -> None:
    # MLflow keeps the monitor it started for a run in this module-level dict, and ends it from there.
    fluent = sys.modules.get("mlflow.tracking.fluent")
    monitors = getattr(fluent, "run_id_to_system_metrics_monitor", None)
    running = monitors.pop(run_id, None) if monitors is not None else None
    if running is None:
        return
    _logger.warning(
        "MLflow's own system-metrics monitor of run %s (log_system_metrics=True) stops: otel_forge samples "
        "this node into it",
        run_id,
    )
    # Its thread sleeps out a sampling interval before it stops: not on the caller's time.
    threading.Thread(target=running.finish, name="mlflow-monitor-stop", daemon=True).start()
