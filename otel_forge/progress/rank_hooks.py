"""The per-rank hook: a training process under ``otel-forge run`` reports its progress, no code needed.

``otel-forge run`` puts ``cli/bootstrap/`` first on CMD's ``PYTHONPATH``; its ``sitecustomize`` calls
``install()`` in every Python process CMD starts (the launcher's workers included). Nothing happens
until the process steps: a launcher, a DataLoader worker or a tool never writes a board file. Once
torch is imported (never by us), PyTorch's global optimizer step hook counts the steps; torch.save,
safetensors and torch's distributed checkpoint mark a checkpoint, the functions the
``evaluation_functions`` setting names mark an evaluation; in a rank of a distributed job
(``WORLD_SIZE`` > 1), collectives, and the backward passes of one step in ``WAITS_EVERY_STEPS``, are
timed as time the rank waits for its peers. A signal (``STACKS_SIGNAL``) makes faulthandler write
every thread's stack to a file beside the board, even while the main thread is stuck in C code.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import IO, Any

from otel_forge.config import PROGRESS_BOARD_ENV, env_name
from otel_forge.node import TORCHRUN_RESTART_COUNT_VAR, process_ranks
from otel_forge.progress.board import (
    STACKS_SIGNAL,
    Phase,
    RankBoard,
    RankIdentity,
    rank_file,
    start_ticks,
)
from otel_forge.progress.import_hooks import when_imported

_logger = logging.getLogger(__name__)

# The collectives a rank waits for its peers in (torch.distributed's Python API).
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv",
)  # fmt: skip
_CHECKPOINT_SAVES = {
    "torch": ("save",),
    "torch.serialization": ("save",),
    "safetensors.torch": ("save_file", "save_model"),
    "torch.distributed.checkpoint": ("save", "save_state_dict"),
}
_WRAPPED = "__otel_forge_progress__"


class RankHooks:
    """This process's board, made at its first step; ``None`` in a forked child."""

    def __init__(self, directory: Path, environ: Mapping[str, str]) -> None:
        self.directory = directory
        rank, local_rank, world_size = process_ranks(environ)
        restart = environ.get(TORCHRUN_RESTART_COUNT_VAR, "0")
        self._identity = RankIdentity(
            os.getpid(), rank or 0, local_rank or 0, world_size or 1, int(restart) if restart.isdigit() else 0,
            start_ticks(),
        )  # fmt: skip
        self._lock = threading.Lock()
        self.board: RankBoard | None = None  # once made: what the hooks write to
        self._stacks: IO[str] | None = None
        self._failed = False
        self._torch_hook: Any = None  # the handle of PyTorch's step hook, and how to register another
        self._register_torch_hook: Callable[[Callable[..., None]], Any] | None = None
        self._autograd: Any = None  # in a distributed rank: torch.autograd, whose backward is timed at times
        self._backward: Callable[..., Any] | None = None
        os.register_at_fork(after_in_child=self._forked)

    @property
    def world_size(self) -> int:
        return self._identity.world_size

    def made_board(self) -> RankBoard | None:
        """The board, made now if this is the process's first step (None where it cannot be)."""
        if self.board is not None or self._failed:
            return self.board
        with self._lock:
            if self.board is None and not self._failed:
                try:
                    self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                    path = rank_file(self.directory, self._identity.rank, self._identity.pid)
                    self._stacks = open(path.with_suffix(".stacks"), "a")  # noqa: SIM115 - held for the signal
                    faulthandler.register(STACKS_SIGNAL, file=self._stacks, all_threads=True, chain=False)
                    self.board = RankBoard(path, self._identity)
                except (OSError, ValueError, RuntimeError) as error:
                    self._failed = True  # the training goes on unobserved, never fails for it
                    _logger.debug("progress board not written in %s: %s", self.directory, error)
        return self.board

    def _forked(self) -> None:
        self.board, self._failed = None, True  # the parent's board is the parent's
        if self._torch_hook is not None:
            self._torch_hook.remove()

    def hook_torch(self, register: Callable[[Callable[..., None]], Any]) -> None:
        """Count PyTorch's optimizer steps through ``register`` (its global step post hook)."""
        self._register_torch_hook = register
        self._torch_hook = register(self.step)

    def step(self, *_: object) -> None:
        """PyTorch's step hook until the board is made; from then on the board's own ``step`` is (one
        call less on every step of the training)."""
        if (board := self.made_board()) is None:
            return
        if self._register_torch_hook is not None and self._torch_hook is not None:
            if self._backward is not None:
                board.time_waits_with(self._backward_timer(self._backward))
            self._torch_hook.remove()
            self._torch_hook = self._register_torch_hook(board.step)
            self._register_torch_hook = None
        board.step()

    def time_backward(self, autograd: ModuleType) -> None:
        """Time ``autograd.backward`` (where DDP's all-reduces run) as a wait for the peers, in the steps
        the board says: ``WAITS_EVERY_STEPS`` makes the wrapper's cost a fraction of a step's."""
        self._autograd, self._backward = autograd, autograd.backward

    def _backward_timer(self, bare: Callable[..., Any]) -> Callable[[bool], None]:
        """The board's ``time_waits``: puts the timed backward in place (``True``) or takes it out. A closure
        over locals, called by the step itself, that reads and writes the module's namespace (a dict item
        costs a fraction of a module attribute's)."""
        namespace, timed = vars(self._autograd), _waiting(self, bare)

        def time_waits(on: bool) -> None:
            # another library's own wrapper, put there since, stays
            if on:
                if namespace.get("backward") is bare:
                    namespace["backward"] = timed
            elif namespace.get("backward") is timed:
                namespace["backward"] = bare

        return time_waits

    def logged(self, step: int) -> None:
        if (board := self.board or self.made_board()) is not None:
            board.logged(step)

    @contextlib.contextmanager
    def phase(self, phase: Phase) -> Iterator[None]:
        board = self.board or self.made_board()
        if board is None:
            yield
            return
        back = board.enter(phase)
        try:
            yield
        finally:
            board.leave(back)


_hooks: RankHooks | None = None


def install(environ: Mapping[str, str] | None = None) -> RankHooks | None:
    """Under ``otel-forge run`` (its board directory handed down): hook this process. Idempotent."""
    global _hooks
    environ = os.environ if environ is None else environ
    if _hooks is not None or not (directory := environ.get(PROGRESS_BOARD_ENV)):
        return _hooks
    _hooks = hooks = RankHooks(Path(directory), environ)
    when_imported("torch", lambda torch: _hook_torch(torch, hooks))
    for module, names in _CHECKPOINT_SAVES.items():
        if module != "torch":
            when_imported(module, functools.partial(_wrap_all, names=names, around=_phase(hooks, Phase.CHECKPOINTING)))
    when_imported("mlflow", lambda mlflow: _hook_mlflow(mlflow, hooks))
    for module, qualname in _evaluation_functions(environ):
        when_imported(module, functools.partial(_wrap_all, names=(qualname,), around=_phase(hooks, Phase.EVALUATING)))
    return hooks


def installed() -> RankHooks | None:
    return _hooks


def logged(step: int) -> None:
    """A step the script logged (``TrainingRun.log``): progress, where the hook is installed."""
    if _hooks is not None:
        _hooks.logged(step)


@contextlib.contextmanager
def checkpointing() -> Iterator[None]:
    """The script says it checkpoints (``TrainingRun.register_checkpoint`` does): not a stall."""
    with _hooks.phase(Phase.CHECKPOINTING) if _hooks is not None else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def evaluating() -> Iterator[None]:
    """The script says it evaluates: the job is evaluating, not stalled, and goodput counts it so."""
    with _hooks.phase(Phase.EVALUATING) if _hooks is not None else contextlib.nullcontext():
        yield


def _evaluation_functions(environ: Mapping[str, str]) -> list[tuple[str, str]]:
    from otel_forge.config import SETTINGS_BY_NAME

    setting = SETTINGS_BY_NAME["evaluation_functions"]
    raw = environ.get(env_name("evaluation_functions"))
    try:
        names = setting.parse(raw) if raw is not None else setting.default
    except ValueError:
        return []  # `otel-forge run` said so already: the rank never fails for it
    return [tuple(name.split(":", 1)) for name in names]


Around = Callable[[Callable[..., Any]], Callable[..., Any]]


def _phase(hooks: RankHooks, phase: Phase) -> Around:
    return lambda function: _wrapped(function, lambda: hooks.phase(phase))


def _wrapped(function: Callable[..., Any], context: Callable[[], contextlib.AbstractContextManager[None]]) -> Any:
    if getattr(function, _WRAPPED, False):
        return function

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with context():
            return function(*args, **kwargs)

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _waiting(hooks: RankHooks, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` timed as a wait for the peers: two clock reads and an addition on the training's hot
    path (``RankBoard.enter_sync``'s and ``add_sync``'s work, inlined: a call less each way)."""
    if getattr(function, _WRAPPED, False):
        return function
    clock = time.monotonic_ns

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        board = hooks.board
        if board is None or board.sync_depth:  # nested in another wait: the outer one times it
            return function(*args, **kwargs)
        board.sync_depth = 1
        began = clock()
        try:
            return function(*args, **kwargs)
        finally:
            board.sync_depth = 0
            board.sync_ns += clock() - began

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _wrap_all(module: ModuleType, names: tuple[str, ...], around: Around) -> None:
    """Replace each of ``names`` (a function, or ``Class.method``) in ``module`` by ``around(it)``."""
    for name in names:
        owner: Any = module
        *path, attribute = name.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        function = getattr(owner, attribute, None) if owner is not None else None
        if callable(function):
            setattr(owner, attribute, around(function))


def _hook_torch(torch: ModuleType, hooks: RankHooks) -> None:
    hooks.hook_torch(importlib.import_module("torch.optim.optimizer").register_optimizer_step_post_hook)
    checkpoint = _phase(hooks, Phase.CHECKPOINTING)
    _wrap_all(torch, _CHECKPOINT_SAVES["torch"], checkpoint)
    _wrap_all(torch.serialization, _CHECKPOINT_SAVES["torch.serialization"], checkpoint)
    if hooks.world_size <= 1:
        return  # no peers to wait for: a lone process's every backward stays as it is
    # DDP's gradients are all-reduced inside backward: a rank's backward is partly its wait for the others.
    hooks.time_backward(torch.autograd)
    waits: Around = functools.partial(_waiting, hooks)
    distributed = getattr(torch, "distributed", None)
    if distributed is not None and distributed.is_available():
        _wrap_all(distributed, _COLLECTIVES, waits)


def _hook_mlflow(mlflow: ModuleType, hooks: RankHooks) -> None:
    def log_metric(function: Callable[..., Any], position: int) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = function(*args, **kwargs)
            step = kwargs.get("step", args[position] if len(args) > position else None)
            if isinstance(step, int):
                hooks.logged(step)
            return result

        setattr(wrapper, _WRAPPED, True)
        return wrapper

    # step is log_metric(key, value, step) and log_metrics(metrics, step) positionally
    _wrap_all(mlflow, ("log_metric",), functools.partial(log_metric, position=2))
    _wrap_all(mlflow, ("log_metrics",), functools.partial(log_metric, position=1))
