"""How to read each collective op the recorder knows: its arguments, group, root and reduction.

c10d's ops (what ``torch.distributed`` calls) and the functional collectives (what DTensor calls)
name their arguments differently; a spec per op says which argument holds what, and every overload
of the op is resolved to it once, at import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .. import torch as _torch
from . import caches


@dataclass(frozen=True, slots=True)
class Spec:
    """How to read one collective op's arguments."""

    op: str
    inputs: str | None
    outputs: str | None  # an argument name, or "return"
    root: str | None = None
    reduce: bool = False
    group: str = "process_group"


def _c10d(op: str, inputs: str | None, outputs: str | None, **kw: Any) -> Spec:
    return Spec(op, inputs, outputs, **kw)


def _func(op: str, inputs: str, outputs: str = "return", **kw: Any) -> Spec:
    return Spec(op, inputs, outputs, group="group_name", **kw)


SPECS: dict[str, Spec] = {
    "c10d.allreduce_": _c10d("all_reduce", "tensors", "tensors", reduce=True),
    "c10d.allreduce_coalesced_": _c10d("all_reduce", "tensors", "tensors", reduce=True),
    "c10d.allgather_": _c10d("all_gather", "input_tensors", "output_tensors"),
    "c10d._allgather_base_": _c10d("all_gather", "input_tensor", "output_tensor"),
    "c10d.allgather_into_tensor_coalesced_": _c10d("all_gather", "inputs", "outputs"),
    "c10d.allgather_coalesced_": _c10d("all_gather", "input_list", "output_lists"),
    "c10d.reduce_scatter_": _c10d("reduce_scatter", "input_tensors", "output_tensors", reduce=True),
    "c10d._reduce_scatter_base_": _c10d("reduce_scatter", "input_tensor", "output_tensor", reduce=True),
    "c10d.reduce_scatter_tensor_coalesced_": _c10d("reduce_scatter", "inputs", "outputs", reduce=True),
    "c10d.broadcast_": _c10d("broadcast", "tensors", "tensors", root="root_rank"),
    "c10d.scatter_": _c10d("scatter", "input_tensors", "output_tensors", root="root_rank"),
    "c10d.gather_": _c10d("gather", "input_tensors", "output_tensors", root="root_rank"),
    "c10d.reduce_": _c10d("reduce", "tensors", "tensors", root="root_rank", reduce=True),
    "c10d.alltoall_": _c10d("all_to_all", "input_tensors", "output_tensors"),
    "c10d.alltoall_base_": _c10d("all_to_all", "input", "output"),
    "c10d.barrier": _c10d("barrier", None, None),
    "c10d.monitored_barrier_": _c10d("barrier", None, None),
    "c10d.send": _c10d("send", "tensors", None, root="dst"),
    "c10d.recv_": _c10d("recv", None, "tensors", root="src"),
    "c10d.recv_any_source_": _c10d("recv", None, "tensors"),
    "_c10d_functional.all_reduce": _func("all_reduce", "input", reduce=True),
    "_c10d_functional.all_reduce_": _func("all_reduce", "input", "input", reduce=True),
    "_c10d_functional.all_reduce_coalesced": _func("all_reduce", "inputs", reduce=True),
    "_c10d_functional.all_reduce_coalesced_": _func("all_reduce", "inputs", "inputs", reduce=True),
    "_c10d_functional.all_gather_into_tensor": _func("all_gather", "input"),
    "_c10d_functional.all_gather_into_tensor_out": _func("all_gather", "input", "out"),
    "_c10d_functional.all_gather_into_tensor_coalesced": _func("all_gather", "inputs"),
    "_c10d_functional.reduce_scatter_tensor": _func("reduce_scatter", "input", reduce=True),
    "_c10d_functional.reduce_scatter_tensor_out": _func("reduce_scatter", "input", "out", reduce=True),
    "_c10d_functional.reduce_scatter_tensor_coalesced": _func("reduce_scatter", "inputs", reduce=True),
    "_c10d_functional.all_to_all_single": _func("all_to_all", "input"),
    "_c10d_functional.broadcast": _func("broadcast", "input", root="src"),
    "_c10d_functional.broadcast_": _func("broadcast", "input", "input", root="src"),
    "_dtensor.shard_dim_alltoall": _func("all_to_all", "input"),
}


def _resolve_specs() -> dict[Any, tuple[Spec, str, list[str]]]:
    """Map each collective OpOverload to (spec, impl name, argument names)."""
    out: dict[Any, tuple[Spec, str, list[str]]] = {}
    for name, spec in SPECS.items():
        for overload, ov in _torch.op_overloads(name):
            impl = name if overload == "default" else f"{name}.{overload}"
            out[ov] = (spec, impl, _torch.op_argument_names(ov))
    return out


COLLECTIVES = _resolve_specs()

REDUCE_NAMES = {
    "SUM": "sum",
    "AVG": "avg",
    "PRODUCT": "product",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
    "PREMUL_SUM": "premul_sum",
}


# Ops that only read a tensor's metadata: never a user's computation on its values.
METADATA_OPS = {
    getattr(packet, o)
    for packet in (torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_storage_offset)
    for o in packet.overloads()
}

_NOT_PARAMS = {"async_op", "timeout", "tag", "group_size", "root_tensor", "sparse_indices", "device_ids"}


def params(bound: dict[str, Any], spec: Spec) -> dict[str, Any]:
    """Scalar arguments of a collective that shape its data flow, as JSON values."""
    skip = _not_params(spec)
    out: dict[str, Any] = {}
    for k, v in bound.items():
        if k in skip:
            continue
        if isinstance(v, bool | int | float | str):
            out[k] = v
        elif isinstance(v, list | tuple) and all(isinstance(x, int) for x in v):
            out[k] = [int(x) for x in v]
    return out


@caches.memo(maxsize=None)
def _not_params(spec: Spec) -> frozenset[str | None]:
    return frozenset({spec.inputs, spec.outputs, spec.group, spec.root, "reduce_op", *_NOT_PARAMS})


def reduce_name(op: Any) -> str | None:
    """A reduce op (c10d's enum or the functional ops' string) by its lower-case name."""
    if op is None:
        return None
    if isinstance(op, str):
        return op.lower()
    name = _torch.reduce_op_name(op)
    return REDUCE_NAMES.get(name, name.lower())


_OP_NAMES: dict[Any, str] = {}


def op_name(func: Any) -> str:
    """An op's name as the trace shows it (``aten.mm``); memoised, as every op event asks."""
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = str(func).removesuffix(".default")
    return name
