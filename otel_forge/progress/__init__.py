"""Training progress: what each rank reports, and what the node makes of it.

The rank side (``rank_hooks``, ``board``, ``import_hooks``) runs inside every training process that
``otel-forge run`` starts and imports the standard library only; the node side (``stall``,
``goodput``, ``stacks``, ``throughput``) runs in the node's otel-forge process.
"""
