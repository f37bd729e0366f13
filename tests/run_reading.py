"""Reading a node's system metrics back as a user would: by its anchor, the smallest key under the
node's prefix, which every window holds (the other values are sent when they change)."""

from __future__ import annotations

from typing import Any


def anchor_key(client: Any, run_id: str, prefix: str = "system/") -> str:
    """The node's anchor key in the run (``prefix``: ``system/`` or ``system/<node>/``)."""
    keys = [
        key for key in client.get_run(run_id).data.metrics if key.startswith(prefix) and "/" not in key[len(prefix) :]
    ]
    assert keys, f"no {prefix}* metric in run {run_id}"
    return min(keys)


def anchor_history(client: Any, run_id: str, prefix: str = "system/") -> list[Any]:
    """The anchor's points, by step: one per window the node delivered."""
    return sorted(client.get_metric_history(run_id, anchor_key(client, run_id, prefix)), key=lambda m: m.step)


def anchor_steps(client: Any, run_id: str, prefix: str = "system/") -> list[int]:
    return [m.step for m in anchor_history(client, run_id, prefix)]
