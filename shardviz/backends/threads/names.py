"""Each rank's names under the threads backend: a ``%%spmd`` cell's namespace kept per rank, and what
a rank reads from the notebook copied for it on first use, so that one rank's changes never reach
another."""

from __future__ import annotations

import builtins
import copy
import enum
import types
from collections.abc import Callable
from typing import Any

import torch

from ...capture import torch as _torch
from ...capture.recorder import split_per_rank
from ...errors import BackendError


class RankNamespace(dict[str, Any]):
    """A rank's names in ``%%spmd`` cells: its own, then the notebook's, each copied for the rank on
    first use (a name missing here is looked up through ``__missing__``: Python does that for
    globals that are not a plain dict). A copy is made again when the notebook rebinds the name."""

    def __init__(self, rank: int) -> None:
        super().__init__(__builtins__=builtins)
        self.rank = rank
        self.notebook: dict[str, Any] = {}
        self.borrowed: dict[str, tuple[Any, Any]] = {}  # name -> (the notebook's object, the copy)
        self.borrower: Borrower | None = None  # this run's copies

    def attach(self, notebook: dict[str, Any]) -> None:
        """Before a cell: drop copies of names the notebook has since rebound."""
        self.notebook = notebook
        self.borrower = None
        for name, (original, mine) in list(self.borrowed.items()):
            if notebook.get(name, _MISSING) is not original or self.get(name, _MISSING) is not mine:
                del self.borrowed[name]
                if self.get(name, _MISSING) is mine:
                    del self[name]

    def __missing__(self, name: str) -> Any:
        if name.startswith("__") or name in _IPYTHON_NAMES or name not in self.notebook:
            raise KeyError(name)
        original = self.notebook[name]
        if self.borrower is None:
            self.borrower = Borrower(self.rank, self.notebook, self)
        mine = self.borrower.value(original)
        self[name] = mine
        self.borrowed[name] = (original, mine)
        return mine


_MISSING = object()
_IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___"})
_SHARED = (
    types.ModuleType,
    type,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.MethodWrapperType,
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    range,
    torch.dtype,
    torch.device,
    enum.Enum,
)


class Borrower:
    """Copies of what one rank's code reads from a namespace it shares with the notebook: its own
    tensors, modules and containers (one copy per object per run: shared references stay shared
    within the rank), and functions rebound to read through the rank's namespace."""

    def __init__(self, rank: int, source: dict[str, Any] | None, ns: dict[str, Any]) -> None:
        self.rank = rank
        self.source = source
        self.ns = ns if isinstance(ns, RankNamespace) else self._namespace(ns)
        self.memo: dict[int, Any] = {}

    def _namespace(self, own: dict[str, Any]) -> RankNamespace:
        ns = RankNamespace(self.rank)
        ns.update(own)
        ns.notebook = self.source if self.source is not None else {}
        ns.borrower = self
        return ns

    def function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.value(fn)

    def value(self, v: Any) -> Any:
        if isinstance(v, _SHARED):
            return v
        hit = self.memo.get(id(v))
        if hit is not None:
            return hit
        out = self._copy(v)
        self.memo[id(v)] = out
        return out

    def _copy(self, v: Any) -> Any:
        if isinstance(v, types.FunctionType):
            if self.source is not None and v.__globals__ is self.source:
                return self._rebound(v)
            return v
        if _torch.is_local_tensor(v):
            with _torch.no_dispatch():
                return split_per_rank(v, [self.rank])[self.rank]
        if _torch.is_dtensor(v):
            raise BackendError(
                "a DTensor made outside the rank threads (by the lockstep simulator, or in the notebook) "
                "cannot be used on a rank under sv.use('threads'): its mesh belongs to another process "
                "group. Make it inside sv.run(fn) or a %%spmd cell."
            )
        if isinstance(v, torch.Tensor):
            # Past the rank's dispatch modes: the copy stands for data a real rank already holds, so
            # a debug mode the user's code has entered (DebugMode, CommDebugMode) must not see it.
            with _torch.no_dispatch():
                if v.is_leaf:
                    return copy.deepcopy(v)  # a Parameter stays one, requires_grad is kept
                return v.detach().clone().requires_grad_(v.requires_grad)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(self.value(x) for x in v)
        if isinstance(v, dict) and type(v) is dict:
            return {k: self.value(x) for k, x in v.items()}
        try:
            with _torch.no_dispatch():  # a module's tensors too (above)
                return copy.deepcopy(v)
        except Exception:  # a lock, a generator, an open file: not copyable, shared as it is
            return v

    def _rebound(self, f: types.FunctionType) -> types.FunctionType:
        """``f`` reading its globals through the rank's namespace, with its own closure and defaults."""
        closure = None
        if f.__closure__ is not None:
            closure = tuple(
                types.CellType(self.value(c.cell_contents)) if _filled(c) else c for c in f.__closure__
            )
        new = types.FunctionType(f.__code__, self.ns, f.__name__, self.value(f.__defaults__), closure)
        self.memo[id(f)] = new
        new.__kwdefaults__ = self.value(f.__kwdefaults__)
        new.__qualname__ = f.__qualname__
        new.__dict__.update(f.__dict__)
        return new


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True
