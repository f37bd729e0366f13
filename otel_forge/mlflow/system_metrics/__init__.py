"""System metrics into an MLflow run: the agent's collects folded into windows (``windows``), one
step per window under ``system/<node>/`` (``exporter``, ``window_logger``), delivered in order
without ever holding the reader (``worker``), spooled on disk when the server is away
(``window_spool``), one writer per node prefix (``writer_lock``); ``monitor`` is the agent with
this exporter as one more sink."""
