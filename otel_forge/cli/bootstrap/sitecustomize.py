"""Python runs this at start in every process ``otel-forge run`` starts (this directory is first on
CMD's ``PYTHONPATH``, as ``ddtrace-run`` and ``opentelemetry-instrument`` do it): the progress hook is
installed, and MLflow's import made to wait for the job's run where the launcher is still opening it;
then the ``sitecustomize`` this one hides, if the environment has one, runs as before."""

import importlib.util
import os
import sys


def _install() -> None:
    try:
        from otel_forge.config import LAUNCHED_RUN_ENV, LAUNCHER_OPENS
        from otel_forge.progress.rank_hooks import install

        install()
        if os.environ.get(LAUNCHED_RUN_ENV) == LAUNCHER_OPENS:  # (an import the other processes skip)
            from otel_forge.mlflow.training.launched_run import await_launched_run_at_mlflow_import

            await_launched_run_at_mlflow_import()
    except Exception:  # noqa: BLE001 - the training starts whatever becomes of its hooks
        pass


def _run_hidden_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    saved, sys.path[:] = sys.path[:], rest
    try:
        spec = importlib.util.find_spec("sitecustomize")
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["sitecustomize"] = module
            spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop("sitecustomize", None)
        raise
    finally:
        sys.path[:] = saved
        if "sitecustomize" not in sys.modules and ours is not None:
            sys.modules["sitecustomize"] = ours  # the import of this module must find it when done


_install()
_run_hidden_sitecustomize()
