"""Per-rank snapshots of the tensors a collective reads and writes, under one value budget.

A snapshot keeps a buffer's values as numpy. Copying every buffer would cost as much memory
traffic as the collectives themselves, so large buffers are first aliased and copied only when
something may change them (see ``Snapshots``). ``ValueBudget`` is the one place that counts the
bytes kept.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...data.events import NUMPY_WIDENED, TensorSnapshot
from ...errors import SimulationWarning
from .. import adapters
from .. import torch as _torch
from . import caches

_SMALL = 64 * 1024  # bytes: below this a buffer costs less to copy than to keep track of
PLAIN = (torch.Tensor, torch.nn.Parameter)

# trace.NUMPY_WIDENED as torch dtypes (those this torch has).
NUMPY_WIDER = {
    getattr(torch, name): getattr(torch, wide)
    for name, wide in NUMPY_WIDENED.items()
    if isinstance(getattr(torch, name, None), torch.dtype)
}


class ValueBudget:
    """The value policy: keep snapshot values until a per-trace byte budget is spent."""

    def __init__(self, policy: str | int) -> None:
        if policy == "all":
            self.left: float = float("inf")
        elif policy == "none":
            self.left = 0
        elif isinstance(policy, int) and not isinstance(policy, bool) and policy >= 0:
            self.left = policy
        else:
            raise ValueError(f'values must be "all", "none" or a byte budget (an int >= 0), not {policy!r}')
        self.exhausted_at: int | None = None

        self.keeps_any = self.left > 0

    def take(self, nbytes: int, event_id: int) -> bool:
        if nbytes <= self.left:
            self.left -= nbytes
            return True
        self.spent(event_id)
        return False

    def spent(self, event_id: int) -> None:
        """Event ``event_id`` found the budget spent: the first such is where values stop."""
        if self.exhausted_at is None and self.keeps_any:
            self.exhausted_at = event_id


# --- values as numpy ---------------------------------------------------------------------------


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A private copy of ``t``'s values as numpy (widened where numpy lacks the dtype).

    A small buffer is copied by numpy, with no torch op to dispatch. A large one is copied by
    torch: its allocator hands back freed pages, where a fresh numpy buffer of a large snapshot is
    faulted in page by page on first write (six times slower here at 1 MiB).
    """
    with quiet((t,)):
        if readable(t) and t.numel() * t.element_size() <= _SMALL:
            return t.numpy().copy()
        t = t.detach().resolve_conj().resolve_neg()
        widened = NUMPY_WIDER.get(t.dtype)
        if widened is None and t.dtype.is_floating_point and t.element_size() == 1:
            widened = torch.float32  # a float8 (or smaller) variant newer than the table
        if t.device.type != "cpu" or widened is not None:
            return t.to("cpu", widened or t.dtype).contiguous().numpy()  # already a new tensor
        return t.clone(memory_format=torch.contiguous_format).numpy()


def from_values(values: np.ndarray, dtype: str) -> torch.Tensor:
    """A tensor of torch dtype ``dtype`` (by name) from its saved values: a loaded trace's result.
    A name torch has no dtype for is a ValueError."""
    torch_dtype = getattr(torch, dtype, None) if dtype.isidentifier() else None
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"{dtype!r} names no torch dtype")
    return torch.from_numpy(values).to(torch_dtype)


def _numpy_native(t: torch.Tensor) -> bool:
    """A plain CPU tensor whose bytes numpy reads as they are (dtype, no conj or neg bit)."""
    return (
        type(t) in PLAIN
        and t.device.type == "cpu"
        and t.dtype not in NUMPY_WIDER
        and not (t.dtype.is_floating_point and t.element_size() == 1)
        and not (t.is_conj() or t.is_neg())
    )


def readable(t: torch.Tensor) -> bool:
    """Whether numpy can view ``t`` as it is: no torch op (and no dispatch) needed to read it."""
    return _numpy_native(t) and not t.requires_grad


def _view(t: torch.Tensor) -> np.ndarray:
    """``t``'s values as numpy, sharing its memory."""
    with _torch.plain_ops():
        return t.detach().numpy() if t.requires_grad else t.numpy()


def quiet(tensors: Iterable[Any]) -> Any:
    """Where ops on these tensors run to their kernels, unseen by any dispatch mode: a cheap C++
    guard for plain tensors; for a subclass (a FakeTensor), modes off and its own handler kept."""
    return _torch.plain_ops() if all(type(t) in PLAIN for t in tensors) else _torch.no_dispatch()


# --- reading per-rank arguments -----------------------------------------------------------------


def flatten(x: Any) -> list[Any]:
    """The leaves of nested lists, tuples and dicts, in order."""
    out: list[Any] = []
    stack = [x]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        else:
            out.append(item)
    return out


def tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a collective's argument: one tensor, or (nested) lists of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in flatten(x) if isinstance(t, torch.Tensor)]


def per_rank(t: Any, ranks: Sequence[int]) -> dict[int, torch.Tensor]:
    """Each rank's tensor: a LocalTensor's own, or a plain tensor for every rank."""
    if not isinstance(t, torch.Tensor):
        return {}
    # An AsyncCollectiveTensor (what ``to_local()`` of a collective's output gives) wraps the
    # LocalTensor of every rank: its ranks' values, never one reconciled value.
    t = _torch.settled(t)
    local = _torch.local_tensors(t)
    if local is not None:
        return local
    return {r: t for r in ranks}


def present_ranks(ts: Sequence[torch.Tensor], world_size: int) -> list[int]:
    """The ranks the first LocalTensor holds (an incomplete group's collective runs on fewer)."""
    for t in ts:
        t = _torch.settled(t)
        stk = _torch.plain_stack(t)
        if stk is not None:
            return list(range(stk.shape[0]))
        local = _torch.local_tensors(t)
        if local is not None:
            return sorted(local)
    return list(range(world_size))


def nbytes(ts: Sequence[torch.Tensor], ranks: Sequence[int]) -> dict[int, int]:
    out = dict.fromkeys(ranks, 0)
    for t in ts:
        stk = _torch.plain_stack(_torch.settled(t))
        if stk is not None and len(ranks) == stk.shape[0]:  # every rank's tensor of one size
            size = describe(stk.shape[1:], stk.dtype)[2]
            for r in ranks:
                out[r] += size
            continue
        for r, lt in per_rank(t, ranks).items():
            out[r] = out.get(r, 0) + describe(lt.shape, lt.dtype)[2]
    return out


@caches.memo(maxsize=4096)
def describe(shape: torch.Size, dtype: torch.dtype) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, bytes) of a tensor: the same few recur in every recording."""
    dims = tuple(int(s) for s in shape)
    return dims, _torch.dtype_name(dtype), math.prod(dims) * dtype.itemsize


def meta_snapshot(t: torch.Tensor | None) -> TensorSnapshot:
    if t is None:
        return _shared_snapshot((), "unknown")
    shape, dtype, _ = describe(t.shape, t.dtype)
    return _shared_snapshot(shape, dtype)


@caches.memo(maxsize=4096)
def _shared_snapshot(shape: tuple[int, ...], dtype: str) -> TensorSnapshot:
    """Metadata-only snapshots are immutable: one object per (shape, dtype) serves every rank."""
    return TensorSnapshot(shape, dtype)


def split_per_rank(value: Any, ranks: Sequence[int]) -> dict[int, Any]:
    """A value returned by SPMD code, as each rank would see it."""
    return {r: _at_rank(value, r) for r in ranks}


def _at_rank(value: Any, rank: int) -> Any:
    if _torch.is_dtensor(value):
        value = _torch.local_of(value)
    elif isinstance(value, torch.Tensor) and (shard := adapters.local_of(value)) is not None:
        value = shard  # a framework's sharded tensor (PhysicsNeMo's ShardTensor): its local shard
    if isinstance(value, torch.Tensor):
        local = _torch.local_tensors(value)
        t = local[rank] if local is not None else value
        with _torch.no_dispatch():
            return t.detach().clone()
    if isinstance(value, torch.SymInt):
        return _torch.symint_at_rank(value, rank)
    if isinstance(value, tuple):
        return tuple(_at_rank(v, rank) for v in value)
    if isinstance(value, list):
        return [_at_rank(v, rank) for v in value]
    if isinstance(value, dict):
        return {k: _at_rank(v, rank) for k, v in value.items()}
    return value


# --- equal buffers share one snapshot -----------------------------------------------------------

_WORDS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_NUMPY_COMPARE = 32 * 1024
_TORCH_WORDS = {np.uint8: torch.uint8, np.int16: torch.int16, np.int32: torch.int32, np.int64: torch.int64}


def _same_buffers(a: list[Any], b: list[Any]) -> bool:
    return all(same_bits(x, y) for x, y in zip(a, b, strict=True))


def same_bits(x: Any, y: Any) -> bool:
    """Whether two tensors hold the same bytes: a snapshot of one stands for the other.

    Compared as integer words, so NaNs match themselves and -0.0 is told apart from 0.0, as a
    snapshot should; large CPU buffers in numpy, three times faster than ``torch.equal``.
    """
    if not (
        isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and x.shape == y.shape
        and x.dtype == y.dtype
        and x.device.type == y.device.type != "meta"
    ):
        return False
    word = _WORDS.get(x.element_size())
    with quiet((x, y)):
        if word is None or x.is_conj() or y.is_conj() or x.is_neg() or y.is_neg():
            return bool(torch.equal(x, y))
        if x.numel() * x.element_size() >= _NUMPY_COMPARE and readable(x) and readable(y):
            return bool(np.array_equal(x.numpy().view(word), y.numpy().view(word)))
        tw = _TORCH_WORDS[word]  # small (torch's fixed cost is lower), on a GPU, or not numpy's
        return bool(torch.equal(x.detach().view(tw), y.detach().view(tw)))


# --- snapshots that alias a buffer until it may change -------------------------------------------
#
# Most buffers a collective reads or writes are intermediates that die inside the redistribute
# that made them; copying each cost as much memory traffic as the collective itself. So a
# snapshot first aliases the buffer. It is copied just before an op writes that buffer (every
# write passes through the recorder's dispatch mode while recording), and when the recording ends
# if anything but the snapshot still holds the buffer. A write that bypassed dispatch (numpy,
# per-rank code) shows in the version counter: those values are dropped, never shown wrong.


@dataclass
class Alias:
    """A buffer that snapshots alias: the tensor itself (its version counter tells of writes), its
    version when aliased, and the one numpy view every snapshot of it shares."""

    tensor: torch.Tensor
    version: int
    values: np.ndarray
    snapshots: list[TensorSnapshot] = dataclasses.field(default_factory=list)

    def settle(self, keep_alias: bool) -> int:
        """Copy (or, if nobody else holds the buffer, keep) the values; returns how many snapshots
        lost theirs to a write that bypassed dispatch."""
        if _torch.version_counter(self.tensor) != self.version:
            for snap in self.snapshots:
                object.__setattr__(snap, "values", None)
            return len(self.snapshots)
        if not keep_alias:
            values = to_numpy(self.tensor)
            for snap in self.snapshots:
                object.__setattr__(snap, "values", _shaped(values, snap.shape))
        return 0


def _shaped(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``values`` seen in a view's shape; the same array when it already has it, so that the
    snapshots of one buffer share one array (a trace file stores it once)."""
    return values if values.shape == shape else values.reshape(shape)


def _aliasable(t: torch.Tensor) -> bool:
    """A tensor numpy reads as it is that is its whole buffer."""
    return (
        _numpy_native(t)
        and t.numel() > 0
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def holders(held: Alias) -> tuple[int, int, int]:
    """Python references to the tensor, C++ references to its TensorImpl (a ``.grad`` slot, a
    saved-for-backward), and holders of its storage (views, numpy arrays)."""
    t = held.tensor
    return sys.getrefcount(t), _torch.tensor_users(t), _torch.storage_users(t)


@caches.memo(maxsize=None)
def alone() -> tuple[int, int, int]:
    """``holders`` of a buffer that nothing but its Alias holds."""
    with _torch.no_dispatch():
        t = torch.empty(1)
        held = Alias(t, _torch.version_counter(t), _view(t))
        del t
        return holders(held)


def written(func: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument an op writes, from its schema; memoised per op."""
    hit = caches.WRITTEN.get(func)
    if hit is None:
        hit = caches.WRITTEN[func] = _torch.written_arguments(func)
    return hit


class Snapshots:
    """The snapshots of one recording: what they cost against the value budget, and the buffers
    they alias until something may change them.

    ``alias=False`` copies every snapshot's values at once: where something reads the snapshots
    while the program runs (a job's background writer, which would read a buffer while the
    program writes it) or counts what the program holds (an alias keeps a buffer alive after the
    program dropped it).
    """

    def __init__(self, budget: ValueBudget, alias: bool = True) -> None:
        self.budget = budget
        self.alias = alias
        # Snapshots that alias a live buffer, by the buffer's storage address.
        self.aliases: dict[int, Alias] = {}

    def before_op(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
        """An op is about to run: copy the snapshots aliasing any buffer it writes."""
        w = written(func)
        if w:
            picked = [args[i] if i < len(args) else kwargs.get(name) for i, name in w]
            self.unalias(flatten(picked))

    def take(
        self,
        arg: Any,
        ranks: Sequence[int],
        eid: int,
        groups: tuple[tuple[int, ...], ...] = (),
        alias: bool = True,
    ) -> dict[int, Any]:
        """Per-rank snapshots of a tensor, a one-element list (unwrapped) or a list of tensors.

        With ``groups``, a rank whose buffer equals its group's first rank's shares that snapshot
        (after an all-reduce, all-gather or broadcast): one copy per group, not one per rank.
        """
        items = arg
        while isinstance(items, (list, tuple)) and len(items) == 1:
            items = items[0]
        listed = isinstance(items, (list, tuple))
        leader = {r: g[0] for g in groups for r in g}
        if not listed:
            stacked = self._stacked(items, ranks, eid, leader)
            if stacked is not None:
                return stacked
        ts = list(items) if listed else [items]
        per_tensor = [per_rank(t, ranks) for t in ts]
        if self.budget.left <= 0:  # metadata only: no tensor work, no need to leave the modes
            self.budget.spent(eid)
            return {r: self._metadata(per_tensor, r, listed) for r in ranks}
        with quiet(t for pt in per_tensor for t in pt.values()):
            return self._values(per_tensor, ranks, eid, leader, listed, alias)

    def _stacked(
        self, t: Any, ranks: Sequence[int], eid: int, leader: dict[int, int]
    ) -> dict[int, Any] | None:
        """The batched engine's stack of small buffers, copied once for all ranks (each rank's
        snapshot a row of the copy), with what ``_values`` gives rank by rank: the same budget,
        a rank equal to its group's first sharing that snapshot. None where that path differs
        (a buffer to alias, a dtype numpy lacks, ranks not 0..N-1)."""
        stk = _torch.plain_stack(_torch.settled(t)) if isinstance(t, torch.Tensor) else None
        if stk is None or len(ranks) != stk.shape[0] or any(r != i for i, r in enumerate(ranks)):
            return None
        shape, dtype, size = describe(stk.shape[1:], stk.dtype)
        if self.budget.left <= 0:  # metadata only, as in ``take``
            self.budget.spent(eid)
            return dict.fromkeys(ranks, _shared_snapshot(shape, dtype))
        word = _WORDS.get(stk.element_size())
        if size > _SMALL or word is None or not readable(stk):
            return None  # (no integer word as wide as complex128: same_bits compares those)
        with _torch.plain_ops():
            values = stk.numpy().copy()
        kept: dict[int, bool] = {}  # rank -> keeps values of its own (False: over budget)
        shares: dict[int, int] = {}
        for r in ranks:
            first = leader.get(r, r)
            same = first != r and first in kept
            if same and np.array_equal(values[r].view(word), values[first].view(word)):
                shares[r] = first
            else:
                kept[r] = self.budget.take(size, eid)
        # Rows of the one copy, 0-d ones as arrays; each its own copy where some rows are not
        # kept, so that the snapshots hold no more memory than the budget counted.
        whole = len(shares) == 0 and all(kept.values())
        out: dict[int, Any] = {}
        for r in ranks:
            if r in shares:
                out[r] = out[shares[r]]
            elif kept[r]:
                out[r] = TensorSnapshot(shape, dtype, values[r, ...] if whole else values[r, ...].copy())
            else:
                out[r] = TensorSnapshot(shape, dtype)
        return out

    def _values(
        self,
        per_tensor: list[dict[int, torch.Tensor]],
        ranks: Sequence[int],
        eid: int,
        leader: dict[int, int],
        listed: bool,
        alias: bool,
    ) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for r in ranks:
            first = leader.get(r, r)
            if (
                first != r
                and first in out
                and _same_buffers([pt.get(r) for pt in per_tensor], [pt.get(first) for pt in per_tensor])
            ):
                out[r] = out[first]
                continue
            snaps = [self.one(pt.get(r), eid, alias) for pt in per_tensor]
            out[r] = snaps if listed else snaps[0]
        return out

    def take_groups(
        self,
        group_values: dict[int, torch.Tensor],
        out: Any,
        groups: tuple[tuple[int, ...], ...],
        ranks: Sequence[int],
        eid: int,
    ) -> dict[int, Any]:
        """Snapshots of a collective's outputs that shardviz made itself, one per group: every
        member got a clone of its group's value, which nothing else holds, so the snapshot keeps
        that tensor's buffer as it is, with no compare and no copy."""
        present = [(g, v) for g in groups if (v := group_values.get(g[0])) is not None]
        # The groups' values may be rows of one tensor (the batched engine's), which a kept row's
        # view would hold whole: kept as they are only where the budget keeps them all, else each
        # kept one is copied.
        owned = sum(v.numel() * v.element_size() for _, v in present) <= self.budget.left
        by_rank: dict[int, Any] = {}
        for g, value in present:
            snap = self.one(value, eid, owned=owned)
            for r in g:
                by_rank[r] = snap
        if all(r in by_rank for r in ranks):
            return {r: by_rank[r] for r in ranks}
        # A rank of an incomplete group gets no output, as in LocalTensorMode.
        by_member = per_rank(out, ranks)
        return {r: by_rank[r] if r in by_rank else meta_snapshot(by_member.get(r)) for r in ranks}

    @staticmethod
    def _metadata(per_tensor: list[dict[int, torch.Tensor]], r: int, listed: bool) -> Any:
        snaps = [meta_snapshot(pt.get(r)) for pt in per_tensor]
        return snaps if listed else snaps[0]

    def one(
        self, t: torch.Tensor | None, eid: int, alias: bool = False, owned: bool = False
    ) -> TensorSnapshot:
        """``alias``: the buffer may be aliased until it may change; ``owned``: the buffer is the
        recorder's own, which nothing else holds or writes, so it is kept as it is."""
        if t is None:
            return TensorSnapshot((), "unknown")
        shape, dtype, size = describe(t.shape, t.dtype)
        if t.device.type == "meta":
            return TensorSnapshot(shape, dtype)
        if not self.budget.take(size, eid):
            return TensorSnapshot(shape, dtype)
        if owned and readable(t):
            return TensorSnapshot(shape, dtype, _view(t))
        # A small buffer costs less to copy than to keep track of.
        if alias and self.alias and size > _SMALL and _aliasable(t):
            return self._alias(t, shape, dtype)
        return TensorSnapshot(shape, dtype, to_numpy(t))

    def _alias(self, t: torch.Tensor, shape: tuple[int, ...], dtype: str) -> TensorSnapshot:
        owner = t
        base = _torch.view_base(t)
        if base is not None:
            # A view of a whole buffer (a reshape): alias the tensor it views, which shares its
            # version counter, so that the buffer counts as free once the view is gone.
            if not (_aliasable(base) and base.dtype == t.dtype):
                return TensorSnapshot(shape, dtype, to_numpy(t))
            owner = base
        key = owner.untyped_storage().data_ptr()
        held = self.aliases.get(key)
        if held is None:
            # The tensor itself, not a detached alias: inside dispatch (below autograd) detach()
            # would not share the version counter that tells of writes.
            held = self.aliases[key] = Alias(owner, _torch.version_counter(owner), _view(owner))
        elif held.tensor is not owner or _torch.version_counter(held.tensor) != held.version:
            return TensorSnapshot(shape, dtype, to_numpy(t))  # another tensor over the same buffer
        snap = TensorSnapshot(shape, dtype, _shaped(held.values, shape))
        held.snapshots.append(snap)
        return snap

    def unalias(self, ts: Sequence[Any]) -> None:
        """Copy the snapshots aliasing these tensors' buffers, which are about to be written."""
        for x in ts:
            for t in _torch.plain_tensors(x):
                if type(t) not in PLAIN or not t.numel():
                    continue  # only plain tensors are aliased (a FakeTensor has no data)
                held = self.aliases.pop(t.untyped_storage().data_ptr(), None)
                if held is not None:
                    held.settle(keep_alias=False)

    def settle(self) -> None:
        """The recording ends: keep the aliases nothing else holds, copy the rest."""
        if not self.aliases:
            return
        lost = 0
        with _torch.plain_ops():
            for held in self.aliases.values():
                lost += held.settle(keep_alias=holders(held) == alone())
        self.aliases.clear()
        if lost:
            warnings.warn(
                f"shardviz: the values of {lost} snapshot(s) were dropped: their buffer was changed "
                "in place where shardviz could not see it (through numpy, in a compiled region, or with "
                "dispatch modes disabled) before the recording ended. Their shapes and dtypes are kept.",
                SimulationWarning,
                stacklevel=3,
            )
