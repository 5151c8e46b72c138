"""Functions and their arguments sent to the ranks for ``sv.run``: a notebook function travels
as code with the plain values and imports it names; library functions by import path."""

from __future__ import annotations

import os
import sys
import sysconfig
import types
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import BackendError

# --- shipping functions for sv.run ---------------------------------------------------------------

_LIB_DIRS = tuple(
    {
        os.path.realpath(p) + os.sep
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    }
)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def _library_module(name: str) -> bool:
    """A module the engines import the same way: installed or standard library, not a script."""
    mod = sys.modules.get(name)
    if mod is None:
        return False
    file = getattr(mod, "__file__", None)
    if file is None:
        return name in sys.builtin_module_names or name.split(".")[0] in ("torch", "numpy", "shardviz")
    return os.path.realpath(file).startswith(_LIB_DIRS) or name.split(".")[0] == "shardviz"


def import_spec(value: Any) -> tuple[str, ...] | None:
    """How a rank gets the same object by importing it, or None."""
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__) if value.__name__ != "__main__" else None
    mod = getattr(value, "__module__", None)
    qual = getattr(value, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qual, str) or "<" in qual or not _library_module(mod):
        return None
    obj: Any = sys.modules[mod]
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    return ("attr", mod, qual) if obj is value else None


def notebook_imports(ns: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Names the notebook imported (``sv``, ``torch``, ``Shard``...), so cells see them on ranks."""
    out = {}
    for name, value in list(ns.items()):
        if name.startswith("_") or name in ("In", "Out", "exit", "quit", "get_ipython"):
            continue
        if isinstance(value, types.ModuleType | type) or callable(value):
            spec = import_spec(value)
            if spec is not None:
                out[name] = spec
    return out


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _plain(value: Any, depth: int = 0) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if depth < 3 and isinstance(value, tuple | list | frozenset | set):
        return all(_plain(v, depth + 1) for v in value)
    if depth < 3 and isinstance(value, dict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return type(value).__module__ == "torch" and type(value).__name__ in ("dtype", "device")


def ship_function(fn: Callable[..., Any]) -> tuple[Any, dict[str, Any]]:
    """``fn`` and what its globals must hold on a rank: imports by name, plain constants and
    helper functions by value. Names it finds nowhere come from the rank (earlier cells' names).

    Functions from scripts and test files are sent by code, since the engines may not import them.
    """
    env: dict[str, Any] = {"imports": {}, "constants": {}, "functions": {}, "lines": {}}
    if not isinstance(fn, types.FunctionType) or import_spec(fn) is not None:
        return fn, env
    done: dict[int, types.FunctionType] = {}

    def detach(f: types.FunctionType) -> types.FunctionType:
        if id(f) in done:
            return done[id(f)]
        closure = None
        if f.__closure__:
            closure = tuple(types.CellType(_ship_cell(c, detach)) for c in f.__closure__)
        new = types.FunctionType(f.__code__, {}, f.__name__, f.__defaults__, closure)
        new.__kwdefaults__ = f.__kwdefaults__
        new.__module__ = "__main__"  # ipyparallel then binds it to the rank's namespace
        new.__qualname__ = f.__qualname__
        done[id(f)] = new
        filename = f.__code__.co_filename
        import linecache

        if filename not in env["lines"]:
            env["lines"][filename] = linecache.getlines(filename)
        for name in sorted(_global_names(f.__code__)):
            if name not in f.__globals__:
                continue
            value = f.__globals__[name]
            spec = import_spec(value)
            if spec is not None:
                env["imports"][name] = spec
            elif isinstance(value, types.FunctionType):
                env["functions"][name] = detach(value)
            elif _plain(value):
                env["constants"][name] = value
        return new

    return detach(fn), env


def _ship_cell(cell: Any, detach: Callable[[types.FunctionType], types.FunctionType]) -> Any:
    try:
        value = cell.cell_contents
    except ValueError:
        return None
    if isinstance(value, types.FunctionType) and import_spec(value) is None:
        return detach(value)
    return value


def args_for_rank(value: Any, rank: int) -> Any:
    """An argument as one rank receives it: a per-rank tensor (``sv.per_rank``) gives its own."""
    from ...capture import torch as _torch

    local = _torch.local_tensors(value)
    if local is not None:
        return local[rank]
    if _torch.is_dtensor(value):
        raise BackendError(
            "sv.run got a DTensor made in the notebook; under a real backend DTensors live on the ranks: "
            "make it inside the function (or a %%spmd cell)"
        )
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(args_for_rank(v, rank) for v in value)
    if isinstance(value, list):
        return [args_for_rank(v, rank) for v in value]
    if isinstance(value, dict):
        return {k: args_for_rank(v, rank) for k, v in value.items()}
    return value
