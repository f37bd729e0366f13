"""CMD for the signal tests: records every SIGINT/SIGTERM it receives, then exits.

    python signal_child.py RECORD exit:CODE   # handles SIGINT/SIGTERM: records, 1 s of "cleanup", exits CODE
    python signal_child.py RECORD default     # SIGTERM's default action: dies by the signal

``RECORD.ready`` appears once the handlers are in place. A second signal arriving during the
cleanup is recorded too (that is what a duplicate would interrupt in a real training script).
"""

from __future__ import annotations

import os
import signal
import sys
import time

record, mode = sys.argv[1], sys.argv[2]
stopping = False


def on_signal(signum: int, frame: object) -> None:
    global stopping
    with open(record, "a") as out:
        out.write(f"{signum}\n")
    if stopping:
        return
    stopping = True
    time.sleep(1.0)
    sys.exit(int(mode.split(":", 1)[1]))


if mode.startswith("exit:"):
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
with open(record + ".tmp", "w"):
    pass
os.replace(record + ".tmp", record + ".ready")
time.sleep(120)
sys.exit(99)
