"""FSDP2 in the simulation: its storage resizes and shard cuts made per simulated rank while
the simulation runs, and the frames that tell FSDP's own communication apart."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ...errors import BackendError
from .frames import TORCH_DIR
from .gate import LocalTensor
from .modes import active_local_mode
from .per_rank import symint_at_rank

# FSDP2 (fully_shard) fails under LocalTensorMode for two reasons, the same on torch 2.13 to 2.15:
# 1. It frees and re-allocates the all-gather output behind each unsharded parameter with
#    ``untyped_storage().resize_()``. A LocalTensor is a wrapper whose storage has no data, which
#    torch calls "an invalid python storage" and refuses to resize; each rank's tensor can be.
# 2. It cuts each parameter with ``chunks[shard_process_group.rank()]``: on the fake process group
#    that is 0 for every simulated rank, so every rank would silently hold shard 0. Each rank's
#    shard is rewritten with the chunk at its own coordinate on the shard mesh dim.
_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"
_FSDP_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_FSDP_STATE = "torch.distributed.fsdp._fully_shard._fsdp_state"


# The source file of FSDP2's parameter groups: a frame of it on the stack means FSDP itself issues
# what is running (an all-gather, a reduce-scatter), from hooks of other modules (the next layer's
# pre-backward re-gathers this one) or from the autograd engine's callbacks.
FSDP_GROUP_FILE = os.path.join(TORCH_DIR, *_FSDP_GROUP.split(".")[1:]) + ".py"


# The methods of an FSDP2 parameter group that run for the backward: what they issue is backward
# communication even where no autograd engine runs them (a pipeline schedule calls post_backward
# itself after its last microbatch).
FSDP_BACKWARD_METHODS = frozenset(
    {"pre_backward", "post_backward", "finalize_backward", "_backward_prefetch"}
)


def fsdp_owner(frame: FrameType) -> Any:
    """The module whose FSDP parameter group runs ``frame`` (a frame of ``FSDP_GROUP_FILE``), or
    None (a function there that is no method of a group)."""
    modules = getattr(frame.f_locals.get("self"), "modules", None)
    return modules[0] if modules else None


# Called as ``listener(rank, tensor)`` after FSDP2 resizes a storage in place in the simulation
# (``rank`` None for a plain tensor): a resize is no operator, so the recorder cannot see it.
STORAGE_RESIZE_LISTENERS: list[Callable[[int | None, torch.Tensor], None]] = []


def _per_rank_storage(original: Any, kind: str) -> Any:
    """FSDP2's ``alloc_storage`` / ``free_storage`` (``kind``) for each simulated rank's tensor.
    Ranks whose tensors are slices of one storage (the batched engine's stacks) have it resized
    once: freed, or grown to what all of them need (as each rank's own storage would be)."""

    @functools.wraps(original)
    def resize(tensor: torch.Tensor) -> None:
        if not isinstance(tensor, LocalTensor):
            original(tensor)
            for listener in STORAGE_RESIZE_LISTENERS:
                listener(None, tensor)
            return
        per_rank = dict(tensor._local_tensors)  # the ranks' views, made while the memory is there
        shared: dict[int, list[torch.Tensor]] = {}
        for t in per_rank.values():
            shared.setdefault(t.untyped_storage()._cdata, []).append(t)
        for views in shared.values():
            if len(views) == 1:
                original(views[0])
                continue
            storage = views[0].untyped_storage()
            needed = (
                0 if kind == "free" else max((t.storage_offset() + t.numel()) * t.itemsize for t in views)
            )
            if storage.size() != needed:
                storage.resize_(int(needed))
        for r, t in per_rank.items():
            for listener in STORAGE_RESIZE_LISTENERS:
                listener(r, t)

    return resize


def _per_rank_shards(original: Any) -> Any:
    @functools.wraps(original)
    def init_sharded_param(self: Any, param: Any, *args: Any, **kwargs: Any) -> None:
        mode = active_local_mode()
        local = param._local_tensor if isinstance(param, DTensor) else param
        if mode is not None and not isinstance(local, LocalTensor) and not local.is_meta:
            # Made outside the simulation: one tensor that every rank starts from.
            data = LocalTensor({r: local.detach() for r in sorted(mode.ranks)})
            if isinstance(param, DTensor):
                data = DTensor.from_local(
                    data, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
            param = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        original(self, param, *args, **kwargs)
        shards = self._sharded_param_data
        info = self.mesh_info
        if mode is None or not isinstance(shards, LocalTensor) or not hasattr(info, "shard_mesh_dim"):
            return  # not simulated, or nothing sharded (replicate-only)
        coord = info.mesh.get_local_rank(info.shard_mesh_dim)  # per rank, as the mode patches it
        full = param._local_tensor if isinstance(param, DTensor) else param
        dim, size = self.fsdp_placement.dim, info.shard_mesh_size
        with mode.disable(), torch.no_grad():
            for r, buf in shards._local_tensors.items():
                src = full._local_tensors[r] if isinstance(full, LocalTensor) else full
                chunks = torch.chunk(src.detach(), size, dim=dim)
                c = symint_at_rank(coord, r)
                # Written at the front of the zero-padded buffer, as FSDP pads a short shard.
                padded = buf.view(self.padded_sharded_param_size)
                padded.zero_()
                if c < len(chunks) and chunks[c].numel():
                    padded.narrow(dim, 0, chunks[c].size(dim)).copy_(chunks[c])

    return init_sharded_param


def _refused_outside(original: Any) -> Any:
    """``original`` for plain tensors; for a simulated rank's storage outside the simulation, an
    explained error instead of a resize torch cannot do (which left the all-gather writing into
    freed memory: a segmentation fault)."""

    @functools.wraps(original)
    def resize(tensor: torch.Tensor) -> None:
        if isinstance(tensor, LocalTensor):
            raise BackendError(_OUTSIDE)
        original(tensor)

    resize.__shardviz_original__ = original  # type: ignore[attr-defined]
    return resize


_OUTSIDE = (
    "shardviz: this FSDP2 module was sharded inside the simulation (sv.record, a %%spmd cell or "
    "sv.run), so its parameters hold every simulated rank's shard, and it is running outside it, "
    "where nothing gathers them rank by rank. Run it inside the simulation: `with sv.record(): out "
    "= model(x)`, a %%spmd cell, or sv.run(fn)."
)


def _refused_pre_forward(original: Any) -> Any:
    """FSDP2's forward pre-hook, refusing a module whose shards are simulated ranks' when no
    simulation runs, before FSDP changes any of its state (a later call inside the simulation
    then computes as if the refused call never happened). FSDP binds the hook when ``fully_shard``
    runs, so modules sharded inside the simulation keep this check."""

    @functools.wraps(original)
    def pre_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _depth == 0 and any(
            isinstance(getattr(p, "_sharded_param_data", None), LocalTensor)
            for group in _param_groups(self)
            for p in getattr(group, "fsdp_params", ())
        ):
            raise BackendError(_OUTSIDE)
        return original(self, *args, **kwargs)

    # torch's own hook is never traced by Dynamo (compiled blocks under FSDP2); nor is this check.
    return torch.compiler.disable(pre_forward)


def _param_groups(state: Any) -> list[Any]:
    """An FSDP2 state's parameter groups: a list from torch 2.13 (``_fsdp_param_groups``), one
    group or None before (``_fsdp_param_group``)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    one = getattr(state, "_fsdp_param_group", None)
    return [one] if one is not None else []


def _original(f: Any) -> Any:
    return getattr(f, "__shardviz_original__", f)


# How many simulations run FSDP2 per rank now: runner threads and nested recordings enter too. The
# per-rank functions are installed by the first to enter and taken out by the last to leave.
_depth = 0
_depth_lock = threading.Lock()
# torch's own functions while the per-rank ones stand in for them.
_torch_own: dict[str, Any] = {}


@contextlib.contextmanager
def fsdp_in_simulation() -> Iterator[None]:
    """FSDP2 made to run per simulated rank while the simulation runs (see above). Outside it,
    torch's own functions run for plain tensors, so real process groups never see the change; a
    simulated rank's storage or module is refused with an explanation."""
    global _depth
    # Checked here rather than at import: a torch that moved FSDP2's internals loses FSDP2 in the
    # simulation (its error is then explained), not shardviz.
    try:
        # Any: their module globals are patched below, which ModuleType's stubs do not allow.
        fp: Any = importlib.import_module(_FSDP_PARAM)
        fpg: Any = importlib.import_module(_FSDP_GROUP)
        state: Any = importlib.import_module(_FSDP_STATE).FSDPState
        own = {
            "alloc": _original(fp.alloc_storage),
            "free": _original(fp.free_storage),
            "init": fp.FSDPParam.__dict__["_init_sharded_param"],
            "pre_forward": state.__dict__["_pre_forward"],
        }
        fpg.alloc_storage  # noqa: B018 (an AttributeError when a torch moved it)
    except (ImportError, AttributeError, KeyError):
        yield
        return
    with _depth_lock:
        if _depth == 0:
            _torch_own.update(own)
            fp.alloc_storage = fpg.alloc_storage = _per_rank_storage(own["alloc"], "alloc")
            fp.free_storage = _per_rank_storage(own["free"], "free")
            fp.FSDPParam._init_sharded_param = _per_rank_shards(own["init"])
            state._pre_forward = _refused_pre_forward(own["pre_forward"])
        _depth += 1
    try:
        yield
    finally:
        with _depth_lock:
            _depth -= 1
            if _depth == 0:
                fp.alloc_storage = fpg.alloc_storage = _refused_outside(_torch_own["alloc"])
                fp.free_storage = _refused_outside(_torch_own["free"])
                fp.FSDPParam._init_sharded_param = _torch_own["init"]
                state._pre_forward = _torch_own["pre_forward"]
