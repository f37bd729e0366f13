"""A forked child owns nothing of its parent's agent or run.

Every PyTorch ``DataLoader(num_workers>0)`` forks the training process. The child inherits the
parent's objects, not its threads: an agent, an exporter or a run seen from a child must not
sample, spool, flush, tag, end or delete anything, nor run the parent's exit and signal handlers.
Each owner remembers the pid that made it and asks ``forked_from`` before acting.
"""

from __future__ import annotations

import os


def forked_from(owner_pid: int) -> bool:
    """Whether this process is a forked child of the process ``owner_pid`` (not that process)."""
    return os.getpid() != owner_pid
