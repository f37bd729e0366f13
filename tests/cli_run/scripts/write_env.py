"""CMD that records what ``otel-forge run`` exported to it, as a script that uses MLflow sees it (after
``import mlflow``: a run still opening as CMD started is told by then), then exits with the code it is
given.

python write_env.py OUT.json [EXIT_CODE]
"""

from __future__ import annotations

import json
import os
import sys

import mlflow  # noqa: F401 - what a script that logs sees from here

NAMES = (
    "MLFLOW_RUN_ID",
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_ID",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "OTEL_FORGE_LAUNCHED_RUN_ID",
)

with open(sys.argv[1], "w") as out:
    json.dump({name: os.environ.get(name) for name in NAMES}, out)
print("cmd ran", flush=True)
sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
