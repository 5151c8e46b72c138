"""LocalTensorMode and the dispatch-mode stack: which simulation is active, which ones shardviz
made, and running plain tensor code past every mode."""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .gate import LocalTensor, LocalTensorMode, _private
from .gate import _version as _torch_version


def active_local_mode() -> Any:
    """The innermost active LocalTensorMode, or None."""
    return _private["local_tensor_mode"]()


# The LocalTensorModes shardviz made (its backends' and its threads'): any other active one was
# entered by the user or a test harness, and recording attaches to it instead of making its own.
_own_modes: weakref.WeakSet[Any] = weakref.WeakSet()


# The simulator's engines: "batched" (every rank's values of a tensor stacked, each op run once
# for all ranks: ``batched``) or "lockstep" (torch's LocalTensorMode: each op once per rank).
ENGINES = ("batched", "lockstep")
ENGINE_ENV = "SHARDVIZ_ENGINE"


def default_engine() -> str:
    """The engine ``sv.use("local")`` gets when none is named: ``$SHARDVIZ_ENGINE`` if set."""
    name = os.environ.get(ENGINE_ENV, "").strip() or DEFAULT_ENGINE
    return check_engine(name)


# The batched engine reaches LocalTensor's collective helpers as torch 2.13 has them.
BATCHED_FROM = (2, 13)
_HERE = _torch_version(torch.__version__)
# The same results and traces as lockstep, bit for bit (tests/unit/test_engine_batched.py and the
# differential test), several times faster; below 2.13 torch's LocalTensorMode, as before.
DEFAULT_ENGINE = "batched" if _HERE >= BATCHED_FROM else "lockstep"


def check_engine(name: object) -> str:
    if name not in ENGINES:
        raise ValueError(f"unknown simulator engine {name!r}; choose one of {ENGINES} (or set ${ENGINE_ENV})")
    if name == "batched" and _HERE < BATCHED_FROM:
        raise ValueError(
            f"the batched simulator engine needs torch >= {BATCHED_FROM[0]}.{BATCHED_FROM[1]} (this is "
            f"{torch.__version__}): use the default engine, sv.use('local', world_size=N) (engine="
            f"'lockstep'), or unset ${ENGINE_ENV}"
        )
    return str(name)


def new_local_mode(world_size: int, engine: str | None = None) -> Any:
    """A LocalTensorMode shardviz owns, on ``engine`` (the default engine if None)."""
    if check_engine(engine or default_engine()) == "batched":
        from .batched import BatchedLocalTensorMode

        mode = BatchedLocalTensorMode(world_size)
    else:
        mode = LocalTensorMode(world_size)
    _own_modes.add(mode)
    return mode


def is_batched(mode: Any) -> bool:
    """Whether ``mode`` is the batched engine's (its tensors are stacked across ranks)."""
    from .batched import BatchedLocalTensorMode

    return isinstance(mode, BatchedLocalTensorMode)


def is_own_mode(mode: Any) -> bool:
    return mode in _own_modes


def local_modes() -> list[Any]:
    """shardviz's own LocalTensorModes and the active one (a harness's, which recording attaches to)."""
    active = active_local_mode()
    return [*_own_modes, *([active] if active is not None and active not in _own_modes else [])]


@contextlib.contextmanager
def watching_local_modes(
    on_enter: Callable[[Any], None], on_exit: Callable[[Any, tuple[Any, ...]], None]
) -> Iterator[None]:
    """While active, ``on_enter(mode)`` runs just after a LocalTensorMode that shardviz did not make
    is entered with no other one active (a test harness opening its simulation), and
    ``on_exit(mode, exc_info)`` just before that mode is left: the place to push a dispatch mode on
    top of it and pop it again. torch's own nested entries are not reported."""
    cls = LocalTensorMode
    original_enter, original_exit = cls.__enter__, cls.__exit__
    watched: set[int] = set()

    @functools.wraps(original_enter)
    def enter(self: Any) -> Any:
        outermost = active_local_mode() is None
        out = original_enter(self)
        if outermost and not is_own_mode(self):
            watched.add(id(self))
            on_enter(self)
        return out

    @functools.wraps(original_exit)
    def exit_(self: Any, *exc: Any) -> Any:
        if id(self) in watched and active_local_mode() is self:
            watched.discard(id(self))
            try:
                on_exit(self, exc)
            finally:
                left = original_exit(self, *exc)  # the mode is left even if on_exit failed
            return left
        return original_exit(self, *exc)

    cls.__enter__, cls.__exit__ = enter, exit_
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = original_enter, original_exit


def drop_stale_local_mode(mode: Any) -> bool:
    """Whether ``mode`` was listed as active by torch without being entered, and is now dropped.

    An error that unwinds through LocalTensorMode's own dispatch without running its ``__exit__``
    (a RecursionError inside torch.compile's tracing) leaves it in torch's list of active local
    modes while off the dispatch stack: every later simulation would then find it "already
    active", enter nothing, and run on plain tensors."""
    listed = getattr(_private["local_tensor_module"], "get_local_tensor_mode_list", None)
    modes = listed() if listed is not None else []
    if mode not in modes or mode in dispatch_mode_stack():
        return False
    modes[:] = [m for m in modes if m is not mode]
    mode.disable_()
    return True


def dispatch_mode_stack() -> list[Any]:
    return list(_private["dispatch_mode_stack"]())


@contextlib.contextmanager
def no_dispatch() -> Iterator[None]:
    """Run plain tensor code with every dispatch mode suspended (for snapshots)."""
    with _private["disable_current_modes"]():
        yield


def plain_ops() -> Any:
    """Run ops on plain tensors straight to their kernels, past every dispatch mode and subclass
    handler: a C++ guard, some twenty times cheaper than ``no_dispatch`` (which pops and pushes
    the mode stack). Only for plain tensors: a LocalTensor's ops would not reach its handler."""
    return _private["DisableTorchDispatch"]()


def reenter(mode: Any) -> None:
    """Put ``mode`` back on top of the dispatch-mode stack from inside its own
    ``__torch_dispatch__``, where torch took it off for the call, so that the ops the call runs
    reach it again. ``TorchDispatchMode.__enter__`` would also save and set Python-side flags, which
    the mode's first entry set already: at one push per DTensor op, that costs the recorder."""
    _private["push_dispatch_mode"](mode)


def leave_reentered() -> None:
    """Take the mode ``reenter`` pushed off again."""
    _private["pop_dispatch_mode"](None)


def local_reduce(reduce_op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A group's reduction exactly as LocalTensorMode computes it (same order, same bits)."""
    return _private["local_reduce"](reduce_op, tensors)


def is_local_tensor(t: object) -> bool:
    return isinstance(t, LocalTensor)


def local_tensors(t: object) -> dict[int, torch.Tensor] | None:
    """The per-rank tensors of a LocalTensor (None for anything else)."""
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    return None


def local_of(dt: DTensor) -> torch.Tensor:
    """A DTensor's local tensor as the DTensor holds it (``DTensor._local_tensor``): a LocalTensor
    in the simulator, this rank's shard on a real backend. Unlike ``to_local()`` it makes no
    autograd node and is no user call (``UserCallWatch`` does not see it)."""
    return dt._local_tensor


def debug_mode_counter(delta: int) -> None:
    """Tell DTensor a DebugMode-like recorder is (or is no longer) active.

    DTensor reports redistributes only when this module-level counter is non-zero.
    """
    _private["debug_mode_module"]._ACTIVE_DEBUG_MODE_COUNT += delta
