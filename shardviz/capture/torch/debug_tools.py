"""torch's own debug modes (``CommDebugMode``, ``DebugMode``) in the simulator: they see what they
see on real ranks.

A lockstep tensor (LocalTensor) answers size and stride queries through the dispatcher, so a
dispatch mode entered inside the simulation sees ``aten.sym_size``, ``aten.sym_stride``,
``aten.sym_storage_offset``, ... that a plain tensor on a real rank answers in C++ without
dispatching. ``CommDebugMode`` then lists them among a module's operations (its default table,
noise level 3, and an empty "BACKWARD PASS" for a module at level 1), and ``DebugMode`` logs them.
While the simulation runs, those two modes pass such a query on a LocalTensor straight through,
unlogged; every other op reaches them as it is, the batched engine's stacked tensors as the
LocalTensors they are.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor.debug import CommDebugMode

from .gate import DebugMode, LocalTensor
from .stacked import StackedLocalTensor

_aten = torch.ops.aten
# Metadata a plain CPU tensor answers without dispatching (its sizes and strides policy).
_METADATA = frozenset(
    {
        _aten.sym_size.default,
        _aten.sym_size.int,
        _aten.sym_stride.default,
        _aten.sym_stride.int,
        _aten.sym_numel.default,
        _aten.sym_storage_offset.default,
        _aten.dim.default,
        _aten.is_contiguous.default,
        _aten.is_contiguous.memory_format,
        _aten.is_strides_like_format.default,
        _aten.is_non_overlapping_and_dense.default,
    }
)

_lock = threading.Lock()
_depth = 0
_originals: dict[type, Any] = {}


def _unlogged_metadata(original: Any) -> Any:
    @functools.wraps(original)
    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _METADATA and args and isinstance(args[0], LocalTensor):
            return func(*args, **(kwargs or {}))
        if StackedLocalTensor in types:
            # The batched engine's tensors are LocalTensors to these modes, which test the type
            # exactly (``LocalTensor in types``): else DebugMode drops every op on them.
            types = tuple(LocalTensor if t is StackedLocalTensor else t for t in types)
        return original(self, func, types, args, kwargs)

    return dispatch


@contextlib.contextmanager
def debug_modes_as_on_real_ranks() -> Iterator[None]:
    """While the lockstep simulation runs: the debug modes do not log a LocalTensor's metadata
    queries (see above)."""
    global _depth
    with _lock:
        if _depth == 0:
            for cls in (CommDebugMode, DebugMode):
                _originals[cls] = cls.__dict__["__torch_dispatch__"]
                setattr(cls, "__torch_dispatch__", _unlogged_metadata(_originals[cls]))  # noqa: B010
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                for cls, original in _originals.items():
                    setattr(cls, "__torch_dispatch__", original)  # noqa: B010
                _originals.clear()
