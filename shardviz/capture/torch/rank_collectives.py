"""Collectives over the rank dim of stacked LocalTensors: gathers, reductions and reshapes.

Each does what LocalTensorMode does rank by rank (torch's ``_local_tensor._c10d``), on the stack
at once: a group's members are rows of the stack, a reduction combines them left to right in
group order with the same operator (``_local_reduce``), so every element gets the same bits, and
each rank's result is the same slice LocalTensorMode hands it, contiguous as its clone is. Where
the case is not a plain one (an input held per rank, uneven chunks, groups that leave a rank out)
they return ``FALLBACK`` and LocalTensorMode's own implementation runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .stacked import plain_stack, stack_of, wrap

_lt_c10d = importlib.import_module("torch.distributed._local_tensor._c10d")
_DisableTorchDispatch = torch._C._DisableTorchDispatch
FALLBACK = object()


class GroupTable:
    """Every group that runs a collective at once, as index tensors over the rank dim."""

    __slots__ = ("group_of", "index_in", "members", "size")

    def __init__(self, groups: list[list[int]], world: int) -> None:
        self.members = torch.tensor(groups, dtype=torch.long)  # [G, S]
        self.size = len(groups[0])
        group_of = [0] * world
        index_in = [0] * world
        for gi, g in enumerate(groups):
            for i, r in enumerate(g):
                group_of[r], index_in[r] = gi, i
        self.group_of = torch.tensor(group_of, dtype=torch.long)  # [R]
        self.index_in = torch.tensor(index_in, dtype=torch.long)  # [R]


_tables: dict[tuple[Any, ...], GroupTable | None] = {}


def table_for(groups: Any, world: int) -> GroupTable | None:
    """The table of these groups (tuples of global ranks), when they cover every rank once."""
    key = ("groups", tuple(tuple(g) for g in groups), world)
    hit = _tables.get(key, FALLBACK)
    if hit is not FALLBACK:
        return hit  # type: ignore[return-value]
    listed = [list(g) for g in groups]
    flat = sorted(r for g in listed for r in g)
    found = (
        GroupTable(listed, world)
        if listed and flat == list(range(world)) and len({len(g) for g in listed}) == 1
        else None
    )
    if len(_tables) < 1024:
        _tables[key] = found
    return found


def table_of(group: Any, world: int) -> GroupTable | None:
    """The table of every group that runs a collective at once with ``group`` (a process group,
    boxed or by name), as LocalTensorMode finds them."""
    pg = _lt_c10d._resolve_pg_or_name(group)
    if isinstance(pg, torch.ScriptObject):
        pg = dist.ProcessGroup.unbox(pg)
    key = (str(pg.group_name), id(dist.distributed_c10d._get_default_group()), world)
    hit = _tables.get(key, FALLBACK)
    if hit is not FALLBACK:
        return hit  # type: ignore[return-value]
    # (ranks from the group's first, the groups' first ranks) on every torch; 2.13 adds the offset
    prepared = _lt_c10d._prepare_collective_groups(pg)
    ranks, offsets = prepared[0], prepared[1]
    found = table_for([[o + r for r in ranks] for o in offsets], world)
    if len(_tables) < 1024:
        _tables[key] = found
    return found


def reduce_groups(op: Any, stk: torch.Tensor, table: GroupTable) -> torch.Tensor:
    """Each group's reduction ``[G, ...]``, its members combined left to right in group order as
    LocalTensorMode combines them (``_local_reduce``, looked up when called: the simulation may
    have given it PREMUL_SUM)."""
    parts = [stk[table.members[:, s]] for s in range(table.size)]
    return _lt_c10d._local_reduce(op, parts)


def gather_groups(stk: torch.Tensor, table: GroupTable) -> torch.Tensor:
    """Each group's members concatenated along dim 0, ``[G, S * d0, ...]``."""
    g = stk[table.members]  # [G, S, d0, ...]
    return g.reshape(g.shape[0], g.shape[1] * g.shape[2], *g.shape[3:])


def to_ranks(values: torch.Tensor, table: GroupTable) -> torch.Tensor:
    """Each rank's copy of its group's value, ``[R, ...]``."""
    return values[table.group_of]


def chunk_to_ranks(values: torch.Tensor, table: GroupTable) -> torch.Tensor | None:
    """Member i of each group gets chunk i (along dim 0) of its group's value; None when the
    chunks would be uneven."""
    d0 = values.shape[1] if values.dim() > 1 else 0
    if d0 == 0 or d0 % table.size:
        return None
    chunks = values.reshape(values.shape[0], table.size, d0 // table.size, *values.shape[2:])
    return chunks[table.group_of, table.index_in]


def per_group_on_stack(
    kind: str, t: Any, groups: Any, op: str | None = None, size: int | None = None
) -> tuple[Any, dict[int, torch.Tensor]] | None:
    """The recorder's all-gather (``kind="gather"``, groups of ``size``) or all-reduce
    (``"reduce"`` with ``op``) of a stacked LocalTensor over groups tiling every rank: each
    group's value once, ``[G, ...]``, in one op for all groups; each rank's copy of it in one
    more. Returns the ranks' LocalTensor and the values by each group's first rank (the
    recorder's own, for its snapshots), or None where the per-group code must run (a tensor held
    per rank or requiring grad, groups leaving a rank out, a 0-d gather)."""
    stk = plain_stack(t)
    if stk is None or stk.requires_grad:
        return None
    table = table_for(groups, stk.shape[0])
    if table is None or (kind == "gather" and (stk.dim() < 2 or table.size != size)):
        return None
    with _DisableTorchDispatch():
        if kind == "gather":
            values = gather_groups(stk, table)
        else:
            # in the input's dtype, contiguous, as the per-group code copies it
            values = torch.empty((table.members.shape[0], *stk.shape[1:]), dtype=stk.dtype, device=stk.device)
            values.copy_(reduce_groups(op, stk, table))
        out = wrap(to_ranks(values, table))
    return out, {int(g[0]): values[i] for i, g in enumerate(table.members.tolist())}


def _input(t: Any, group: Any, need_dim: bool = True) -> tuple[torch.Tensor, GroupTable] | None:
    stk = stack_of(t)
    if stk is None or (need_dim and stk.dim() < 2):
        return None
    table = table_of(group, stk.shape[0])
    if table is None:
        return None
    return stk, table


# --- functional collectives (DTensor's) ----------------------------------------------------------


def all_gather_into_tensor(input: Any, group_size: int, group_name: Any) -> Any:
    found = _input(input, group_name)
    if found is None or found[1].size != group_size:
        return FALLBACK
    stk, table = found
    with _DisableTorchDispatch():
        out = to_ranks(gather_groups(stk, table), table)
    return wrap(out)


def reduce_scatter_tensor(input: Any, reduce_op: str, group_size: int, group_name: Any) -> Any:
    found = _input(input, group_name)
    if found is None or found[1].size != group_size:
        return FALLBACK
    stk, table = found
    with _DisableTorchDispatch():
        out = chunk_to_ranks(reduce_groups(reduce_op, stk, table), table)
    return FALLBACK if out is None else wrap(out)


def all_reduce(input: Any, reduce_op: str, group_name: Any) -> Any:
    found = _input(input, group_name, need_dim=False)
    if found is None:
        return FALLBACK
    stk, table = found
    with _DisableTorchDispatch():
        out = to_ranks(reduce_groups(reduce_op, stk, table), table).contiguous()
    return wrap(out)


def shard_dim_alltoall(input: Any, gather_dim: int, shard_dim: int, group_name: Any) -> Any:
    found = _input(input, group_name)
    if found is None:
        return FALLBACK
    stk, table = found
    nd = stk.dim() - 1
    gd, sd = gather_dim % nd, shard_dim % nd
    with _DisableTorchDispatch():
        members = stk[table.members]  # [G, S, ...]
        cat = members.movedim(1, 1 + gd)
        cat = cat.reshape(*cat.shape[: 1 + gd], cat.shape[1 + gd] * cat.shape[2 + gd], *cat.shape[3 + gd :])
        size = cat.shape[1 + sd]
        if size == 0 or size % table.size:
            return FALLBACK
        split = cat.unflatten(1 + sd, (table.size, size // table.size)).movedim(1 + sd, 1)
        out = split[table.group_of, table.index_in]
    return wrap(out)


def all_to_all_single(input: Any, output_split_sizes: Any, input_split_sizes: Any, group_name: Any) -> Any:
    found = _input(input, group_name)
    if found is None:
        return FALLBACK
    stk, table = found
    s = table.size
    d0 = stk.shape[1]
    if d0 % s:
        return FALLBACK
    c = d0 // s
    for sizes in (output_split_sizes, input_split_sizes):
        if sizes and any(type(x) is not int or x != c for x in sizes):
            return FALLBACK  # uneven or per-rank split sizes: rank by rank
    with _DisableTorchDispatch():
        members = stk[table.members]  # [G, S_src, d0, ...]
        blocks = members.reshape(members.shape[0], s, s, c, *stk.shape[2:]).transpose(
            1, 2
        )  # [G, dst, src, c]
        per_dst = blocks.reshape(members.shape[0], s, s * c, *stk.shape[2:])
        out = per_dst[table.group_of, table.index_in]
    return wrap(out)


def wait_tensor(tensor: Any) -> Any:
    return tensor if stack_of(tensor) is not None else FALLBACK


# --- c10d's in-place collectives (torch.distributed's) ---------------------------------------------


def _work() -> Any:
    from torch._C._distributed_c10d import FakeWork

    return dist.distributed_c10d.Work.boxed(FakeWork())


_PREMUL_SUM = int(dist.ReduceOp.PREMUL_SUM)  # type: ignore[call-overload]


def _reduce_kind(reduce_op: Any) -> Any:
    """A boxed ReduceOp's kind; FALLBACK for PREMUL_SUM, whose factor LocalTensorMode's own path
    reads (torch 2.15 takes it from the ReduceOp, shardviz's patch from the call on 2.13)."""
    kind = reduce_op.op()
    return FALLBACK if int(kind) == _PREMUL_SUM else kind


def allreduce_(tensors: list[Any], process_group: Any, reduce_op: Any, *rest: Any, **kw: Any) -> Any:
    if len(tensors) != 1:
        return FALLBACK
    kind = _reduce_kind(reduce_op)
    if kind is FALLBACK:
        return FALLBACK
    found = _input(tensors[0], process_group, need_dim=False)
    if found is None:
        return FALLBACK
    stk, table = found
    with _DisableTorchDispatch():
        reduced = reduce_groups(kind, stk, table)
        stk.copy_(to_ranks(reduced, table))
    return (tensors, _work())


def allgather_base_(output_tensor: Any, input_tensor: Any, process_group: Any, *rest: Any, **kw: Any) -> Any:
    found = _input(input_tensor, process_group)
    out = stack_of(output_tensor)
    if found is None or out is None:
        return FALLBACK
    stk, table = found
    with _DisableTorchDispatch():
        gathered = gather_groups(stk, table)
        if out.shape[1:] != gathered.shape[1:]:
            return FALLBACK
        out.copy_(to_ranks(gathered, table))
    return (output_tensor, _work())


def reduce_scatter_base_(
    output_tensor: Any, input_tensor: Any, process_group: Any, reduce_op: Any, *rest: Any, **kw: Any
) -> Any:
    kind = _reduce_kind(reduce_op)
    found = _input(input_tensor, process_group) if kind is not FALLBACK else None
    out = stack_of(output_tensor)
    if found is None or out is None:
        return FALLBACK
    stk, table = found
    with _DisableTorchDispatch():
        chunks = chunk_to_ranks(reduce_groups(kind, stk, table), table)
        if chunks is None or chunks.shape[1:] != out.shape[1:]:
            return FALLBACK
        out.copy_(chunks)
    return (output_tensor, _work())


_F = torch.ops._c10d_functional
IMPLS: dict[Any, Callable[..., Any]] = {
    _F.all_gather_into_tensor.default: all_gather_into_tensor,
    _F.reduce_scatter_tensor.default: reduce_scatter_tensor,
    _F.all_reduce.default: all_reduce,
    _F.all_to_all_single.default: all_to_all_single,
    _F.wait_tensor.default: wait_tensor,
    torch.ops._dtensor.shard_dim_alltoall.default: shard_dim_alltoall,
    torch.ops.c10d.allreduce_.default: allreduce_,
    torch.ops.c10d._allgather_base_.default: allgather_base_,
    torch.ops.c10d._reduce_scatter_base_.default: reduce_scatter_base_,
}


def run(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The collective done over the rank dim, or ``FALLBACK``."""
    impl = IMPLS.get(func)
    if impl is None:
        return FALLBACK
    return impl(*args, **kwargs)
