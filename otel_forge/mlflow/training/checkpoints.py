"""Checkpoints as MLflow 3 external logged models: found or created, so a repeat never duplicates."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from otel_forge.mlflow.client import import_mlflow

if TYPE_CHECKING:
    from otel_forge.mlflow.training.run_owner import OpenRun


def find_or_create_external_model(run: OpenRun, name: str, step: int, directory: Path) -> str:
    """The logged model of this run named ``name``, created as an external model if absent."""
    import_mlflow()
    from mlflow.entities import LoggedModelStatus
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.models.utils import get_external_mlflow_model_spec
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    client = run.client
    found = client.search_logged_models(experiment_ids=[run.experiment_id], filter_string=f"name = '{name}'")
    for model in found:
        if model.source_run_id == run.run_id:
            return model.model_id
    tags = {
        MLFLOW_MODEL_IS_EXTERNAL: "true",
        "otel_forge.checkpoint.path": str(directory),
        "otel_forge.checkpoint.step": str(step),
    }
    model = client.create_logged_model(
        run.experiment_id, name=name, source_run_id=run.run_id, tags=tags, model_type="checkpoint"
    )
    # External: the weights stay where they are; MLflow gets the MLmodel stub a registry needs.
    with tempfile.TemporaryDirectory() as stub:
        get_external_mlflow_model_spec(model).save(os.path.join(stub, MLMODEL_FILE_NAME))
        client.log_model_artifacts(model.model_id, stub)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return model.model_id
