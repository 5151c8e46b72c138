"""Where the ranks' collectives meet in the one-thread-per-rank simulator, as data and plain torch.

A ``Call`` is one rank's part in a collective; a ``Meeting`` gathers a group's k-th calls; once all
members are there, ``RUN`` (by op) checks that they called the same collective and computes every
member's result with plain torch, the reductions exactly as the lockstep simulator does them (same
order, same bits). A ``Message`` is one buffered send. No threads here: ``threadpg`` schedules the
ranks and brings their calls to these functions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ShardvizError
from . import torch as _torch

if TYPE_CHECKING:
    from .recorder.specs import Spec


class CollectiveMismatchError(ShardvizError, RuntimeError):
    """Ranks met at the same collective step of a group having called different collectives."""


class ThreadsUnsupportedError(ShardvizError, NotImplementedError):
    """A communication op the one-thread-per-rank simulator does not carry out."""


def dims(t: torch.Tensor) -> str:
    return f"{_torch.dtype_name(t.dtype)}[{', '.join(str(int(s)) for s in t.shape)}]"


# --- the collectives -------------------------------------------------------------------------


@dataclass(eq=False)
class Call:
    """One rank's part in a collective: what it called, with which arguments."""

    rank: int
    spec: Spec
    impl: str
    bound: dict[str, Any]
    group: tuple[int, ...]  # the group's global ranks, by group rank
    group_key: str
    seq: int  # this is the rank's seq-th collective on the group (from 1)
    frame: Any = None  # the caller's frame, while the call is open (for error messages)
    factor: Any = None  # a ReduceOp.PREMUL_SUM's factor, read in the calling rank's thread

    def reduce(self) -> str | None:
        # Imported here: the recorder imports this module, and the threads may be loaded first.
        from .recorder.specs import reduce_name

        return reduce_name(self.bound.get("reduce_op")) if self.spec.reduce else None

    def root(self) -> int | None:
        r = self.bound.get(self.spec.root) if self.spec.root else None
        return None if r is None else int(r)

    def describe(self) -> str:
        op = self.spec.op + (f"({self.reduce()})" if self.reduce() else "")
        root = self.root()
        if root is not None:
            op += f" with root rank {self.group[root] if 0 <= root < len(self.group) else root}"
        ins = _inputs(self)
        what = f" of {', '.join(dims(t) for t in ins)}" if ins else ""
        return f"{op}{what} ({self.impl})"


@dataclass(eq=False)
class Meeting:
    key: tuple[str, int]
    group: tuple[int, ...]
    calls: dict[int, Call] = field(default_factory=dict)
    results: dict[int, Any] | None = None
    id: int | None = None  # in the order meetings completed
    stamp: int = -1  # the run's clock when it completed


def _tensor_list(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, list | tuple):
        return [t for v in x for t in _tensor_list(v)]
    return []


def _inputs(call: Call) -> list[torch.Tensor]:
    """The tensors a call contributes (for checking that the members agree)."""
    b, op = call.bound, call.spec.op
    if op == "scatter":
        return _tensor_list(b["output_tensors"])  # only the root passes inputs; outputs agree
    if op == "gather":
        return _tensor_list(b["input_tensors"])
    if op in ("barrier", "recv", "send") or call.spec.inputs is None:
        return []
    if op == "all_to_all":
        return []  # split sizes may differ by rank; checked when the data moves
    return _tensor_list(b[call.spec.inputs])


def disagreement(a: Call, b: Call) -> str | None:
    """Why two members' calls cannot be the same collective, or None."""
    if a.spec.op != b.spec.op:
        return "different collectives"
    if a.group != b.group:
        return f"different groups ({list(a.group)} and {list(b.group)}) under one group name"
    if a.reduce() != b.reduce():
        return "different reductions"
    if a.root() != b.root():
        return "different roots"
    ia, ib = _inputs(a), _inputs(b)
    if len(ia) != len(ib):
        return "different numbers of tensors"
    for x, y in zip(ia, ib, strict=True):
        if x.dtype != y.dtype:
            return "different dtypes"
        if tuple(x.shape) != tuple(y.shape):
            return "different shapes"
    return None


def _reduce(name: str | None, tensors: list[torch.Tensor], factors: Sequence[Any] = ()) -> torch.Tensor:
    """The reduction of the members' tensors, in group order; a PREMUL_SUM scales each by its
    member's factor first (FSDP2 with a gradient divide factor), as the lockstep simulator does."""
    if name == "premul_sum":
        out = tensors[0] * factors[0]
        for t, f in zip(tensors[1:], factors[1:], strict=True):
            out = out + t * f
        return out
    return _torch.local_reduce(name or "sum", tensors)


def done_work(tensors: Sequence[torch.Tensor] = ()) -> Any:
    """A finished Work whose future holds ``tensors``, as a real process group's does (gloo's: the
    op's output tensors; DDP's reducer reads its bucket back from ``get_future()``)."""
    return _torch.fake_work(list(tensors))


def _all_reduce(calls: list[Call]) -> list[Any]:
    op = calls[0].reduce()
    ins = [_inputs(c) for c in calls]
    factors = [c.factor for c in calls]
    reds = [_reduce(op, [x[i] for x in ins], factors) for i in range(len(ins[0]))]
    out: list[Any] = []
    for c, mine in zip(calls, ins, strict=True):
        impl = c.impl
        if impl.startswith("c10d."):
            for t, r in zip(mine, reds, strict=True):
                t.copy_(r)
            work = done_work(mine)
            out.append((c.bound["tensors"], work) if impl == "c10d.allreduce_" else work)
        elif impl.endswith("_"):  # the functional in-place variants
            for t, r in zip(mine, reds, strict=True):
                t.copy_(r)
            out.append(c.bound[str(c.spec.inputs)])
        else:
            fresh = [torch.empty_like(r, memory_format=torch.contiguous_format).copy_(r) for r in reds]
            out.append(fresh if "coalesced" in impl else fresh[0])
    return out


def _all_gather(calls: list[Call]) -> list[Any]:
    ins = [_inputs(c) for c in calls]
    n = len(ins[0])
    cats = [
        torch.cat([x[i] for x in ins]) if ins[0][i].dim() else torch.stack([x[i] for x in ins])
        for i in range(n)
    ]
    out: list[Any] = []
    for c in calls:
        impl, b = c.impl, c.bound
        if impl == "c10d.allgather_":
            for i, outs in enumerate(b["output_tensors"]):
                for j, t in enumerate(outs):
                    t.copy_(ins[j][i])
            out.append((b["output_tensors"], done_work(_tensor_list(b["output_tensors"]))))
        elif impl == "c10d._allgather_base_":
            b["output_tensor"].copy_(cats[0].view_as(b["output_tensor"]))
            out.append((b["output_tensor"], done_work([b["output_tensor"]])))
        elif impl == "c10d.allgather_into_tensor_coalesced_":
            for t, v in zip(b["outputs"], cats, strict=True):
                t.copy_(v.view_as(t))
            out.append(done_work(b["outputs"]))
        elif impl == "c10d.allgather_coalesced_":
            for j, outs in enumerate(b["output_lists"]):
                for i, t in enumerate(outs):
                    t.copy_(ins[j][i])
            out.append(done_work(_tensor_list(b["output_lists"])))
        elif impl.endswith("_out"):
            b["out"].copy_(cats[0].view_as(b["out"]))
            out.append(b["out"])
        else:
            fresh = [v.clone() for v in cats]
            out.append(fresh if "coalesced" in impl else fresh[0])
    return out


def _chunks(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    if t.shape[0] % n:
        raise CollectiveMismatchError(
            f"reduce_scatter of {dims(t)} over {n} ranks: dim 0 does not divide into {n} equal parts"
        )
    size = t.shape[0] // n  # narrow, not split: split of an empty dim into parts of 0 gives one part
    return [t.narrow(0, i * size, size) for i in range(n)]


def _reduce_scatter(calls: list[Call]) -> list[Any]:
    n = len(calls)
    op = calls[0].reduce()
    out: list[Any] = []
    factors = [c.factor for c in calls]
    if calls[0].impl == "c10d.reduce_scatter_":
        lists = [c.bound["input_tensors"][0] for c in calls]
        for j, c in enumerate(calls):
            c.bound["output_tensors"][0].copy_(_reduce(op, [lst[j] for lst in lists], factors))
            out.append((c.bound["output_tensors"], done_work(c.bound["output_tensors"])))
        return out
    ins = [_inputs(c) for c in calls]
    reds = [_reduce(op, [x[i] for x in ins], factors) for i in range(len(ins[0]))]
    parts = [_chunks(r, n) for r in reds]
    for j, c in enumerate(calls):
        impl, b = c.impl, c.bound
        mine = [p[j] for p in parts]
        if impl == "c10d._reduce_scatter_base_":
            b["output_tensor"].copy_(mine[0].view_as(b["output_tensor"]))
            out.append((b["output_tensor"], done_work([b["output_tensor"]])))
        elif impl == "c10d.reduce_scatter_tensor_coalesced_":
            for t, v in zip(b["outputs"], mine, strict=True):
                t.copy_(v.view_as(t))
            out.append(done_work(b["outputs"]))
        elif impl.endswith("_out"):
            b["out"].copy_(mine[0].view_as(b["out"]))
            out.append(b["out"])
        else:
            fresh = [v.clone() for v in mine]
            out.append(fresh if "coalesced" in impl else fresh[0])
    return out


def _broadcast(calls: list[Call]) -> list[Any]:
    root = calls[0].root() or 0
    src = [t.clone() for t in _inputs(calls[root])]
    out: list[Any] = []
    for c in calls:
        mine = _inputs(c)
        if c.impl == "_c10d_functional.broadcast":
            out.append(src[0].clone())
            continue
        if c is not calls[root]:
            for t, v in zip(mine, src, strict=True):
                t.copy_(v)
        out.append((c.bound["tensors"], done_work(mine)) if c.impl == "c10d.broadcast_" else c.bound["input"])
    return out


def _scatter(calls: list[Call]) -> list[Any]:
    root = calls[calls[0].root() or 0]
    pieces = root.bound["input_tensors"][0] if root.bound["input_tensors"] else []
    if len(pieces) != len(calls):
        raise CollectiveMismatchError(
            f"scatter from rank {root.rank}: it passed {len(pieces)} tensors for {len(calls)} ranks"
        )
    out = []
    for j, c in enumerate(calls):
        c.bound["output_tensors"][0].copy_(pieces[j])
        out.append((c.bound["output_tensors"], done_work(c.bound["output_tensors"])))
    return out


def _gather(calls: list[Call]) -> list[Any]:
    root = calls[calls[0].root() or 0]
    slots = root.bound["output_tensors"][0] if root.bound["output_tensors"] else []
    if len(slots) != len(calls):
        raise CollectiveMismatchError(
            f"gather to rank {root.rank}: it passed {len(slots)} output tensors for {len(calls)} ranks"
        )
    for j, c in enumerate(calls):
        slots[j].copy_(c.bound["input_tensors"][0])
    return [done_work(slots if c is root else ()) for c in calls]


def _reduce_to_root(calls: list[Call]) -> list[Any]:
    root = calls[calls[0].root() or 0]
    red = _reduce(calls[0].reduce(), [c.bound["tensors"][0] for c in calls], [c.factor for c in calls])
    root.bound["tensors"][0].copy_(red)
    return [done_work(c.bound["tensors"]) for c in calls]


def _splits(t: torch.Tensor, sizes: Sequence[int] | None, n: int) -> list[torch.Tensor]:
    if sizes:
        return list(torch.split(t, [int(s) for s in sizes]))
    return _chunks(t, n)


def _all_to_all(calls: list[Call]) -> list[Any]:
    n = len(calls)
    impl0 = calls[0].impl
    if impl0 == "_dtensor.shard_dim_alltoall":
        b0 = calls[0].bound
        whole = torch.cat([c.bound["input"] for c in calls], dim=int(b0["gather_dim"]))
        dim = int(b0["shard_dim"])
        parts = torch.split(whole, whole.size(dim) // n, dim=dim)
        return [parts[j].clone() if j < len(parts) else whole.narrow(dim, 0, 0).clone() for j in range(n)]
    sent: list[list[torch.Tensor]] = []  # sent[i][j]: what member i sends member j
    for c in calls:
        b = c.bound
        if c.impl == "c10d.alltoall_":
            sent.append(list(b["input_tensors"]))
        else:
            inp = b["input"]
            sent.append(_splits(inp, b.get("input_split_sizes"), n))
    out: list[Any] = []
    for j, c in enumerate(calls):
        b = c.bound
        got = [sent[i][j] for i in range(n)]
        if c.impl == "c10d.alltoall_":
            for t, v in zip(b["output_tensors"], got, strict=True):
                _copy_checked(t, v, c, "all_to_all")
            out.append((b["output_tensors"], done_work(b["output_tensors"])))
            continue
        want = b.get("output_split_sizes")
        if want and [int(s) for s in want] != [int(v.shape[0]) for v in got]:
            raise CollectiveMismatchError(
                f"all_to_all: rank {c.rank} expects {[int(s) for s in want]} rows from the ranks "
                f"{list(c.group)}, which send it {[int(v.shape[0]) for v in got]}"
            )
        whole = torch.cat(got)
        if c.impl == "c10d.alltoall_base_":
            _copy_checked(b["output"], whole, c, "all_to_all")
            out.append(done_work([b["output"]]))
        else:
            out.append(whole)
    return out


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, c: Call, op: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise CollectiveMismatchError(
            f"{op}: rank {c.rank}'s output buffer is {dims(dst)} but it receives {dims(src)}"
        )
    dst.copy_(src)


def _barrier(calls: list[Call]) -> list[Any]:
    return [None if c.impl == "c10d.monitored_barrier_" else done_work() for c in calls]


RUN = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "broadcast": _broadcast,
    "scatter": _scatter,
    "gather": _gather,
    "reduce": _reduce_to_root,
    "all_to_all": _all_to_all,
    "barrier": _barrier,
}


# --- point-to-point ----------------------------------------------------------------------------


@dataclass(eq=False)
class Message:
    """One send: global ranks, the group it went over, a copy of what the sender's buffer held."""

    id: int
    src: int
    dst: int
    tag: int
    group: tuple[int, ...]
    group_key: str
    value: torch.Tensor
    stamp: int = -1  # the run's clock when it was sent, then when it was received
    received: bool = False
