"""One sampler per node: where otel_forge samples a run's node, MLflow's own system-metrics monitor
(``MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING``, ``start_run(log_system_metrics=True)``) stands down, and
says so once. Left on, it samples the node a second time, into the same ``system/`` keys."""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Mapping

from otel_forge.config import MLFLOW_SYSTEM_METRICS_VAR

_logger = logging.getLogger(__name__)


def mlflow_sampling_enabled(environ: Mapping[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(MLFLOW_SYSTEM_METRICS_VAR, "").strip().lower() in (
        "true",
        "1",
    )


def stand_down_mlflow_sampler(run_id: str) -> None:
    """Turn MLflow's sampler off for this process, and stop the one it runs for ``run_id`` already."""
    if mlflow_sampling_enabled():
        # What mlflow.disable_system_metrics_logging() sets, without importing mlflow for it.
        os.environ[MLFLOW_SYSTEM_METRICS_VAR] = "false"
        _logger.warning(
            "MLflow's own system-metrics logging (%s) is off in this process: otel_forge samples this node into run %s",
            MLFLOW_SYSTEM_METRICS_VAR,
            run_id,
        )
    fluent = sys.modules.get("mlflow.tracking.fluent")
    running = fluent.run_id_to_system_metrics_monitor.pop(run_id, None) if fluent is not None else None
    if running is not None:
        _logger.warning(
            "MLflow's own system-metrics monitor of run %s (log_system_metrics=True) stops: otel_forge samples "
            "this node into it",
            run_id,
        )
        # Its thread sleeps out a sampling interval before it stops: not on the caller's time.
        threading.Thread(target=running.finish, name="mlflow-monitor-stop", daemon=True).start()
