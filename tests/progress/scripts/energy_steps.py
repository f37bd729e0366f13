"""CMD of tests/progress/test_energy.py: a tiny torch loop, no otel_forge code (``otel-forge run``'s
rank hook counts its optimizer steps).

``energy_steps.py STEPS [--kill]``: waits a little (the node's GPUs are read before the first step),
takes STEPS optimizer steps, waits a little again (after them too), then exits, or SIGKILLs itself.
"""

import os
import signal
import sys
import time

import torch

steps = int(sys.argv[1])
time.sleep(1.0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(steps):
    optimizer.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    optimizer.step()
    time.sleep(0.05)
time.sleep(1.0)
print(f"steps taken {steps}", flush=True)
if "--kill" in sys.argv[2:]:
    os.kill(os.getpid(), signal.SIGKILL)
