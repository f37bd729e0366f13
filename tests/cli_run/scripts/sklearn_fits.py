"""CMD that fits three scikit-learn models, each in a run of its own, the two ways MLflow users do.

    python sklearn_fits.py autolog      mlflow.sklearn.autolog(): MLflow starts and ends a run per fit
    python sklearn_fits.py start_run    `with mlflow.start_run():` per fit, its alpha logged by hand;
                                        inside the first, a `start_run(nested=True)` run
    python sklearn_fits.py trainingrun  autolog's fits inside `with otel_forge.TrainingRun()`

Under ``otel-forge run`` (or in a ``TrainingRun``) the first fit's run is the job's run, the others
its children.
"""

from __future__ import annotations

import sys

import mlflow
import numpy as np
from sklearn.linear_model import Ridge

ALPHAS = (0.1, 1.0, 10.0)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(64, 3))
    return features, features @ np.array([1.0, -2.0, 0.5]) + rng.normal(scale=0.1, size=64)


def autolog() -> None:
    # No model or dataset artifacts: the runs, their parents and params are what is checked.
    mlflow.sklearn.autolog(log_models=False, log_datasets=False, silent=True)
    features, target = data()
    for alpha in ALPHAS:
        Ridge(alpha=alpha).fit(features, target)


def start_run_per_fit() -> None:
    features, target = data()
    for index, alpha in enumerate(ALPHAS):
        with mlflow.start_run():
            model = Ridge(alpha=alpha).fit(features, target)
            mlflow.log_param("alpha", alpha)
            mlflow.log_metric("score", model.score(features, target))
            if index == 0:
                with mlflow.start_run(nested=True, run_name="nested-in-first-fit"):
                    mlflow.log_param("inner", "yes")


def autolog_in_trainingrun() -> None:
    import otel_forge

    with otel_forge.TrainingRun(run_name="ridge-in-code"):
        autolog()


if __name__ == "__main__":
    {"autolog": autolog, "start_run": start_run_per_fit, "trainingrun": autolog_in_trainingrun}[sys.argv[1]]()
