"""The data flow of each collective: what moves from which rank to which, and what it computes.

A model per op, applied to a recorded event's per-rank inputs, predicts its outputs; comparing
with the recorded outputs checks the simulation (or a real run) against the op's semantics, and
the list of transfers is what the player draws as arrows. Pure numpy: works on saved traces.

Chunk conventions follow the buffers torch passes to the collective (uneven shards arrive padded):
tensor-valued all_gather concatenates along dim 0, reduce_scatter splits dim 0, DTensor's
``shard_dim_alltoall`` concatenates along ``gather_dim`` and splits ``shard_dim``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .events import CollectiveEvent, Event, TensorSnapshot

Buffer = np.ndarray | list[np.ndarray]


@dataclass(frozen=True, slots=True)
class Transfer:
    """One piece of data moving from ``src`` to ``dst`` (global ranks).

    ``src_part`` / ``dst_part`` name the chunk (or list slot) of the source / destination buffer,
    None for the whole buffer; ``reduce`` marks data combined with the reduce op on arrival.
    """

    src: int
    dst: int
    src_part: int | None = None
    dst_part: int | None = None
    reduce: bool = False


@dataclass(frozen=True, slots=True)
class FlowCheck:
    """Predicted vs recorded outputs: ``ok``, and per rank the largest absolute difference."""

    ok: bool
    checked: bool
    max_error: dict[int, float]
    note: str = ""


def transfers(event: CollectiveEvent) -> list[Transfer]:
    """What the collective moves, group by group, in a fixed order (for drawing)."""
    out: list[Transfer] = []
    op, root = event.op, event.root
    for g in event.groups:
        n = len(g)
        pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
        if op == "all_gather":
            out += [Transfer(g[i], g[j], None, i) for i, j in pairs]
        elif op == "reduce_scatter":
            out += [Transfer(g[i], g[j], j, None, True) for i, j in pairs]
        elif op == "all_reduce":
            out += [Transfer(g[i], g[j], None, None, True) for i, j in pairs]
        elif op == "all_to_all":
            out += [Transfer(g[i], g[j], j, i) for i, j in pairs]
        elif op in ("send", "recv") and n == 2 and root in (0, 1):
            # a pair: send's root is the destination, recv's the source
            src, dst = (g[1 - root], g[root]) if op == "send" else (g[root], g[1 - root])
            out.append(Transfer(src, dst))
        elif root is None or root >= n:
            continue
        elif op == "broadcast":
            out += [Transfer(g[root], g[j]) for j in range(n) if j != root]
        elif op == "scatter":
            out += [Transfer(g[root], g[j], j, None) for j in range(n) if j != root]
        elif op == "gather":
            out += [Transfer(g[i], g[root], None, i) for i in range(n) if i != root]
        elif op == "reduce":
            out += [Transfer(g[i], g[root], None, None, True) for i in range(n) if i != root]
    return out


def reduce(op: str | None, arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Combine buffers with a c10d reduce op (floats in float64, so the order does not matter)."""
    if not arrays:
        raise ValueError("nothing to reduce")
    dtype = arrays[0].dtype
    stack = np.stack([a.astype(np.float64) if dtype.kind == "f" else a for a in arrays])
    name = (op or "sum").lower()
    if name in ("sum", "avg"):
        r = stack.sum(axis=0)
        if name == "avg":
            r = r / len(arrays) if dtype.kind in "fc" else r // len(arrays)
    elif name == "product":
        r = stack.prod(axis=0)
    elif name == "max":
        r = stack.max(axis=0)
    elif name == "min":
        r = stack.min(axis=0)
    elif name == "band":
        r = np.bitwise_and.reduce(stack, axis=0)
    elif name == "bor":
        r = np.bitwise_or.reduce(stack, axis=0)
    elif name == "bxor":
        r = np.bitwise_xor.reduce(stack, axis=0)
    else:
        raise ValueError(f"reduce op {op!r} has no model here")
    return r.astype(dtype)


def _values(snap: TensorSnapshot | list[TensorSnapshot] | None) -> Buffer | None:
    if snap is None:
        return None
    if isinstance(snap, list):
        vals = [s.values for s in snap]
        return None if any(v is None for v in vals) else vals  # type: ignore[return-value]
    return snap.values


def _chunks(a: np.ndarray, sizes: Sequence[int] | None, n: int, axis: int = 0) -> list[np.ndarray]:
    if sizes:
        return np.split(a, np.cumsum(sizes)[:-1], axis=axis)
    step = a.shape[axis] // n if n else 0
    return [np.take(a, range(i * step, (i + 1) * step), axis=axis) for i in range(n)]


def _one(buf: Buffer) -> np.ndarray:
    return buf[0] if isinstance(buf, list) else buf


def predict(event: CollectiveEvent) -> dict[int, Buffer] | None:
    """Each rank's output as the op's semantics compute it from the recorded inputs.

    None when the inputs' values were not kept (value policy) or the op has no model (send,
    barrier, a recv recorded without its pair). Ranks whose output the op leaves undefined
    (non-roots of gather/reduce) are absent.
    """
    op, root, p = event.op, event.root, event.params
    if event.reduce_op == "premul_sum":
        return None  # the factor is not in the trace
    ins: dict[int, Buffer] = {}
    for r, s in event.inputs.items():
        v = _values(s)
        if v is None:
            return None
        ins[r] = v
    out: dict[int, Buffer] = {}
    for g in event.groups:
        n = len(g)
        listed_out = isinstance(event.outputs.get(g[0]), list)
        src_rank = -1  # a rooted op's root, as a global rank
        if op in ("broadcast", "scatter", "gather", "reduce"):
            if root is None or root >= n:
                return None
            src_rank = g[root]
        if op == "recv" and n == 2 and root in (0, 1):
            if g[root] not in ins:
                return None
            out[g[1 - root]] = ins[g[root]]  # what arrives is what the source sent
            continue
        if op not in ("broadcast", "scatter") and any(r not in ins for r in g):
            return None
        if op == "all_gather":
            if listed_out:  # all_gather(list, t): one slot per member
                for r in g:
                    out[r] = [_one(ins[q]) for q in g]
            else:
                cat = np.concatenate([_one(ins[q]) for q in g], axis=0)
                for r in g:
                    out[r] = cat
        elif op == "all_reduce":
            if isinstance(ins[g[0]], list):  # coalesced: each tensor of the list reduced
                k = len(ins[g[0]])
                red = [reduce(event.reduce_op, [ins[q][i] for q in g]) for i in range(k)]
                for r in g:
                    out[r] = red
            else:
                total = reduce(event.reduce_op, [_one(ins[q]) for q in g])
                for r in g:
                    out[r] = total
        elif op == "reduce_scatter":
            if isinstance(ins[g[0]], list):  # reduce_scatter(out, list): member j reduces slot j
                for j, r in enumerate(g):
                    out[r] = reduce(event.reduce_op, [ins[q][j] for q in g])
            else:
                chunked = {q: _chunks(_one(ins[q]), None, n) for q in g}
                for j, r in enumerate(g):
                    out[r] = reduce(event.reduce_op, [chunked[q][j] for q in g])
        elif op == "all_to_all":
            if "gather_dim" in p and "shard_dim" in p:  # DTensor's shard_dim_alltoall
                cat = np.concatenate([_one(ins[q]) for q in g], axis=p["gather_dim"])
                pieces = _chunks(cat, None, n, axis=p["shard_dim"])
                for j, r in enumerate(g):
                    out[r] = pieces[j]
            elif isinstance(ins[g[0]], list):  # all_to_all(list, list): slot i of j <- slot j of i
                for j, r in enumerate(g):
                    out[r] = [ins[q][j] for q in g]
            else:
                sizes = p.get("input_split_sizes") or None
                if sizes and any(sum(sizes) != _one(ins[q]).shape[0] for q in g):
                    return None  # split sizes that differ by rank: the event keeps one rank's
                chunked = {q: _chunks(_one(ins[q]), sizes, n) for q in g}
                for j, r in enumerate(g):
                    out[r] = np.concatenate([chunked[q][j] for q in g], axis=0)
        elif op == "broadcast":
            if src_rank not in ins:
                return None
            for r in g:
                out[r] = ins[src_rank]
        elif op == "scatter":
            if src_rank not in ins:
                return None
            src = ins[src_rank]
            parts = src if isinstance(src, list) else _chunks(src, None, n)
            for j, r in enumerate(g):
                out[r] = parts[j]
        elif op == "gather":
            out[src_rank] = [_one(ins[q]) for q in g]
        elif op == "reduce":
            out[src_rank] = reduce(event.reduce_op, [_one(ins[q]) for q in g])
        else:
            return None
    return out


# Relative and absolute tolerances by original dtype: summation order differs between the
# model (float64) and the collective, so floats are compared with allclose.
_TOLERANCE = {
    "float64": (1e-10, 1e-12),
    "float32": (2e-5, 1e-6),
    "float16": (2e-3, 1e-3),
    "bfloat16": (2e-2, 1e-2),
}


def tolerance(dtype: str) -> tuple[float, float] | None:
    """(rtol, atol) for float dtypes; None means exact (integers, bool)."""
    if dtype.startswith("float8"):
        return (0.15, 0.1)
    if dtype == "complex64":
        return _TOLERANCE["float32"]
    if dtype == "complex128":
        return _TOLERANCE["float64"]
    return _TOLERANCE.get(dtype)


def compare(expected: np.ndarray, actual: np.ndarray, dtype: str, n: int = 1) -> float | None:
    """The largest absolute difference if ``actual`` matches ``expected`` for ``dtype`` (exact for
    integers and bool; allclose for floats, tolerances scaled by the ``n`` buffers combined), else None."""
    if expected.shape != actual.shape:
        return None
    if expected.size == 0:
        return 0.0
    tol = tolerance(dtype)
    if tol is None:
        if not np.array_equal(expected, actual):
            return None
        return 0.0
    exp = expected.astype(np.complex128 if expected.dtype.kind == "c" else np.float64)
    act = actual.astype(np.complex128 if actual.dtype.kind == "c" else np.float64)
    rtol, atol = tol
    if not np.allclose(act, exp, rtol=rtol * n, atol=atol * n, equal_nan=True):
        return None
    finite = np.isfinite(exp) & np.isfinite(act)
    return float(np.max(np.abs(exp - act)[finite])) if finite.any() else 0.0


def _dtype(snap: TensorSnapshot | list[TensorSnapshot] | None) -> str:
    if isinstance(snap, list):
        return snap[0].dtype if snap else "float32"
    return snap.dtype if snap is not None else "float32"


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    return float(np.nanmax(np.abs(a.astype(np.complex128) - b.astype(np.complex128))))


def _unchecked(event: CollectiveEvent) -> str:
    """Why ``predict`` had nothing to compare, in words."""
    if event.op == "barrier":
        return "nothing to check: a barrier moves no data"
    if event.op == "send":
        return "checked at the matching recv, where the data arrives"
    snaps = [x for s in (*event.inputs.values(), *event.outputs.values()) for x in _listed(s)]
    if snaps and any(x.values is None for x in snaps):
        return "not checked: values not kept (value policy)"
    return "not checked: the recorded buffers do not say what this op should produce"


def _listed(s: Any) -> list[Any]:
    return list(s) if isinstance(s, list) else [s]


def check(event: CollectiveEvent) -> FlowCheck:
    """Does the model applied to the recorded inputs reproduce the recorded outputs?"""
    pred = predict(event)
    if pred is None:
        return FlowCheck(True, False, {}, _unchecked(event))
    errors: dict[int, float] = {}
    ok = True
    n = max(event.group_size, 1)
    for r, want in pred.items():
        snap = event.outputs.get(r)
        got = _values(snap)
        if got is None:
            continue
        wants = want if isinstance(want, list) else [want]
        gots = got if isinstance(got, list) else [got]
        if isinstance(want, list) != isinstance(got, list) or len(wants) != len(gots):
            ok, errors[r] = False, float("inf")
            continue
        worst = 0.0
        for w, a in zip(wants, gots, strict=True):
            d = compare(np.asarray(w), np.asarray(a), _dtype(snap), n)
            if d is None:
                ok = False
                worst = max(worst, _max_diff(np.asarray(w), np.asarray(a)))
            else:
                worst = max(worst, d)
        errors[r] = worst
    note = "" if ok else "the recorded outputs differ from what the op's semantics give for these inputs"
    return FlowCheck(ok, True, errors, note)


def check_trace(events: Iterable[Event]) -> dict[int, FlowCheck]:
    """``check`` for every collective of a trace (or any iterable of events), by event id."""
    return {e.id: check(e) for e in events if isinstance(e, CollectiveEvent)}
