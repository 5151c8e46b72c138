"""Stacked LocalTensors: every rank's value of a tensor as one slice of a ``[ranks, ...]`` tensor.

A ``StackedLocalTensor`` is a LocalTensor, so everything that reads a LocalTensor (DTensor, FSDP2,
torch's own collectives, shardviz's recorder) reads it as before: its ``_local_tensors`` is a
dict of views into the stack, made when first asked for, and a write through one of them lands
in the stack. Where the ranks' values cannot share one stack (uneven shards, a tensor replaced
per rank) it holds them per rank as a LocalTensor does (``stack is None``), and the batched
engine runs its ops once per rank.

The wrapper of a stacked one carries its sizes and strides itself (no Python dispatch for a
``size()``), taken from the stack: each rank's tensor is the stack's slice, so they are the same.
"""

from __future__ import annotations

import copy
import sys
import weakref
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from .gate import LocalIntNode, LocalTensor, _private

_lt_module = _private["local_tensor_module"]
_SLOT = LocalTensor.__dict__["_local_tensors"]  # LocalTensor's own slot, under the property below
_DisableTorchDispatch = torch._C._DisableTorchDispatch
PLAIN = (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer)
aten = torch.ops.aten


class _RankViews(dict):
    """A stacked tensor's ranks as views into the stack. Putting another tensor in a rank's place
    (the point-to-point runner's receive does) ends the stacking: the ranks are held one by one
    from then on, as in any LocalTensor."""

    __slots__ = ("owner",)
    # A weak reference: the tensor holds this dict, and a strong one back would keep the tensor
    # alive in a cycle. torch hands a factory's result (``torch.full_like``) to the user as is only
    # while nothing else refers to it; else it makes a detached alias, dispatched as an op no real
    # rank runs (an ``aten.detach`` the recorder would show).
    owner: weakref.ref[Any] | None

    def __setitem__(self, key: Any, value: Any) -> None:
        ref = getattr(self, "owner", None)
        owner = ref() if ref is not None else None
        if owner is not None:
            owner.__dict__["_stk"] = None
        self.owner = None
        super().__setitem__(key, value)


class StackedLocalTensor(LocalTensor):
    """A LocalTensor whose ranks' values are the slices of one tensor ``[ranks, ...]``
    (``stack``), or one tensor per rank where they cannot be (``stack`` None)."""

    @property
    def _local_tensors(self) -> dict[int, torch.Tensor]:
        try:
            return _SLOT.__get__(self)
        except AttributeError:
            pass
        stk = self.__dict__["_stk"]
        if type(stk) in PLAIN:
            with _DisableTorchDispatch():
                views = _RankViews(zip(range(stk.shape[0]), stk.unbind(0), strict=True))
        else:  # torch.compile's fake or functional copy: its ranks are cut from it as it handles it
            views = _RankViews(zip(range(stk.shape[0]), stk.unbind(0), strict=True))
        views.owner = weakref.ref(self)
        _SLOT.__set__(self, views)
        return views

    @_local_tensors.setter
    def _local_tensors(self, value: dict[int, torch.Tensor]) -> None:
        _SLOT.__set__(self, value)
        self.__dict__["_stk"] = None

    @property
    def stack(self) -> torch.Tensor | None:
        """The ranks' values as one tensor ``[ranks, ...]``, or None where they are held per rank."""
        return self.__dict__.get("_stk")

    def is_contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> bool:
        if self.__dict__.get("_stk") is not None:
            return torch.Tensor.is_contiguous(self, memory_format=memory_format)
        return super().is_contiguous(memory_format)

    def contiguous(self, memory_format: torch.memory_format = torch.contiguous_format) -> torch.Tensor:
        if self.__dict__.get("_stk") is not None:
            return torch.Tensor.contiguous(self, memory_format=memory_format)
        return super().contiguous(memory_format)

    def __deepcopy__(self, memo: dict[Any, Any] | None) -> LocalTensor:
        stk = self.__dict__.get("_stk")
        if stk is None:
            out = make_local({r: copy.deepcopy(t, memo) for r, t in self._local_tensors.items()})
        else:
            with _DisableTorchDispatch():
                out = wrap(stk.clone())
        if self.requires_grad:
            out.requires_grad_(True)
        return out

    # --- torch.compile: Dynamo and AOTAutograd make fake copies from these, and run compiled
    # graphs on the tensors they name (a stacked one's stack, or its ranks' tensors) ------------

    def __tensor_flatten__(self) -> tuple[list[str], tuple[Any, ...]]:
        """A stacked one as its stack (one tensor ``[ranks, ...]``), one held per rank as its
        ranks' tensors, as a LocalTensor."""
        if self.__dict__.get("_stk") is not None:
            return ["_stk"], (STACKED,)
        return super().__tensor_flatten__()[0], (PER_RANK,)

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, Any], flatten_spec: tuple[Any, ...], outer_size: Any, outer_stride: Any
    ) -> StackedLocalTensor:
        if flatten_spec == (STACKED,):
            return wrap(inner_tensors["_stk"])
        per_rank = {_lt_module._from_local_tensor_attr(a): t for a, t in inner_tensors.items()}
        return LocalTensor.__new__(StackedLocalTensor, per_rank)

    def __coerce_same_metadata_as_tangent__(
        self, expected_metadata: Any, expected_type: type | None = None
    ) -> torch.Tensor | None:
        """A gradient reaching a compiled backward in another form than its trace saw: the same
        values in that form (a LocalTensor, stacked, or held per rank)."""
        if expected_type is LocalTensor:
            return _lt_module.LocalTensor(dict(self._local_tensors))
        if expected_type not in (None, StackedLocalTensor):
            return None
        if expected_metadata == (PER_RANK,):
            return LocalTensor.__new__(StackedLocalTensor, dict(self._local_tensors))
        if expected_metadata == (STACKED,):
            stk = stack_of(self)
            if stk is None:
                return None  # uneven ranks: no stack holds them
            return wrap(stk)
        return None

    @classmethod
    def __torch_dispatch__(
        cls,
        func: Any,
        types: tuple[Any, ...],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if func in META_OPS and len(args) == 1 and type(args[0]) is StackedLocalTensor:
            return metadata(func, args[0])
        flat = flat_args(args, kwargs or {})
        if _lt_module._check_for_subclass(flat):
            return NotImplemented  # another subclass (an AsyncCollectiveTensor) unwraps itself first
        ranks = next((a._ranks for a in flat if isinstance(a, LocalTensor)), None)
        if ranks is None:
            return NotImplemented
        # An op on these tensors while no simulation runs (reading a result after it, or torch's
        # own aliasing fix-up inside a mode's handler): in a batched mode of their ranks, as a
        # LocalTensor runs its own in a LocalTensorMode.
        with MODE_FOR[0](ranks):
            return func(*args, **(kwargs or {}))


# The batched engine's mode class, which registers itself here (it imports this module).
MODE_FOR: list[Any] = [None]


def wrap(stk: torch.Tensor) -> StackedLocalTensor:
    """A stacked LocalTensor over ``stk`` (rank dim first, ranks 0..N-1)."""
    r = torch.Tensor._make_wrapper_subclass(
        StackedLocalTensor,
        stk.shape[1:],
        strides=stk.stride()[1:],
        storage_offset=stk.storage_offset(),
        dtype=stk.dtype,
        device=stk.device,
        layout=stk.layout,
        requires_grad=False,
    )
    torch._C._set_throw_on_mutable_data_ptr(r)
    if stk.is_conj() or stk.is_neg():
        # A lazy conjugate or negation (``x.conj()``) is a bit on the tensor, which torch resolves
        # before an op reaches Python dispatch. LocalTensorMode's wrapper carries its ranks' bit;
        # without it here, ops on the stack would read the unconjugated values.
        torch._C._set_conj(r, stk.is_conj())
        torch._C._set_neg(r, stk.is_neg())
    r.__dict__["_stk"] = stk
    n = stk.shape[0]
    ranks = _RANKS.get(n)
    if ranks is None:
        ranks = _RANKS[n] = frozenset(range(n))
    r._ranks = ranks
    r._size = list(stk.shape[1:])
    return r


_RANKS: dict[int, frozenset[int]] = {}
STACKED, PER_RANK = "stacked", "per rank"  # how one is flattened for torch.compile


def stack_of(t: Any) -> torch.Tensor | None:
    """The stacked values of a LocalTensor ``[ranks, ...]`` (stacking them first where that changes
    nothing a program can see: ``restack``), or None where it holds them per rank."""
    tt = type(t)
    if tt is StackedLocalTensor:
        stk = t.__dict__.get("_stk")
        if stk is None and restack(t):
            stk = t.__dict__["_stk"]
        return stk
    if tt is LocalTensor and restack(t):
        return t.__dict__["_stk"]
    return None


def plain_stack(t: Any) -> torch.Tensor | None:
    """The plain tensor ``[ranks, ...]`` in which a stacked LocalTensor holds its ranks' values, as
    it is (unlike ``stack_of``, never restacking); None for anything else."""
    if type(t) is StackedLocalTensor:
        stk = t.__dict__.get("_stk")
        if type(stk) is torch.Tensor:
            return stk
    return None


def make_local(per_rank: dict[int, torch.Tensor]) -> LocalTensor:
    """A LocalTensor of these per-rank tensors: stacked (one copy of them) when they cover ranks
    0..N-1 with the same shape, dtype and a contiguous layout, held per rank otherwise."""
    stacked = stacked_copies(per_rank)
    if stacked is not None:
        return stacked
    return LocalTensor.__new__(StackedLocalTensor, per_rank)


def stacked_copies(per_rank: dict[int, torch.Tensor]) -> LocalTensor | None:
    """A stacked LocalTensor holding a copy of ``per_rank[r]`` on each rank r, where one tensor
    may stand for several ranks (a group's result, for each member): the stack is the copy. None
    where they do not stack."""
    values = _stackable(per_rank)
    if values is None:
        return None
    with _DisableTorchDispatch():
        return wrap(torch.stack(values))


def _stackable(per_rank: dict[int, torch.Tensor]) -> list[torch.Tensor] | None:
    """The tensors in rank order where they cover ranks 0..N-1 with one shape and dtype and a
    contiguous layout; None otherwise."""
    n = len(per_rank)
    if n == 0 or any(r not in per_rank for r in range(n)):
        return None
    values = [per_rank[r] for r in range(n)]
    return values if uniform(values) and values[0].is_contiguous() else None


def uniform(values: list[torch.Tensor]) -> bool:
    """Plain tensors of one shape, layout, dtype and device, none requiring grad: slices of a stack."""
    first = values[0]
    if type(first) not in PLAIN or first.requires_grad or first.is_conj() or first.is_neg():
        return False
    if first.layout != torch.strided or first.is_meta:
        return False
    shape, stride, dtype, device = first.shape, first.stride(), first.dtype, first.device
    for v in values:
        if (
            type(v) not in PLAIN
            or v.shape != shape
            or v.stride() != stride
            or v.dtype != dtype
            or v.device != device
            or v.requires_grad
        ):
            return False
    return True


def restack(lt: Any) -> bool:
    """Give a per-rank LocalTensor stacked values without changing anything a program can see,
    and say whether it now has them:

    - its ranks' tensors are already evenly spaced slices of one memory (views torch's per-rank
      code made of a stack): the stack is a view over that same memory;
    - or each rank's tensor is held by this LocalTensor alone (nothing else refers to it, views
      it, or saved it for backward): they move into one new stack, which nothing can tell.

    A plain LocalTensor becomes a StackedLocalTensor. Uneven shapes, a rank missing, a tensor that
    something else holds too: unchanged (False)."""
    try:
        per_rank = _SLOT.__get__(lt)
    except AttributeError:
        return False
    n = len(per_rank)
    if n == 0 or n != len(lt._ranks) or any(r not in per_rank for r in range(n)):
        return False
    values = [per_rank[r] for r in range(n)]
    if not uniform(values):
        return False
    stk = _as_slices(values)
    if stk is None:
        if not values[0].is_contiguous() or not all(_alone(v) for v in values):
            return False
        with _DisableTorchDispatch():
            stk = torch.stack(values)
        _SLOT.__delete__(lt)  # the ranks' views of the new stack are made when asked for
    if type(lt) is LocalTensor:
        lt.__class__ = StackedLocalTensor
    lt.__dict__["_stk"] = stk
    return True


def _as_slices(values: list[torch.Tensor]) -> torch.Tensor | None:
    """The stack these tensors are the slices of (one storage, evenly spaced, not overlapping), as
    a view over that storage; None when they are not."""
    first = values[0]
    if len(values) == 1:
        with _DisableTorchDispatch():
            return first.unsqueeze(0)
    shape, stride = first.shape, first.stride()
    storage = first.untyped_storage()._cdata
    offsets = [v.storage_offset() for v in values]
    step = offsets[1] - offsets[0]
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else 0
    if step <= 0 or step < span:
        return None
    for i, v in enumerate(values):
        if offsets[i] != offsets[0] + i * step or v.untyped_storage()._cdata != storage:
            return None
    with _DisableTorchDispatch():
        return first.as_strided((len(values), *shape), (step, *stride), offsets[0])


def _fake_slices(values: list[torch.Tensor]) -> bool:
    """Fake tensors (torch.compile's copies) of one shape and layout, evenly spaced slices of one
    fake memory, as ``_as_slices`` finds real ones."""
    first = values[0]
    if len(values) < 2 or not isinstance(first, FakeTensor):
        return False
    shape, stride, storage = first.shape, first.stride(), first.untyped_storage()._cdata
    step = values[1].storage_offset() - first.storage_offset()
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) if all(shape) else 0
    if step <= 0 or step < span:
        return False
    return all(
        isinstance(v, FakeTensor)
        and v.shape == shape
        and v.stride() == stride
        and v.dtype == first.dtype
        and v.untyped_storage()._cdata == storage
        and v.storage_offset() == first.storage_offset() + i * step
        for i, v in enumerate(values)
    )


def _alone(v: torch.Tensor) -> bool:
    """Whether nothing but its LocalTensor refers to this tensor or its memory: not a view, no
    view of it, not saved for backward, one Python reference (the LocalTensor's dict: the other
    three are this call's, its caller's list and loop)."""
    return (
        v._base is None
        and v._use_count() == 1  # type: ignore[attr-defined]
        and sys.getrefcount(v) <= 4
        and _private["storage_use_count"](v.untyped_storage()._cdata) <= 2  # its own and the query's
    )


def flat_args(args: Any, kwargs: dict[str, Any]) -> list[Any]:
    """An op's arguments, with those in lists (and lists of lists) spread out."""
    out: list[Any] = []
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) in (list, tuple):
            for b in a:
                if type(b) in (list, tuple):
                    out.extend(b)
                else:
                    out.append(b)
        else:
            out.append(a)
    return out


META_OPS = {
    getattr(packet, o)
    for packet in (
        aten.sym_size,
        aten.sym_stride,
        aten.sym_storage_offset,
        aten.sym_numel,
        aten.dim,
        aten.is_contiguous,
        aten.is_strides_like_format,
        aten.is_non_overlapping_and_dense,
    )
    for o in packet.overloads()
}


def metadata(func: Any, t: StackedLocalTensor) -> Any:
    """A size, stride, offset or element count asked as an operator (torch's aliasing fix-up asks
    them so): from the stack, or per rank as LocalTensorMode combines them."""
    packet = func.overloadpacket
    stk = t.__dict__.get("_stk")
    if packet is aten.dim:
        return len(t._size)
    if packet is aten.sym_size:
        return tuple(t._size)
    if stk is not None:
        if packet is aten.sym_stride:
            return tuple(stk.stride()[1:])
        if packet is aten.sym_storage_offset:
            return stk.storage_offset()
        if packet is aten.sym_numel:
            return stk[0].numel() if stk.shape[0] else 0
    elif packet is aten.sym_storage_offset:
        # Ranks held as evenly spaced slices of one memory: each sits at the offset of rank 0's
        # within its own slot, as each rank's own tensor would (per rank, each slice's offset
        # counts the ranks before it too: a per-rank offset DTensor cannot take).
        per = t._local_tensors
        values = [per[r] for r in range(len(per))] if all(r in per for r in range(len(per))) else []
        if values and uniform(values):
            slices = _as_slices(values)
            if slices is not None:
                return slices.storage_offset()
        elif values and _fake_slices(values):
            return values[0].storage_offset()  # torch.compile's copy of such ranks says the same
    with _DisableTorchDispatch():
        per_rank = {r: func(v) for r, v in t._local_tensors.items()}
    first = next(iter(per_rank.values()))
    if isinstance(first, (tuple, list)):
        return type(first)(
            _lt_module._combine_int_rank_results({r: v[i] for r, v in per_rank.items()})
            for i in range(len(first))
        )
    return _lt_module._combine_any_rank_results(per_rank)


__all__ = [
    "PLAIN",
    "LocalIntNode",
    "StackedLocalTensor",
    "flat_args",
    "make_local",
    "restack",
    "stack_of",
    "uniform",
    "wrap",
]
