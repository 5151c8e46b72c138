"""Tensor internals: the per-rank tensors behind a LocalTensor or a DTensor, their storage
and version counters, and per-rank copies where the simulation would otherwise share one."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .gate import LocalTensor, _private
from .modes import active_local_mode, is_batched, no_dispatch, plain_ops


def forget_dtensor_caches() -> None:
    """Forget DTensor's sharding caches when a new world (process group) begins.

    DTensor caches sharding propagation (in C++ and Python) and redistribute planners by specs
    whose DeviceMesh compares by value, and the cached output specs hold the mesh they were made
    on. After ``sv.use`` tears a simulated world down and builds another, an equal mesh of the new
    world hits those entries and gets the old mesh back, whose group names now stand for other
    groups of the new world: collectives then ran over the wrong ranks (a Llama's sequence
    all-gathered over 2 ranks instead of 4, or a failed unpad check).
    """
    from torch.distributed.tensor import _redistribute

    clears = (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ fast path's
        getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
    )
    for clear in clears:
        if clear is not None:
            clear()


def own_copies(dt: DTensor, ranks: Sequence[int]) -> bool:
    """Give each simulated rank its own copy of a DTensor's local tensor when all ranks share one
    plain tensor, before an op writes it; True when it did.

    DTensor keeps the tensor it replicates or wraps (``distribute_tensor``'s Replicate path,
    ``DTensor.from_local``), so under LocalTensorMode a plain tensor made outside the simulation —
    a module's bias, a norm weight — became the local tensor of every rank at once: one storage.
    An in-place update with per-rank values (an optimizer step on a RowwiseParallel bias or a
    SequenceParallel norm weight) then ran once per rank on that storage and applied the update
    world-size times. Real ranks each hold their own copy; after this, so does each simulated rank.
    """
    local = dt._local_tensor
    if type(local) is not torch.Tensor or local.is_meta:
        return False
    dt._local_tensor = replicated_local(local, ranks)
    return True


def parameters_per_rank(module: torch.nn.Module) -> list[str]:
    """In the simulation, give each simulated rank its own copy of every plain parameter and
    buffer of ``module`` (those no parallel style made a DTensor), as each real rank has; returns
    their names. A plain tensor is one storage all simulated ranks share: once the ranks' values
    part (gradients that differ, an update on one rank), it cannot hold what each rank would.
    Tied parameters stay tied."""
    mode = active_local_mode()
    if mode is None:
        return []
    ranks = sorted(mode.ranks)
    done: dict[int, torch.Tensor] = {}
    names = []
    for prefix, mod in module.named_modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta:
                    continue
                new = done.get(id(t))
                if new is None:
                    local = replicated_local(t, ranks)
                    new = (
                        torch.nn.Parameter(local, requires_grad=t.requires_grad)
                        if table is mod._parameters
                        else local
                    )
                    _carry_over(t, new)
                    done[id(t)] = new
                table[name] = new
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def _carry_over(old: torch.Tensor, new: torch.Tensor) -> None:
    """What the code put on a tensor that its per-rank copy must keep: its gradient hooks (a
    hand-written data parallel all-reduces gradients in them; they were silently lost) and its
    Python attributes (flags such as Megatron's ``sequence_parallel``)."""
    for k, v in old.__dict__.items():
        if k not in new.__dict__ and not k.startswith("_sym_"):
            new.__dict__[k] = v
    if old._backward_hooks:
        new._backward_hooks = old._backward_hooks
    if getattr(old, "_post_accumulate_grad_hooks", None):
        new._post_accumulate_grad_hooks = old._post_accumulate_grad_hooks


def version_counter(t: torch.Tensor) -> int:
    """``t``'s version counter (``Tensor._version``): every in-place write to its storage, through
    ``t`` or a view sharing its counter, bumps it; a write past dispatch (numpy) does too."""
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``), or None when ``t`` is no view."""
    return t._base


def plain_tensors(x: object) -> list[torch.Tensor]:
    """The plain tensors that hold ``x``'s data: a DTensor's local shard(s), a LocalTensor's
    per-rank tensors, or ``x`` itself."""
    return list(rank_tensors(x).values()) if isinstance(x, torch.Tensor) else []


def rank_tensors(t: torch.Tensor) -> Mapping[int | None, torch.Tensor]:
    """The plain tensors behind ``t`` by rank, not copied (read them only): a LocalTensor's, a
    DTensor's local shard's, or ``{None: t}`` for a plain tensor, which every rank holds."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, LocalTensor):
        return t._local_tensors
    return {None: t}


def storage_users(t: torch.Tensor) -> int:
    """How many holders share ``t``'s storage (tensors, views, numpy arrays over it)."""
    return int(_private["storage_use_count"](t.untyped_storage()._cdata))


def tensor_users(t: torch.Tensor) -> int:
    """How many C++ owners ``t``'s TensorImpl has (a ``.grad`` slot, autograd's saved tensors)."""
    return int(t._use_count())  # type: ignore[attr-defined]  # TensorBase._use_count: in C, not in the stubs


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def new_local_tensor(per_rank: dict[int, torch.Tensor]) -> Any:
    """A LocalTensor holding ``per_rank[r]`` on rank r: stacked under the batched engine where the
    ranks' tensors allow (a copy of them), holding them as they are otherwise."""
    if is_batched(active_local_mode()):
        from .stacked import make_local

        return make_local(per_rank)
    return LocalTensor(per_rank)


def per_group_on_stack(
    kind: str, t: Any, groups: Any, op: str | None = None, size: int | None = None
) -> tuple[Any, dict[int, torch.Tensor]] | None:
    """The recorder's per-group all-gather or all-reduce on a stacked LocalTensor, all groups at
    once (``rank_collectives.per_group_on_stack``); None where it must run group by group."""
    from .rank_collectives import per_group_on_stack as on_stack

    return on_stack(kind, t, groups, op=op, size=size)


def local_of_copies(per_rank: dict[int, torch.Tensor]) -> Any:
    """A LocalTensor holding its own copy of ``per_rank[r]`` on each rank r, where one plain
    tensor may stand for several ranks (a group's result, for each member): under the batched
    engine the stack is that copy, otherwise each rank gets a clone."""
    if is_batched(active_local_mode()):
        from .stacked import stacked_copies

        stacked = stacked_copies(per_rank)
        if stacked is not None:
            return stacked
    with plain_ops():
        copies = {r: t.clone() for r, t in per_rank.items()}
    return new_local_tensor(copies)


def replicated_local(t: torch.Tensor, ranks: Sequence[int]) -> Any:
    """A LocalTensor holding its own copy of plain ``t`` on each rank (one stacked copy per rank
    under the batched engine)."""
    ranks = [int(r) for r in ranks]
    with no_dispatch():
        if is_batched(active_local_mode()) and ranks == list(range(len(ranks))) and t.is_contiguous():
            from .stacked import wrap

            base = t.detach()
            return wrap(
                base.unsqueeze(0).expand(len(ranks), *base.shape).clone(memory_format=torch.contiguous_format)
            )
        return LocalTensor({r: t.detach().clone() for r in ranks})


def one_draw_per_rank(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """A random op given its own ``generator=`` under the lockstep simulation: every rank draws
    from the generator's same state, as every real rank does from its own copy of it, and the
    generator advances once. (LocalTensorMode runs the ranks one after another on the one
    generator object, so each rank got the next rank's numbers: a silently wrong value.)"""
    gen = kwargs["generator"]
    state = gen.get_state()

    def at(x: Any, r: int) -> Any:
        if isinstance(x, LocalTensor):
            return x._local_tensors[r]
        if isinstance(x, list | tuple):
            return type(x)(at(v, r) for v in x)
        if isinstance(x, dict):
            return {k: at(v, r) for k, v in x.items()}
        return x

    locals_ = [x for x in _flat((args, kwargs)) if isinstance(x, LocalTensor)]
    with no_dispatch():
        if not locals_:
            return func(*args, **kwargs)  # a plain tensor: the same numbers on every rank
        outs: dict[int, Any] = {}
        for r in sorted(locals_[0]._local_tensors):
            gen.set_state(state)
            outs[r] = func(*at(args, r), **at(kwargs, r))
    first = next(iter(outs.values()))
    if isinstance(first, torch.Tensor):
        if args and isinstance(args[0], LocalTensor) and all(o is at(args, r)[0] for r, o in outs.items()):
            return args[0]  # an in-place op (uniform_, bernoulli_): each rank wrote its own tensor
        return LocalTensor(outs)
    return first


def _flat(x: Any) -> list[Any]:
    if isinstance(x, list | tuple):
        return [y for v in x for y in _flat(v)]
    if isinstance(x, dict):
        return [y for v in x.values() for y in _flat(v)]
    return [x]
