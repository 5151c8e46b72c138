"""The model map of a live module: its parameters, buffers, gradients and optimizer state read
into plain rows (``shardviz.data.model.ModelMap``).

A DTensor's layout is pure geometry from its mesh and placements (``layout.compute``), never a
simulation; a plain tensor is whole on every rank. How many ranks the world has is the caller's to
say (a front end knows the current backend's); without it, the process group's, else one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ..data.events import DTYPE_SIZES
from ..data.model import Builder, ModelMap, from_layouts
from ..geometry.layout import compute as compute_layout
from . import adapters
from . import torch as _torch


def model_map(
    model: Any,
    optimizer: Any = None,
    *,
    world_size: int | None = None,
    grads: bool = True,
    buffers: bool = True,
    name: str | None = None,
    backend_world: int | None = None,
) -> ModelMap:
    """The model map of an ``nn.Module``, or of ``{name: Layout}``; see ``sv.model_map``.

    ``backend_world``: the current backend's world size, which plain tensors are replicated over
    when ``world_size`` is not given (else the process group's, else one; widened to the largest
    rank a DTensor names)."""
    default_world = backend_world if backend_world is not None else _process_group_world()
    if isinstance(model, Mapping):
        return from_layouts(model, world_size=world_size, name=name, default_world=default_world)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "sv.model_map takes an nn.Module (or {name: Layout} for pure geometry); got "
            f"{type(model).__name__}"
        )
    b = Builder(world_size)
    state = _optimizer_state(optimizer)
    modules: list[tuple[str, str]] = []
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        modules.append((mname, type(mod).__name__))
        prefix = f"{mname}." if mname else ""
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:  # tied weights: counted once, where first met
                continue
            seen.add(id(p))
            full = prefix + pname
            _add(b, full, "param", mname, full, p)
            g = p.grad if grads else None
            if g is not None:
                _add(b, f"{full}.grad", "grad", mname, full, g)
            for key, v in state.get(id(p), ()):
                _add(b, f"{full}:{key}", "optimizer", mname, full, v)
        if buffers:
            for bname, buf in mod.named_buffers(recurse=False):
                if buf is None or id(buf) in seen:
                    continue
                seen.add(id(buf))
                _add(b, prefix + bname, "buffer", mname, prefix + bname, buf)
    return b.finish(name or type(model).__name__, tuple(modules), default_world)


def _process_group_world() -> int:
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def _itemsize(dtype: str) -> int:
    """Bytes per element of a torch dtype by name: the table's, else torch's own."""
    size = DTYPE_SIZES.get(dtype)
    if size is not None:
        return size
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return torch_dtype.itemsize


def _add(b: Builder, name: str, kind: str, module: str, param: str, t: Any) -> None:
    if _torch.is_dtensor(t):
        layout = compute_layout(**_torch.dtensor_geometry(t))
        b.add_layout(name, kind, module, param, layout, True, _itemsize(layout.dtype))
        return
    adapter = adapters.for_object(t)
    if adapter is not None:  # PhysicsNeMo's ShardTensor: its own shard sizes
        layout = adapter.layout(t)
        b.add_layout(name, kind, module, param, layout, True, _itemsize(layout.dtype))
        return
    dtype = _torch.dtype_name(t.dtype)
    b.add_plain(name, kind, module, param, tuple(int(s) for s in t.shape), dtype, _itemsize(dtype))


def _optimizer_state(optimizer: Any) -> dict[int, list[tuple[str, Any]]]:
    if optimizer is None:
        return {}
    out: dict[int, list[tuple[str, Any]]] = {}
    for opt in _each_optimizer(optimizer):
        state = getattr(opt, "state", None)
        if not isinstance(state, Mapping):
            raise TypeError(
                "optimizer= takes a torch.optim.Optimizer, a wrapper of several with .optimizers "
                f"(torchtitan's OptimizersContainer) or a list of them, not {type(opt).__name__}"
            )
        for p, st in state.items():
            if not isinstance(st, Mapping) or id(p) in out:  # a wrapper mirroring its parts' state
                continue
            items = [(str(k), v) for k, v in st.items() if isinstance(v, torch.Tensor)]
            if items:
                out[id(p)] = items
    return out


def _each_optimizer(optimizer: Any) -> list[Any]:
    """The optimizers holding state: ``optimizer`` itself, or the parts of a wrapper that keeps
    one optimizer per model part in ``.optimizers`` (torchtitan's OptimizersContainer is a
    torch.optim.Optimizer whose own state stays empty), or each of a list."""
    if isinstance(optimizer, list | tuple):
        return [o for part in optimizer for o in _each_optimizer(part)]
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, list | tuple) and parts:
        return [*(o for part in parts for o in _each_optimizer(part)), optimizer]
    return [optimizer]
