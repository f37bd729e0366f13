"""The training-run backend: ``TrainingRun`` (a facade) over the run's plan (``run_plan``), its opener
(``run_opener``, with ``job_run`` and ``rendezvous`` across ranks), the journal the training process
appends to (``run_journal``, written by ``run_recorder``, each value checked by ``metric_values``) and
that journal's delivery outside the training process (``run_delivery``: the ``companion`` process,
``otel-forge run``'s ``job_journals``, or ``otel-forge replay``; all ``journal_delivery``). What describes
a run (``run_description``, from ``run_metadata``'s pieces), checkpoints (``checkpoints``), the run's end
as the job's outcome (``outcome``, ``exit_handlers``); ``run_context`` nests the runs a launched command
starts under its run."""
