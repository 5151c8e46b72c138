"""What the simulation does for collectives LocalTensorMode gets wrong, refuses or does slowly.

LocalTensorMode runs each collective over every rank's LocalTensor. A few c10d collectives it
refuses as MPMD (gather), lacks (reduce, a list reduce_scatter) or gets wrong on strided groups
(broadcast with a root other than 0); they are emulated here per group. DTensor's all-gather and
all-reduce end with one value per group, done here once per group (see ``PER_GROUP``). And a
collective given only plain tensors would be skipped by the fake process group: refused here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import ShardvizError
from .. import torch as _torch
from .snapshot import PLAIN, flatten
from .specs import Spec, reduce_name


class PlainTensorCollectiveError(ShardvizError, RuntimeError):
    """A collective under the simulation got only plain tensors: the fake group would skip it."""


# The collectives whose members must pass tensors of one shape and dtype (a list all_gather may
# gather uneven tensors, an all_to_all splits as each rank says, a scatter or gather has a root).
_SAME_SHAPES = ("all_reduce", "reduce_scatter", "broadcast", "reduce")
_SAME_SHAPES_IMPLS = (
    "c10d._allgather_base_",
    "c10d.allgather_into_tensor_coalesced_",
    "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.all_gather_into_tensor_out",
    "_c10d_functional.all_gather_into_tensor_coalesced",
)


def mismatched_shapes(
    spec: Spec, impl: str, inputs: list[Any], groups: tuple[tuple[int, ...], ...]
) -> str | None:
    """What differs between the members of a group (each rank's shapes and dtypes, in words) where
    the collective needs them equal; None when they agree. LocalTensorMode would raise a bare size
    mismatch, or (a broadcast from a smaller tensor, a functional all-gather) give a result no real
    process group gives."""
    if spec.op not in _SAME_SHAPES and impl not in _SAME_SHAPES_IMPLS:
        return None
    if all(_torch.plain_stack(t) is not None for t in inputs):
        return None  # the batched engine's stacks: every rank's tensor has one shape and dtype
    per_rank = [_torch.local_tensors(t) for t in inputs]
    if not per_rank or any(p is None for p in per_rank):
        return None

    def dims(r: int) -> str:
        parts = []
        for p in per_rank:
            t = p[r]  # type: ignore[index]
            parts.append(f"{_torch.dtype_name(t.dtype)}[{', '.join(str(int(s)) for s in t.shape)}]")
        return ", ".join(parts)

    for g in groups:
        members = [r for r in g if all(r in p for p in per_rank)]  # type: ignore[operator]
        seen = {dims(r) for r in members}
        if len(seen) > 1:
            each = "; ".join(f"rank {r}: {dims(r)}" for r in members)
            return (
                f"the ranks of the group {list(g)} passed {spec.op} ({impl}) tensors of different "
                f"shapes or dtypes: {each}"
            )
    return None


def _emulate_gather(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d gather, which LocalTensorMode refuses as MPMD: the root's list receives each member's
    tensor. (In the simulator every rank passes the list: Python cannot branch on the rank.)"""
    outs = bound["output_tensors"][0] if bound["output_tensors"] else []
    inp = bound["input_tensors"][0]
    root = int(bound["root_rank"])
    src = _torch.local_tensors(inp)
    if outs and src is not None:
        with _torch.no_dispatch():
            for g in groups:
                for i, r in enumerate(g):
                    dst = _torch.local_tensors(outs[i])
                    if dst is not None and root < len(g):
                        dst[g[root]].copy_(src[r])
    return _torch.fake_work()


def _emulate_reduce(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d reduce (not in LocalTensorMode): the root's tensor becomes the group's reduction;
    the other ranks' tensors keep their values, as gloo leaves them."""
    t = bound["tensors"][0]
    local = _torch.local_tensors(t)
    root = int(bound["root_rank"])
    name = reduce_name(bound.get("reduce_op")) or "sum"
    if local is not None:
        with _torch.no_dispatch():
            for g in groups:
                if root < len(g):
                    local[g[root]].copy_(_reduce_tensors(name, [local[r] for r in g]))
    return _torch.fake_work()


def _emulate_reduce_scatter(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d reduce_scatter of tensor lists (not in LocalTensorMode): member j receives the
    reduction of every member's j-th input tensor."""
    out = bound["output_tensors"][0]
    ins = bound["input_tensors"][0]
    name = reduce_name(bound.get("reduce_op")) or "sum"
    dst = _torch.local_tensors(out)
    srcs = [s for s in (_torch.local_tensors(t) for t in ins) if s is not None]
    if dst is not None and len(srcs) == len(ins):
        with _torch.no_dispatch():
            for g in groups:
                for j, r in enumerate(g):
                    dst[r].copy_(_reduce_tensors(name, [srcs[j][q] for q in g]))
    return ([out], _torch.fake_work())


def _reduce_tensors(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    stack = torch.stack(tensors)
    if name in ("sum", "avg"):
        r = stack.sum(0)
        return r / len(tensors) if name == "avg" else r
    if name == "product":
        return stack.prod(0)
    if name == "max":
        return stack.amax(0)
    if name == "min":
        return stack.amin(0)
    raise NotImplementedError(f"shardviz cannot simulate reduce op {name!r} for this collective")


def _emulate_broadcast(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d broadcast. LocalTensorMode takes the root for a global offset, so on a strided group
    (a dp group [0, 2] of a (2, 2) mesh) with a root other than 0 it copies the wrong rank; here
    each group copies its own root (``root_rank`` is an index within the group)."""
    tensors = bound["tensors"]
    local = _torch.local_tensors(tensors[0])
    root = int(bound["root_rank"])
    if local is None:  # a plain tensor: the same on every rank, nothing to move
        return (tensors, _torch.fake_work())
    with _torch.no_dispatch():
        for g in groups:
            if root < len(g):
                src = local[g[root]]
                for r in g:
                    if r != g[root]:
                        local[r].copy_(src)
    return (tensors, _torch.fake_work())


# DTensor's functional collectives whose members all end with one value per group, done here
# once per group, as LocalTensorMode does them (same ops, same order, so the same bits): each group's
# value is computed once and each member gets a clone. The value itself is kept for the snapshot,
# which then needs neither a copy nor a compare of the members' outputs; nothing else holds it.
# Each returns None where the case is not a simple one, and LocalTensorMode runs it.


def _plain_local(x: Any) -> dict[int, torch.Tensor] | None:
    local = _torch.local_tensors(x)
    if local is None or not all(type(t) in PLAIN and not t.requires_grad for t in local.values()):
        return None
    return local


def gather_per_group(
    bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]
) -> tuple[Any, dict[int, torch.Tensor]] | None:
    """all_gather_into_tensor (Shard -> Replicate): the group's shards concatenated along dim 0.
    A rank of an incomplete group gets no output, as in LocalTensorMode."""
    size = bound.get("group_size")
    done = _torch.per_group_on_stack("gather", bound.get("input"), groups, size=size)
    if done is not None:
        return done
    local = _plain_local(bound.get("input"))
    if local is None:
        return None
    complete = [g for g in groups if len(g) == size and all(r in local for r in g)]
    if not complete:
        return None
    return _clone_per_member(complete, lambda g: torch.cat([local[r] for r in g]))


def reduce_per_group(
    bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]
) -> tuple[Any, dict[int, torch.Tensor]] | None:
    """all_reduce (Partial -> Replicate): LocalTensorMode's reduction of the group's inputs, in the
    input's dtype, contiguous (the functional op clones its input and reduces into the clone)."""
    op = bound.get("reduce_op")
    if op not in _LOCAL_REDUCE_OPS:
        return None
    done = _torch.per_group_on_stack("reduce", bound.get("input"), groups, op=op)
    if done is not None:
        return done
    local = _plain_local(bound.get("input"))
    if local is None:
        return None
    covered = sorted(r for g in groups for r in g)
    if covered != sorted(local) or not all(len(g) == len(groups[0]) for g in groups):
        return None
    first = next(iter(local.values()))
    if not all(t.shape == first.shape and t.dtype == first.dtype for t in local.values()):
        return None  # ranks of different shapes: LocalTensorMode broadcasts into each

    def reduced(g: tuple[int, ...]) -> torch.Tensor:
        value = torch.empty_like(local[g[0]], memory_format=torch.contiguous_format)
        return value.copy_(_torch.local_reduce(op, [local[r] for r in g]))

    return _clone_per_member(groups, reduced)


def _clone_per_member(
    groups: Sequence[tuple[int, ...]], value_of: Callable[[tuple[int, ...]], torch.Tensor]
) -> tuple[Any, dict[int, torch.Tensor]]:
    """Each group's value computed once, a copy for each member: the members' LocalTensor, and
    the values by the group's first rank (for the snapshot)."""
    values: dict[int, torch.Tensor] = {}
    with _torch.plain_ops():
        for g in groups:
            values[g[0]] = value_of(g)
    return _torch.local_of_copies({r: values[g[0]] for g in groups for r in g}), values


_LOCAL_REDUCE_OPS = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor"}
PER_GROUP = {
    "_c10d_functional.all_gather_into_tensor": gather_per_group,
    "_c10d_functional.all_reduce": reduce_per_group,
}


def _premul_sum(factor: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor times the factor, then summed in rank order, as torch >= 2.14 simulates it."""
    out = tensors[0] * factor
    for t in tensors[1:]:
        out = out + t * factor
    return out


def _emulate_premul_reduce_scatter(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d reduce_scatter_tensor with ReduceOp.PREMUL_SUM (FSDP2 with a gradient divide factor),
    which LocalTensorMode lacks on torch 2.13: member j receives chunk j of the scaled sum."""
    out, inp = bound["output_tensor"], bound["input_tensor"]
    factor = _torch.premul_factor(bound["reduce_op"])
    dst, src = _torch.local_tensors(out), _torch.local_tensors(inp)
    if dst is None or src is None:
        raise NotImplementedError("shardviz simulates PREMUL_SUM on per-rank tensors only")
    with _torch.no_dispatch():
        for g in groups:
            total = _premul_sum(factor, [src[r] for r in g])
            for j, r in enumerate(g):
                dst[r].copy_(total.chunk(len(g))[j].view_as(dst[r]))
    return (out, _torch.fake_work())


def _emulate_premul_all_reduce(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d all_reduce with ReduceOp.PREMUL_SUM (HSDP's replicate-dim gradient reduction)."""
    tensors = bound["tensors"]
    factor = _torch.premul_factor(bound["reduce_op"])
    local = _torch.local_tensors(tensors[0])
    if local is None:
        raise NotImplementedError("shardviz simulates PREMUL_SUM on per-rank tensors only")
    with _torch.no_dispatch():
        for g in groups:
            total = _premul_sum(factor, [local[r] for r in g])
            for r in g:
                local[r].copy_(total)
    return (tensors, _torch.fake_work())


# ReduceOp.PREMUL_SUM, by collective: LocalTensorMode on torch 2.13 raises "PREMUL_SUM: need to
# add binding for scaling factor"; done here on every torch, so that the bits do not depend on it.
PREMUL_SUM = {
    "c10d._reduce_scatter_base_": _emulate_premul_reduce_scatter,
    "c10d.allreduce_": _emulate_premul_all_reduce,
}


def emulator(
    impl: str, bound: dict[str, Any]
) -> Callable[[dict[str, Any], tuple[tuple[int, ...], ...]], Any] | None:
    """How the simulation runs this collective itself, or None where LocalTensorMode runs it."""
    op = bound.get("reduce_op")
    if op is not None and not isinstance(op, str) and reduce_name(op) == "premul_sum":
        found = PREMUL_SUM.get(impl)
        if found is None:
            raise NotImplementedError(
                f"shardviz simulates ReduceOp.PREMUL_SUM in dist.reduce_scatter_tensor and "
                f"dist.all_reduce only, not in {impl}; use ReduceOp.SUM and scale the result, or run "
                "on real process groups: sv.use('gloo', world_size=N)"
            )
        return found
    return EMULATED.get(impl)


EMULATED = {
    "c10d.broadcast_": _emulate_broadcast,
    "c10d.gather_": _emulate_gather,
    "c10d.reduce_": _emulate_reduce,
    "c10d.reduce_scatter_": _emulate_reduce_scatter,
}


def has_plain(x: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and not _torch.is_local_tensor(t) for t in flatten(x))


def lift(x: Any, ranks: Sequence[int]) -> Any:
    """Plain tensors in (nested lists of) inputs, as LocalTensors holding them on every rank."""
    if isinstance(x, list | tuple):
        return type(x)(lift(v, ranks) for v in x)
    if isinstance(x, torch.Tensor) and not _torch.is_local_tensor(x):
        with _torch.no_dispatch():
            return _torch.new_local_tensor({r: x.detach().clone() for r in ranks})
    return x


def plain_is_fine(spec: Spec, bound: dict[str, Any]) -> bool:
    """Collectives whose result on identical plain tensors is the input itself: the fake group's
    no-op is then right (DTensor's Replicate path broadcasts a plain tensor, for instance)."""
    if spec.op in ("broadcast", "barrier"):
        return True
    if spec.op == "all_reduce":
        return reduce_name(bound.get("reduce_op")) in ("max", "min", "avg", "band", "bor")
    return False


def plain_tensor_error(op: str, impl: str) -> PlainTensorCollectiveError:
    strided = _torch.strided_shard_scatter_on_stack(sys._getframe(2))
    msg = (
        f"{op} ({impl}) got only plain tensors under the simulation. LocalTensorMode hands such a "
        "collective to the fake process group, which does nothing, so its result would silently be "
        "wrong. Make the tensors inside sv.record() / %%spmd (tensors made there hold one value per "
        "rank), or give each rank its own: sv.per_rank(lambda rank: tensor.clone())."
    )
    if strided:
        msg = (
            "distribute_tensor with a _StridedShard placement scatters a replicated plain tensor "
            "under the simulation; LocalTensorMode (torch 2.13 to 2.15) then skips the scatter and "
            "every rank would get the wrong chunk. Pass src_data_rank=None to distribute_tensor (each "
            "rank slices the global tensor itself). Details: " + msg
        )
    return PlainTensorCollectiveError(msg)
