"""FSDP2 in the simulation: its storage resizes and shard cuts made per simulated rank while
the simulation runs, and the frames that tell FSDP's own communication apart."""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import torch
from torch.distributed.tensor import DTensor

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


def _per_rank_storage(original: Any) -> Any:
    @functools.wraps(original)
    def resize(tensor: torch.Tensor) -> None:
        per_rank = tensor._local_tensors if isinstance(tensor, LocalTensor) else {None: tensor}
        for r, t in per_rank.items():
            original(t)
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


@contextlib.contextmanager
def fsdp_in_simulation() -> Iterator[None]:
    """FSDP2 made to run per simulated rank while the simulation runs (see above); torch's own
    functions are back in place outside it, so real process groups never see the change."""
    # Checked here rather than at import: a torch that moved FSDP2's internals loses FSDP2 in the
    # simulation (its error is then explained), not shardviz.
    try:
        # Any: their module globals are patched below, which ModuleType's stubs do not allow.
        fp: Any = importlib.import_module(_FSDP_PARAM)
        fpg: Any = importlib.import_module(_FSDP_GROUP)
        init = fp.FSDPParam.__dict__["_init_sharded_param"]
        saved = (fp.alloc_storage, fp.free_storage, fpg.alloc_storage, init)
    except (ImportError, AttributeError, KeyError):
        yield
        return
    fp.alloc_storage = fpg.alloc_storage = _per_rank_storage(saved[0])
    fp.free_storage = _per_rank_storage(saved[1])
    fp.FSDPParam._init_sharded_param = _per_rank_shards(saved[3])
    try:
        yield
    finally:
        fp.alloc_storage, fp.free_storage, fpg.alloc_storage = saved[:3]
        fp.FSDPParam._init_sharded_param = saved[3]
