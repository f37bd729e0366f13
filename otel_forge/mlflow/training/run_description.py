"""What describes a new run, as records the delivery worker sends: its tags (job, git, the
caller's), the launch file, the config as an artifact and as params. Secrets are masked here."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from otel_forge.mlflow.client import import_mlflow
from otel_forge.mlflow.keys import sanitize_key
from otel_forge.mlflow.training.rendezvous import JOB_KEY_TAG
from otel_forge.mlflow.training.run_journal import Record
from otel_forge.mlflow.training.run_metadata import (
    DESCRIBED_TAG,
    NOTE_TAG,
    batches,
    config_as_dict,
    flatten_params,
    git_tags,
    job_tags,
    launch_config_path,
    launch_file_text,
    redact,
)
from otel_forge.node import NodeIdentity, job_label
from otel_forge.ratelimit import RateLimitedLogger
from otel_forge.scrub import REDACTED, SecretKeys, scrub

CONFIG_ARTIFACT = "config.json"
MAX_PARAM_KEY_CHARS = 250  # MLflow's limit


class _DescribeFields(TypedDict):
    creation_tags: dict[str, str]
    records: list[tuple[str, object]]  # (kind, payload) of each Record, in order


class DescribeEntry(_DescribeFields, total=False):
    """The journal's ``describe`` entry: a new run's tags, and the records that describe it.
    ``context_argv``: MLflow's context tags are not in ``creation_tags`` yet; the process that opens
    the run resolves them, as for a process whose ``sys.argv`` this is."""

    context_argv: list[str]


@dataclass(frozen=True)
class RunDescription:
    """The caller's config (anything ``config_as_dict`` reads), description and tags, and the command
    that launched the job."""

    config: object
    description: str | None
    tags: Mapping[str, str]
    launch_argv: Sequence[str]
    secret: SecretKeys
    warnings: RateLimitedLogger

    def records(self, node: NodeIdentity) -> list[Record]:
        """Everything that describes the run (linear in the config's size): tags and the files
        first, since a large config's params take many calls (100 per call)."""
        records = [Record("tags", self._run_tags(node))]
        launch_file = launch_config_path(self.launch_argv)
        if launch_file is not None and (text := launch_file_text(launch_file)) is not None:
            records.append(Record("text", {"name": launch_file.name, "data": self.secret.redact_text(text)}))
        if self.config is not None:
            plain = redact(config_as_dict(self.config), self.secret)
            records.append(Record("dict", {"name": CONFIG_ARTIFACT, "data": plain}))
            records.extend(Record("params", params) for params in batches(self._param_keys(flatten_params(plain))))
        return records

    def journal_entry(self, node: NodeIdentity, resolve_context: bool = True) -> DescribeEntry:
        """What a new run records, as the journal keeps it for whichever process opens the run;
        ``resolve_context`` False: MLflow's context tags are left to it (no MLflow import here)."""
        records: list[tuple[str, object]] = [(record.kind, record.payload) for record in self.records(node)]
        if resolve_context:
            return {"creation_tags": self.creation_tags(node.job_key), "records": records}
        return {"creation_tags": self._keyed_tags(node.job_key), "records": records, "context_argv": list(sys.argv)}

    def new_run(self, job_key: str | None) -> tuple[str | None, dict[str, str]]:
        """A new run's name (where none is asked for) and tags."""
        return self.default_run_name(), self.creation_tags(job_key)

    def default_run_name(self) -> str | None:
        """What ran, and which job: ``train`` for ``python train.py``, ``train-slurm-1234_5`` for an
        array task of a SLURM job (None, MLflow's random name, when neither is known)."""
        names = [name for name in (script_stem(self.launch_argv), job_label()) if name]
        return "-".join(names) or None

    def creation_tags(self, job_key: str | None) -> dict[str, str]:
        """A new run's tags: MLflow's context tags, as ``mlflow.start_run`` resolves them, under ours
        (the job key, the caller's). Ours are set again by the tags record, which adds git state."""
        import_mlflow()  # under its lock, with our client defaults: run_context is MLflow's plugin module
        from otel_forge.mlflow.training.run_context import context_tags

        return {key: scrub(str(value)) for key, value in context_tags(self._keyed_tags(job_key)).items()}

    def _keyed_tags(self, job_key: str | None) -> dict[str, str]:
        tags = self.own_tags()
        if job_key:
            tags[JOB_KEY_TAG] = job_key
        return tags

    def _run_tags(self, node: NodeIdentity) -> dict[str, str]:
        tags = {
            **job_tags(node.world_size, node.node_count, node_id=node.node_id, kubernetes=node.kubernetes),
            **git_tags(),
            DESCRIBED_TAG: "true",
            **self.own_tags(),
        }
        return {key: scrub(str(value)) for key, value in tags.items()}

    def own_tags(self) -> dict[str, str]:
        """The description and the caller's tags (secrets masked): they win over every other source."""
        tags = {NOTE_TAG: self.description} if self.description else {}
        tags.update({key: REDACTED if self.secret(key) else value for key, value in self.tags.items()})
        return tags

    def _param_keys(self, params: Mapping[str, str]) -> dict[str, str]:
        """Params under keys MLflow accepts: sanitised, at most 250 characters, each once."""
        kept: dict[str, str] = {}
        for key, value in params.items():
            name = sanitize_key(key)
            if len(name) > MAX_PARAM_KEY_CHARS or name in kept:
                reason = "too long" if len(name) > MAX_PARAM_KEY_CHARS else f"the same as {name!r}"
                self.warnings.warning("param-key", "MLflow: param %r not recorded: its key is %s", key[:80], reason)
                continue
            kept[name] = value
        return kept


def source_name(command: Sequence[str]) -> str | None:
    """What a command runs, as typed: its first Python file (``python train.py``, ``torchrun ...
    train.py``), else its program (``./train.sh``); None for ``python -c`` and the like."""
    for word in command:
        if word.endswith(".py") and os.path.isfile(word):
            return word
    return command[0] if command and not command[0].startswith("-") else None


def script_stem(argv: Sequence[str]) -> str | None:
    """``train`` for ``train.py ...`` or ``otel-forge python train.py ...``."""
    command = argv[1:] if argv[:1] == ["otel-forge"] else argv
    source = source_name(command)
    return Path(source).stem if source else None
