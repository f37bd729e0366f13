"""``python -m otel_forge.cli.watchdog FD RUN_ID EXPERIMENT_ID NODE_JSON``: started by
``otel-forge run`` (cli/children.py ``Watchdog``); ends the run KILLED if ``otel-forge run`` dies
before ending it, or with the status it hands over when the server did not answer in time, retrying
until the server answers (for at most ``GIVE_UP_S``). Imports only the standard library until it
has to act."""

from __future__ import annotations

import json
import os
import sys
import time

GIVE_UP_S = 3600.0


def main(argv: list[str]) -> int:
    fd, run_id, experiment_id, node_json = argv
    with os.fdopen(int(fd), "rb") as pipe:
        said = pipe.read().decode(errors="replace").split()
    if said[:1] == ["ended"]:
        return 0
    status, detail = (said[1], None) if said[:1] == ["end"] else ("KILLED", "otel-forge run died")
    worker = " ".join(said[2:]) if said[:1] == ["end"] and len(said) > 2 else None  # CMD was a launcher
    from otel_forge.config import env_name
    from otel_forge.mlflow.client import make_client
    from otel_forge.mlflow.training.outcome import end_run
    from otel_forge.node import NodeIdentity
    from otel_forge.scrub import error_line

    node = NodeIdentity(**json.loads(node_json))
    give_up_at, pause_s = time.monotonic() + GIVE_UP_S, 1.0
    while True:
        try:
            end_run(
                make_client(os.environ[env_name("tracking_uri")]),
                run_id,
                experiment_id or None,
                status,
                node,
                detail=detail,
                worker=worker,
            )
            return 0
        except Exception as error:  # noqa: BLE001 - nobody is left to tell but stderr
            if time.monotonic() + pause_s > give_up_at:
                print(f"otel-forge watchdog: could not end run {run_id} {status}: {error_line(error)}", file=sys.stderr)
                return 1
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 30.0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
