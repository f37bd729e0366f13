"""Deliver a spool left behind by a close while the server was down: an exporter's system-metrics
windows, or a TrainingRun's metrics and the run's end."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from otel_forge.mlflow.client import RunGone, RunInfo, import_mlflow, make_client
from otel_forge.mlflow.spool_files import HEADER
from otel_forge.mlflow.system_metrics.window_logger import WindowLogger
from otel_forge.mlflow.system_metrics.window_spool import WindowSpool
from otel_forge.mlflow.training.outcome import end_run
from otel_forge.mlflow.training.rendezvous import (
    JOB_KEY_TAG,
    create_experiment,
    find_experiment,
    publish,
    published_run_id,
)
from otel_forge.mlflow.training.training_spool import TrainingSpool, is_training_spool
from otel_forge.node import NodeIdentity

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayResult:
    delivered: int
    remaining: int
    run_id: str
    set_aside: int = 0  # files that were not windows, kept beside the spool as *.corrupt
    ended: str | None = None  # the status the run was ended with (a training spool)
    unit: str = "window(s)"  # what ``delivered`` counts


def replay(path: Path, tracking_uri: str | None = None) -> ReplayResult:
    """Deliver whichever spool ``path`` is."""
    return (replay_training if is_training_spool(path) else replay_spool)(path, tracking_uri)


def spools_in(path: Path) -> list[Path]:
    """``path`` if it is a spool, else the spools in it (a job's directory, ``otel-forge run``'s), the
    training spools first: they open the job's run, which the windows then find."""
    if (path / HEADER).exists():
        return [path]
    found = sorted(header.parent for header in path.glob(f"*/{HEADER}"))
    return sorted(found, key=lambda spool: not is_training_spool(spool))


def replay_training(path: Path, tracking_uri: str | None = None) -> ReplayResult:
    """Send a TrainingRun's kept records and metric rows in order, then end the run as it ended
    (unless it was)."""
    spool = TrainingSpool(path)
    header = spool.header
    client = make_client(tracking_uri or header.get("tracking_uri"))
    if header.get("run_id") is None:
        header = _open_run(client, spool, header)
    for record in spool.records():
        record.deliver(client, header["run_id"])
    spool.records_delivered()
    metric = import_mlflow().entities.Metric
    delivered = 0
    for file, rows in spool.batches():
        client.log_batch(header["run_id"], metrics=[metric(*row) for row in rows], synchronous=True)
        file.unlink()
        delivered += len(rows)
    ended = None
    if not header.get("ended"):
        end_run(client, header["run_id"], header.get("experiment_id"), header["status"], NodeIdentity(**header["node"]))
        ended = header["status"]
    set_aside = len(list(path.glob("*.corrupt")))
    if not set_aside:
        spool.remove()
    return ReplayResult(delivered, 0, header["run_id"], set_aside, ended, "metric value(s)")


def _open_run(client: Any, spool: TrainingSpool, header: dict[str, Any]) -> dict[str, Any]:
    """The run a TrainingRun would have opened, had the server answered while the job ran: the
    one asked for, else the job key's, else a new one (recorded at once: a retry continues it)."""
    spec = header["open"]
    if (run_id := spec.get("run_id")) is not None:
        experiment_id = client.get_run(run_id).info.experiment_id
    else:
        experiment = find_experiment(client, spec["experiment"])
        experiment_id = (
            experiment.experiment_id if experiment is not None else create_experiment(client, spec["experiment"])
        )
        key = spec.get("job_key")
        run_id = published_run_id(experiment, key) if key else None
        if run_id is None:
            # The tags the job resolved for its run (MLflow's context ones, ours over them); a spool
            # written before they were recorded has the job key alone.
            tags = spec.get("tags") or ({JOB_KEY_TAG: key} if key else None)
            run_id = client.create_run(experiment_id, run_name=spec.get("run_name"), tags=tags).info.run_id
            if key:
                publish(client, experiment_id, key, run_id)
    header = {**header, "run_id": run_id, "experiment_id": experiment_id}
    spool.write_header(header)
    return header


def replay_spool(path: Path, tracking_uri: str | None = None) -> ReplayResult:
    """Send the spool's windows in order to its run; delivered windows leave the spool.

    Stops at the first delivery failure (the rest stays for another try); a file that is not a
    window is set aside and skipped. Removes the spool once nothing is left in it.
    ``tracking_uri`` overrides the one recorded (which has no credentials).
    """
    spool = WindowSpool.open(path)
    header = spool.header
    uri = tracking_uri or header.get("tracking_uri")
    run_id = header["run_id"] or _job_run_id(make_client(uri), header)
    spool.update_header(run_id=run_id)
    # Where the exporter never reached the server, the logger finds where the node's steps continue
    # (and opens the node's own run), as the exporter would have.
    log_window = WindowLogger(
        run_id,
        uri,
        header["prefix"],
        header.get("first_step"),
        node_run=header.get("node_run"),
        node_run_id=header.get("node_run_id"),
    )
    log_window.attach(run_id, RunInfo(None, "", header.get("experiment")))
    log_window.on_first_step.append(
        lambda step: spool.update_header(first_step=step, node_run_id=log_window.node_run_id)
    )
    delivered = 0
    while (window := spool.peek()) is not None:
        log_window(window)
        spool.pop()
        delivered += 1
    if not spool.set_aside:
        spool.remove_if_empty()
    return ReplayResult(delivered, len(spool), run_id, spool.set_aside)


def _job_run_id(client: Any, header: dict[str, Any]) -> str:
    """The run of windows sampled before their job's run opened: the one the job key names."""
    job_run = header.get("job_run") or {}
    experiment, key = job_run.get("experiment"), job_run.get("job_key")
    if not (experiment and key):
        raise LookupError("the spool names no run (its run never opened)")
    run_id = published_run_id(find_experiment(client, experiment), key)
    if run_id is None:
        raise LookupError(f"job {key} has no run in experiment {experiment} yet: replay the job's run spool first")
    return str(run_id)


__all__ = ["ReplayResult", "RunGone", "replay", "replay_spool", "replay_training", "spools_in"]
