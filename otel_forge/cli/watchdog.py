"""``python -m otel_forge.cli.watchdog FD RUN_ID EXPERIMENT_ID NODE_JSON``: started by
``otel-forge run`` (cli/children.py ``Watchdog``); ends the run KILLED if ``otel-forge run`` dies
before ending it. Imports only the standard library until it has to act."""

from __future__ import annotations

import json
import os
import sys


def main(argv: list[str]) -> int:
    fd, run_id, experiment_id, node_json = argv
    with os.fdopen(int(fd), "rb") as pipe:
        said = pipe.read()
    if said.startswith(b"ended"):
        return 0
    from otel_forge.mlflow.client import make_client
    from otel_forge.mlflow.outcome import end_run
    from otel_forge.node import NodeIdentity

    node = NodeIdentity(**json.loads(node_json))
    try:
        end_run(make_client(os.environ["MLFLOW_TRACKING_URI"]), run_id, experiment_id or None, "KILLED", node,
                detail="otel-forge run died")
    except Exception as error:  # noqa: BLE001 - nobody is left to tell but stderr
        print(f"otel-forge watchdog: could not end run {run_id} KILLED: {str(error).splitlines()[0]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
