"""Checkpoints as MLflow 3 external logged models: found or created, so a repeat never duplicates;
each linked as an output of its run (at its step), as ``mlflow.<flavor>.log_model`` links the models
it logs: the run page lists them under "Logged models"."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from otel_forge.mlflow.client import import_mlflow

if TYPE_CHECKING:
    from mlflow.entities import LoggedModel

    from otel_forge.mlflow.client import TrackingClient
    from otel_forge.mlflow.training.run_owner import OpenRun


def find_or_create_external_model(run: OpenRun, name: str, step: int, directory: Path) -> str:
    """The logged model of this run named ``name``, created as an external model if absent."""
    import_mlflow()
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models.model import MLMODEL_FILE_NAME
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    client = run.client
    # A run found by a process that never read it knows no experiment id: the run says it.
    experiment_id = run.experiment_id or client.get_run(run.run_id).info.experiment_id
    found = client.search_logged_models(experiment_ids=[experiment_id], filter_string=f"name = '{name}'")
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
        experiment_id, name=name, source_run_id=run.run_id, tags=tags, model_type="checkpoint"
    )
    client.log_outputs(run.run_id, [LoggedModelOutput(model.model_id, step)])
    # External: the weights stay where they are; MLflow gets the MLmodel stub a registry needs.
    with tempfile.TemporaryDirectory() as stub:
        Path(stub, MLMODEL_FILE_NAME).write_text(external_model_spec(model), encoding="utf-8")
        client.log_model_artifacts(model.model_id, stub)
    client.finalize_logged_model(model.model_id, LoggedModelStatus.READY)
    return model.model_id


# ``infer_signature(model_input=True, model_output=True).to_dict()``, the dummy signature MLflow's
# ``get_external_mlflow_model_spec`` gives an external model so that a registry that requires one
# (Databricks Unity Catalog) registers it; written out here, as mlflow.models.signature imports
# numpy and pandas, which mlflow-skinny does not install.
_DUMMY_SIGNATURE = {
    "inputs": '[{"type": "boolean", "required": true}]',
    "outputs": '[{"type": "boolean", "required": true}]',
    "params": None,
}


def external_model_spec(model: LoggedModel) -> str:
    """The MLmodel YAML ``mlflow.models.utils.get_external_mlflow_model_spec(model)`` saves, made
    without its ModelSignature (and so without numpy or pandas)."""
    import yaml
    from mlflow.models.model import Model
    from mlflow.utils.mlflow_tags import MLFLOW_MODEL_IS_EXTERNAL

    spec = Model(
        artifact_path=model.artifact_location,
        model_uuid=model.model_id,
        model_id=model.model_id,
        run_id=model.source_run_id,
        # Metadata telling the registry and other readers that the artifacts are stored externally.
        metadata={MLFLOW_MODEL_IS_EXTERNAL: True},
    ).to_dict()
    spec.update(signature=dict(_DUMMY_SIGNATURE), is_signature_from_type_hint=False, type_hint_from_example=False)
    return str(yaml.safe_dump(spec, default_flow_style=False))


def _link_as_output(client: TrackingClient, run_id: str, model_id: str, step: int) -> None:
    """Link a model found again (a resumed run) unless it is already: a process that died between
    creating and linking it left it unlinked. The store keeps every link it is given, duplicates too."""
    from mlflow.entities import LoggedModelOutput

    outputs = client.get_run(run_id).outputs
    if all(output.model_id != model_id for output in (outputs.model_outputs if outputs else [])):
        client.log_outputs(run_id, [LoggedModelOutput(model_id, step)])
