"""A tiny data-parallel training job for the progress tests: run by ``torchrun --nproc-per-node 2``
(gloo, CPU) under ``otel-forge run``. It knows nothing of otel-forge: what otel-forge sees of it, it
sees through its own hook (optimizer steps, torch.save, collectives).

Each step sleeps ``--step-seconds`` in the forward (the rank's own work), then the gradients are
all-reduced: by hand (``dist.all_reduce``, the default) or by DDP (``--ddp``, inside backward).

``--stall-rank R --stall-at N --release FILE``: before its step N, rank R waits in a function of its
own (``wait_for_the_disk``) until FILE exists; the other ranks wait for it in the next all-reduce.
``--checkpoint-at N --checkpoint-seconds S``: before step N every rank saves its model with
``torch.save`` to a file whose writes take S seconds in all. ``--slow-rank R --slow-by F``: rank R's
forward takes F more (0.3: 30 % slower). ``--until FILE``: train until FILE exists (``--steps`` at
most). ``--out DIR``: each rank writes ``rank-<R>.json``, its own clock's account (``time.monotonic()``,
the clock otel-forge reads too): its first and last step's end, its checkpoints and its wait.
"""

from __future__ import annotations

import argparse
import io
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist


class SlowDisk(io.RawIOBase):
    """A file whose writes take ``seconds`` in all: each write sleeps a little, the final flush the rest."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        time.sleep(max(0.0, min(0.2, self.deadline - time.monotonic())))
        self.written += len(data)
        return len(data)

    def flush(self) -> None:
        time.sleep(max(0.0, self.deadline - time.monotonic()))


class Model(torch.nn.Module):
    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.layer = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay_s)  # the rank's own work
        return self.layer(x)


def wait_for_the_disk(release: Path, longest_s: float) -> None:
    deadline = time.monotonic() + longest_s
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


def _everyone_sees(path: Path) -> bool:
    """Whether any rank sees ``path``: every rank stops at the same step."""
    seen = torch.tensor([float(path.exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    return bool(seen.item())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--ddp", action="store_true")
    parser.add_argument("--stall-rank", type=int)
    parser.add_argument("--stall-at", type=int, default=40)
    parser.add_argument("--release", type=Path)
    parser.add_argument("--stall-longest-s", type=float, default=150.0)
    parser.add_argument("--checkpoint-at", type=int)
    parser.add_argument("--checkpoint-seconds", type=float, default=0.0)
    parser.add_argument("--slow-rank", type=int)
    parser.add_argument("--slow-by", type=float, default=0.3)
    parser.add_argument("--until", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    delay = args.step_seconds * (1 + args.slow_by if rank == args.slow_rank else 1)
    model = Model(delay)
    net = torch.nn.parallel.DistributedDataParallel(model) if args.ddp else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = torch.randn(8, 16)
    account: dict[str, object] = {"rank": rank, "checkpoints": [], "steps": 0}
    for step in range(args.steps):
        if args.until is not None and _everyone_sees(args.until):
            break
        if step == args.stall_at and rank == args.stall_rank:
            began = time.monotonic()
            wait_for_the_disk(args.release, args.stall_longest_s)
            account["stall"] = [began, time.monotonic()]
        if step == args.checkpoint_at:
            disk = SlowDisk(args.checkpoint_seconds)
            began = time.monotonic()
            torch.save(model.state_dict(), disk)
            account["checkpoints"].append([began, time.monotonic()])  # type: ignore[attr-defined]
        optimizer.zero_grad()
        loss = net(data).square().mean()
        loss.backward()
        if not args.ddp:
            for parameter in model.parameters():
                dist.all_reduce(parameter.grad)
                parameter.grad /= world
        optimizer.step()
        now = time.monotonic()
        account.setdefault("first_step", now)
        account["last_step"] = now
        account["steps"] = step + 1
    dist.barrier()
    dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank-{rank}.json").write_text(json.dumps(account))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
