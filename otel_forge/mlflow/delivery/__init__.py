"""The one delivery engine (``Delivery``) and what it delivers from: a ``Source`` says what is due,
the engine sends it, classifies a failure (``Outcome``) and waits as ``Backoff`` says. Two sources:
the system-metrics windows' ``Outbox`` (a queue, spilling to the on-disk spool) and a run's journal
(``otel_forge.mlflow.training.journal_source``)."""
