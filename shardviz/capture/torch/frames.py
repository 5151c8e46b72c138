"""Torch's own frames: its files, and what its functions hold in their locals.

The recorder finds the user's line by skipping torch's frames, and reads a few things DTensor
keeps only in its frames' locals (a redistribute's specs, the mesh being dispatched on). Which
files and names these are is torch's internal layout: it is known here only."""

from __future__ import annotations

import os
from types import FrameType
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# DTensor's operator dispatch: a frame of it on the stack means an op is being sharded.
DTENSOR_DISPATCH_FILE = os.path.join(TORCH_DIR, "distributed", "tensor", "_dispatch.py")
# Files a dispatched op passes through between its caller and a dispatch mode.
DISPATCH_PLUMBING = tuple(
    os.path.join(TORCH_DIR, *f.split("/"))
    for f in (
        "_ops.py",
        "_compile.py",
        "overrides.py",
        "_tensor.py",
        "functional.py",
        "utils/_python_dispatch.py",
        "_dynamo/eval_frame.py",
    )
)
# Frames a traceback shown to the user can leave out: layers between a call and its error that
# the user neither wrote nor can act on.
TRACEBACK_PLUMBING = tuple(
    os.path.join(TORCH_DIR, f)
    for f in ("_compile.py", "_dynamo", "distributed/c10d_logger.py", "utils/_python_dispatch.py", "_ops.py")
)


def may_hold_mesh(code: Any) -> bool:
    """Whether a torch function's frame can hold a DeviceMesh (``distribute_tensor``'s
    ``device_mesh``, a redistribute's ``mesh``)."""
    return "device_mesh" in code.co_varnames or "mesh" in code.co_varnames


def frame_mesh(frame: FrameType) -> Any:
    """The DeviceMesh a torch frame holds, or None (``f_locals`` builds a dict: ask sparingly)."""
    f_locals = frame.f_locals
    for key in ("device_mesh", "mesh"):
        m = f_locals.get(key)
        if isinstance(m, DeviceMesh):
            return m
    return None


def redistribute_specs(frame: FrameType) -> tuple[Any, Any]:
    """The (current, target) DTensorSpecs in the frame of DTensor's redistribute, which reports
    only placements to a DebugMode."""
    f_locals = frame.f_locals  # builds a dict: read it once
    return f_locals.get("current_spec"), f_locals.get("target_spec")


def strided_shard_scatter_on_stack(frame: FrameType | None) -> bool:
    """Whether ``distribute_tensor`` is scattering a ``_StridedShard`` placement up the stack."""
    while frame is not None:
        if (
            frame.f_code.co_name == "_shard_tensor"
            and type(frame.f_locals.get("self")).__name__ == "_StridedShard"
        ):
            return True
        frame = frame.f_back
    return False


# The c10d Python API between a user's ``dist.*`` call and the op a dispatch mode sees: a call
# that passes only these (and dispatch plumbing) on its way from user code is a raw ``dist.*`` call.
C10D_API_FILES = tuple(
    os.path.join(TORCH_DIR, "distributed", f) for f in ("distributed_c10d.py", "c10d_logger.py")
)
