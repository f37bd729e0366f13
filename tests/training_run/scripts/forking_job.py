"""A training job whose process forks while its ``TrainingRun`` is open (system metrics sampled):

    python forking_job.py pool        multiprocessing 'fork' Pool, terminated (SIGTERM to its workers)
    python forking_job.py process     'fork' Processes, one exiting normally, one by an exception
    python forking_job.py os-fork     os.fork() children leaving the `with` block: sys.exit(0), and raising
    python forking_job.py dataloader  torch DataLoader(num_workers=4), the 'fork' start method
    python forking_job.py early       a 'fork' Process at once, while the run may still be opening

Then the parent logs STEPS values and leaves the block normally.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time

from otel_forge import TrainingRun

STEPS = 10


def square(value: int) -> int:
    time.sleep(0.2)
    return value * value


def fail() -> None:
    raise RuntimeError("a worker failed")


def fork_children(mode: str) -> None:
    fork = multiprocessing.get_context("fork")
    if mode == "pool":
        pool = fork.Pool(2)
        assert pool.map(square, range(6)) == [v * v for v in range(6)]
        time.sleep(1.0)  # the workers live through sampling intervals
        pool.terminate()
        pool.join()
    elif mode in ("process", "early"):
        children = [fork.Process(target=time.sleep, args=(1.0,)), fork.Process(target=fail)]
        for child in children:
            child.start()
        for child in children:
            child.join()
    elif mode == "dataloader":
        import torch

        class Slow(torch.utils.data.Dataset):  # the workers live through sampling intervals
            def __len__(self) -> int:
                return 64

            def __getitem__(self, index: int) -> torch.Tensor:
                time.sleep(0.05)
                return torch.tensor(float(index))

        data = torch.utils.data.DataLoader(Slow(), batch_size=8, num_workers=4)
        assert sum(float(batch.sum()) for batch in data) == float(sum(range(64)))


def main(mode: str) -> None:
    with TrainingRun(config={"mode": mode}) as run:
        if mode == "os-fork":
            for how in ("exit", "raise"):
                if os.fork() == 0:
                    time.sleep(1.0)
                    if how == "exit":
                        sys.exit(0)  # leaves the with-block in the child
                    raise RuntimeError("the child failed")
            for _ in range(2):
                os.wait()
        else:
            fork_children(mode)
        for step in range(STEPS):
            run.log({"loss": 1.0 / (step + 1)}, step)
            time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1])
