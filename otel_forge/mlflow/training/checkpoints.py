"""Checkpoints as MLflow 3 external logged models: found or created, so a repeat never duplicates;
each linked as an output of its run (at its step), as ``mlflow.<flavor>.log_model`` links the models
it logs: the run page lists them under "Logged models"."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otel_forge.mlflow.client import import_mlflow

if TYPE_CHECKING:
    from otel_forge.mlflow.training.run_owner import OpenRun


def find_or_create_external_model(run: OpenRun, name: str, step: int, directory: Path) -> str:
    """The logged model of this run named ``name``, created as an external model if absent."""
    import_mlflow()
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.models.utils import get_external_mlflow_model_spec
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    client = run.client
    found = client.search_logged_models(experiment_ids=[run.experiment_id], filter_string=f"name = '{name}'")
    for model in found:
        if model.source_run_id == run.run_id:
            _link_as_output(client, run.run_id, model.model_id, step)
            return model.model_id
    tags = {
        MLFLOW_MODEL_IS_EXTERNAL: "true",
        "otel_forge.checkpoint.path": str(directory),
        "otel_forge.checkpoint.step": str(step),
    }
    model = client.create_logged_model(
        run.experiment_id, name=name, source_run_id=run.run_id, tags=tags, model_type="checkpoint"
    )
    client.log_outputs(run.run_id, [LoggedModelOutput(model.model_id, step)])
    # External: the weights stay where they are; MLflow gets the MLmodel stub a registry needs.
    with tempfile.TemporaryDirectory() as stub:
        get_external_mlflow_model_spec(model).save(os.path.join(stub, MLMODEL_FILE_NAME))
        client.log_model_artifacts(model.model_id, stub)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return model.model_id


def _link_as_output(client: Any, run_id: str, model_id: str, step: int) -> None:
    """Link a model found again (a resumed run) unless it is already: a process that died between
    creating and linking it left it unlinked. The store keeps every link it is given, duplicates too."""
    from mlflow.entities import LoggedModelOutput

    outputs = client.get_run(run_id).outputs
    if all(output.model_id != model_id for output in (outputs.model_outputs if outputs else [])):
        client.log_outputs(run_id, [LoggedModelOutput(model_id, step)])
