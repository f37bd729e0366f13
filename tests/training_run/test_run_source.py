"""``RunSource``: where the job's run comes from, decided once from what names it, and the same value
in CMD's environment, the journal's plan and the delivery that reads it back."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from otel_forge.config import ForgeConfig
from otel_forge.mlflow.training.launched_run import LaunchedRun
from otel_forge.mlflow.training.run_plan import RunPlan
from otel_forge.mlflow.training.run_source import SOURCE_ROLES, RunOrigin, RunSource, source_table
from otel_forge.node import NodeIdentity

SINGLE = NodeIdentity(0, 0, 1, None, None, 1, "host")
KEYED = dataclasses.replace(SINGLE, job_key="slurm-7.0", node_count=2)


@pytest.mark.parametrize(
    ("requested", "handed", "named", "node", "expected"),
    [
        ("r1", None, True, SINGLE, RunSource.given("r1")),
        # The launcher's run, handed by id: it is the launched one, with its "add your description".
        (None, RunSource(RunOrigin.LAUNCHER, "r2", adds_description=True), False, SINGLE,
         RunSource(RunOrigin.LAUNCHER, "r2", adds_description=True)),
        # MLFLOW_RUN_ID that `otel-forge run` set to its own run is still the launcher's.
        ("r2", RunSource(RunOrigin.LAUNCHER, "r2"), False, SINGLE, RunSource(RunOrigin.LAUNCHER, "r2")),
        # Another id asked for in code wins over the handed run.
        ("r9", RunSource(RunOrigin.LAUNCHER, "r2"), False, SINGLE, RunSource.given("r9")),
        (None, RunSource(RunOrigin.LAUNCHER), False, KEYED, RunSource(RunOrigin.LAUNCHER)),  # still opening
        (None, RunSource(RunOrigin.SCRIPT), False, SINGLE, RunSource(RunOrigin.SCRIPT)),
        (None, RunSource(RunOrigin.SCRIPT), True, SINGLE, RunSource(RunOrigin.SCRIPT, experiment_named=True)),
        (None, None, False, SINGLE, RunSource(RunOrigin.SCRIPT)),  # nothing names the experiment but the script
        (None, None, True, SINGLE, RunSource(RunOrigin.NEW)),  # this process names it: its run, made at once
        (None, None, True, KEYED, RunSource(RunOrigin.JOB_KEY)),  # several nodes: the key's run, not a script's
        (None, None, True, dataclasses.replace(SINGLE, node_count=2), RunSource(RunOrigin.NEW)),
    ],
)  # fmt: skip
def test_the_source_is_decided_once_from_what_names_the_run(requested, handed, named, node, expected) -> None:
    assert RunSource.resolve(requested, handed, named=named, node=node, create_if_missing=False) == expected


def test_what_otel_forge_run_hands_cmd_is_the_source_cmd_resolves(monkeypatch) -> None:
    for handed in (
        LaunchedRun(RunSource(RunOrigin.LAUNCHER, "r1", adds_description=True), tracking_uri="sqlite:///x.db"),
        LaunchedRun(RunSource(RunOrigin.LAUNCHER), tracking_uri="sqlite:///x.db", job_key="k"),
        LaunchedRun(RunSource(RunOrigin.SCRIPT), tracking_uri="sqlite:///x.db", job_key="k"),
    ):
        environ = handed.environ()
        for name in list(os.environ):
            if name.startswith(("OTEL_FORGE_", "MLFLOW_")):
                monkeypatch.delenv(name)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        plan = RunPlan.resolve(
            ForgeConfig.resolve(environ=environ), tracking_uri=None, experiment=None, run_name=None, run_id=None,
            node=SINGLE, system_metrics=False, register_checkpoints=False, create_if_missing=False,
            deadlines=(1.0, 1.0),
        )  # fmt: skip
        assert plan.source == handed.source
        # ... and the journal's plan gives the delivery and the replay the same value back.
        assert RunSource.from_plan(plan.journal_entry(None, {})) == handed.source


def test_a_journal_written_before_the_source_existed_reads_as_its_flags_said() -> None:
    assert RunSource.from_plan({"run_id": "r", "launched": True}) == RunSource(RunOrigin.LAUNCHER, "r")
    assert RunSource.from_plan({"run_id": None, "launcher_opens": True}) == RunSource(RunOrigin.LAUNCHER)
    assert RunSource.from_plan({"run_id": "r", "create_if_missing": True}) == RunSource.given("r", True)
    assert RunSource.from_plan({"run_id": None}).origin is RunOrigin.JOB_KEY


def test_every_source_says_who_opens_describes_delivers_and_ends_its_run() -> None:
    assert set(SOURCE_ROLES) == set(RunOrigin)
    # Only the launcher's runs are ended by their launcher, not by the journal's delivery.
    assert [origin for origin in RunOrigin if not RunSource(origin).ends_run] == [RunOrigin.LAUNCHER]


def test_the_architecture_doc_shows_the_roles_table_from_the_code() -> None:
    doc = (Path(__file__).parents[2] / "docs" / "architecture.md").read_text()
    assert source_table() in doc
