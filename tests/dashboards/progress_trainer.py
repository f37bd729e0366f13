"""A training without torch, for ``otel-forge run``: four ranks that step on the progress board.

As CMD (``python progress_trainer.py [--steps N]``): ``otel-forge run`` hands its command the node's
progress board (``OTEL_FORGE_PROGRESS_BOARD``); each rank here is a thread with a board file of its own
(``RankBoard``), as a rank process would have. A step takes about 40 ms, most of it in a "collective"
(``enter_sync`` / ``leave_sync``); rank ``SLOW_RANK`` does three times the others' own work, so the node
names it the slow rank once it has been the slowest for ``OTEL_FORGE_SLOW_RANK_AFTER``. With
``--steps N`` every rank stops after N steps, as if hung in a collective: the node's training
stalls. Runs until stopped.

For tests: ``start_training_node`` starts ``otel-forge run [ARGS] -- python progress_trainer.py``
(the dashboards' and the alert rules' live tests).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otel_forge.config import PROGRESS_BOARD_ENV
from otel_forge.progress.board import RankBoard, RankIdentity, rank_file, start_ticks

WORLD_SIZE = 4
SLOW_RANK = 3
STEP_S = 0.04
OWN_WORK_S = 0.01  # the slow rank's: 3 x this


def train(board: Path, rank: int, steps: int | None) -> None:
    pid = os.getpid()
    ranks = RankBoard(rank_file(board, rank, pid), RankIdentity(pid, rank, rank, WORLD_SIZE, 0, start_ticks()))
    own = OWN_WORK_S * (3 if rank == SLOW_RANK else 1)
    step = 0
    while steps is None or step < steps:
        time.sleep(own)  # forward and backward
        ranks.enter_sync()  # the all-reduce: the fast ranks wait here for the slow one
        time.sleep(STEP_S - own)
        ranks.leave_sync()
        ranks.step()
        step += 1
    ranks.enter_sync()  # hung in the next all-reduce


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="every rank stops after this many steps (a stall)")
    parser.add_argument("--otlp", action="store_true", help="and send a gauge over OTLP to otel-forge's receiver")
    args = parser.parse_args(argv)
    if args.otlp:
        send_over_otlp()
    board = Path(os.environ[PROGRESS_BOARD_ENV])
    board.mkdir(parents=True, exist_ok=True)
    for rank in range(WORLD_SIZE):
        threading.Thread(target=train, args=(board, rank, args.steps), name=f"rank-{rank}", daemon=True).start()
    print(f"training on the board {board}", flush=True)
    while True:
        time.sleep(3600)


LOADER_RATE = 128.0  # what the "data loader" reports over OTLP, samples per second


def send_over_otlp() -> None:
    """A data loader's gauge, exported each second by the OpenTelemetry SDK's OTLP/HTTP exporter to the
    receiver of the ``otel-forge run`` around us (its port in ``OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT``)."""
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    port = os.environ["OTEL_FORGE_OTLP_RECEIVER_HTTP_PORT"]
    exporter = OTLPMetricExporter(endpoint=f"http://127.0.0.1:{port}/v1/metrics")
    provider = MeterProvider(metric_readers=[PeriodicExportingMetricReader(exporter, export_interval_millis=1000)])
    provider.get_meter("loader").create_observable_gauge(
        "loader.samples_per_second", callbacks=[lambda _options: [Observation(LOADER_RATE)]]
    )


def start_training_node(
    forge_args: Sequence[str],
    env: Mapping[str, str],
    cwd: Path,
    trainer_args: Sequence[str] = (),
    timeout_s: float = 60.0,
) -> Any:
    """``otel-forge run FORGE_ARGS -- python progress_trainer.py TRAINER_ARGS``, once it serves Prometheus
    (``forge_args`` must ask for an endpoint): an ``AgentProcess``. otel-forge run says what it serves on
    its stderr (its stdout is CMD's): both go to one pipe."""
    import io
    import subprocess
    import sys

    from testkit.servers import AgentProcess, _LineReader, agent_environment

    command = [sys.executable, "-m", "otel_forge.cli", "run", *forge_args, "--", sys.executable, __file__]
    process = subprocess.Popen(
        [*command, *trainer_args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=agent_environment(env),
        start_new_session=True,
        cwd=cwd,
    )
    node = AgentProcess(process, _LineReader(process.stdout), _LineReader(io.StringIO()))
    try:
        node.wait_serving(timeout_s)
    except BaseException:
        node.kill()
        raise
    return node


if __name__ == "__main__":
    main()
