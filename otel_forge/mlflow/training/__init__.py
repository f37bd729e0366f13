"""The training-run backend: ``TrainingRun`` opens or resumes the job's one run (``rendezvous``
across ranks, ``run_owner``'s thread), records what describes it (``run_description``, from
``run_metadata``'s pieces), logs the loop's metrics (``metric_buffer``, ``metric_flush``) and
checkpoints (``checkpoints``), ends it with the job's outcome (``outcome``, ``exit_handlers``) and
keeps what it could not deliver (``training_spool``); ``run_context`` nests the runs a launched
command starts under its run."""
