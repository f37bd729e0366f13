"""The runs a command under ``otel-forge run`` starts itself nest under the run otel-forge opened.

MLflow loads ``LaunchedRunContext`` through its ``mlflow.run_context_provider`` entry point and asks
it for tags whenever ``mlflow.start_run()`` creates a run (also for ``mlflow.autolog``'s runs): under
``otel-forge run`` it adds ``mlflow.parentRunId`` = the launched run. MLflow applies the caller's own
tags after every provider's, so ``start_run(nested=True)`` inside the user's run keeps its parent.

``otel-forge run`` hands the launched run to its command as ``OTEL_FORGE_LAUNCHED_RUN_ID`` and not as
``MLFLOW_RUN_ID``: MLflow would resume that run at the command's first ``start_run()``, end it at that
run's end, and make every later run an unrelated one.

MLflow imports this module while it is importing itself: it must never raise, and imports nothing
of MLflow but the base class.
"""

from __future__ import annotations

import logging
import os

from mlflow.tracking.context.abstract_context import RunContextProvider

from otel_forge.config import LAUNCHED_RUN_ENV, LAUNCHER_OPENS, launched_run_id

_logger = logging.getLogger(__name__)

PARENT_RUN_TAG = "mlflow.parentRunId"


class LaunchedRunContext(RunContextProvider):
    """``mlflow.parentRunId`` = the launched run, for a run started with no run active in this thread.

    While the launched run is still opening (the tracking server did not answer at the job's start),
    its id is not known yet: the command's runs start unparented, as without otel-forge, said once at
    DEBUG. With a run active, MLflow asks providers for the tags of what it logs inside that run
    (logged models, datasets): those belong to the active run, not to the launched one.
    """

    def __init__(self) -> None:
        self._pending_said = False

    def in_context(self) -> bool:
        if launched_run_id() is None:
            self._say_pending()
            return False
        from mlflow.tracking.fluent import active_run

        return active_run() is None

    def tags(self) -> dict[str, str]:
        run_id = launched_run_id()
        return {PARENT_RUN_TAG: run_id} if run_id is not None else {}

    def _say_pending(self) -> None:
        if self._pending_said or os.environ.get(LAUNCHED_RUN_ENV) != LAUNCHER_OPENS:
            return
        self._pending_said = True
        _logger.debug("otel-forge run is still opening its run: runs started now are not nested under it")
