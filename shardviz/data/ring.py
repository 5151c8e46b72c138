"""The ring algorithm behind all_reduce, all_gather and reduce_scatter, on the recorded buffers.

Libraries like NCCL and gloo move data around a ring of the group's ranks: ``n - 1`` steps of
reduce-scatter (each rank passes one chunk to its neighbour, which adds it to its own), then, for
all_reduce, ``n - 1`` steps of all-gather (the finished chunks travel on). The steps are
synthesised here from a collective's real per-rank inputs, and the end state is compared with the
recorded outputs: equal for integers, close for floats (the summation order differs), and a
mismatch is reported, not raised, so a student can see it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .events import CollectiveEvent, TensorSnapshot
from .flow import FlowCheck, compare, reduce

RING_OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True, slots=True)
class RingStep:
    """One step: every rank sends one chunk to the next rank of the ring at the same time."""

    index: int
    phase: str  # "reduce-scatter" or "all-gather"
    sends: tuple[tuple[int, int, int], ...]  # (from rank, to rank, chunk index)
    chunks: dict[int, tuple[np.ndarray | None, ...]]  # every rank's chunks after the step


@dataclass(frozen=True, slots=True)
class Ring:
    """The ring schedule of one group of one collective, from its inputs to its final state."""

    op: str
    group: tuple[int, ...]
    reduce_op: str | None
    initial: dict[int, tuple[np.ndarray | None, ...]]
    steps: tuple[RingStep, ...]
    final: dict[int, np.ndarray]
    check: FlowCheck

    @property
    def n(self) -> int:
        return len(self.group)


def _snap_values(s: TensorSnapshot | list[TensorSnapshot] | None) -> np.ndarray | None:
    if isinstance(s, list):
        return s[0].values if len(s) == 1 else None
    return s.values if s is not None else None


def rings(event: CollectiveEvent) -> list[Ring]:
    """The ring of every group of ``event`` (empty when the op has no ring or values were not kept)."""
    if event.op not in RING_OPS:
        return []
    out = []
    for g in event.groups:
        r = _ring(event, tuple(g))
        if r is not None:
            out.append(r)
    return out


def ring(event: CollectiveEvent, group: int = 0) -> Ring | None:
    """The ring of one group (by index in ``event.groups``), or None."""
    if event.op not in RING_OPS or not 0 <= group < len(event.groups):
        return None
    return _ring(event, tuple(event.groups[group]))


def _ring(event: CollectiveEvent, g: tuple[int, ...]) -> Ring | None:
    n = len(g)
    ins: dict[int, np.ndarray] = {}
    for r in g:
        v = _snap_values(event.inputs.get(r))
        if v is None:
            return None
        ins[r] = v
    if n == 0:
        return None
    op = event.op
    red = event.reduce_op or "sum"
    # Chunks: an all_reduce ring cuts the flat buffer into n pieces; reduce_scatter's input is n
    # equal pieces along dim 0 (already padded); all_gather starts with one piece per rank.
    state: dict[int, list[np.ndarray | None]] = {}
    if op == "all_reduce":
        for r in g:
            state[r] = list(np.array_split(ins[r].reshape(-1), n))
    elif op == "reduce_scatter":
        for r in g:
            a = ins[r]
            size = a.shape[0] // n
            state[r] = [a[i * size : (i + 1) * size] for i in range(n)]
    else:
        for k, r in enumerate(g):
            state[r] = [ins[r] if i == k else None for i in range(n)]
    # Reduction in float64 where the values are floats, as flow.reduce does.
    avg = red == "avg"
    step_op = "sum" if avg else red
    initial = {r: tuple(c) for r, c in state.items()}
    steps: list[RingStep] = []

    def run(phase: str, chunk_of: Callable[[int, int], int], combine: bool) -> None:
        for s in range(n - 1):
            sends: list[tuple[int, int, int]] = []
            sent: dict[int, tuple[int, np.ndarray | None]] = {}
            for k in range(n):
                c = chunk_of(k, s) % n
                sends.append((g[k], g[(k + 1) % n], c))
                sent[g[(k + 1) % n]] = (c, state[g[k]][c])
            for dst, (c, data) in sent.items():
                own = state[dst][c]
                if combine and own is not None:
                    assert data is not None  # a reducing ring starts with every chunk on every rank
                    state[dst][c] = reduce(step_op, [own, data])
                else:
                    state[dst][c] = data
            steps.append(RingStep(len(steps), phase, tuple(sends), {r: tuple(v) for r, v in state.items()}))

    if op == "all_reduce":
        run("reduce-scatter", lambda k, s: k - s, True)
        run("all-gather", lambda k, s: k + 1 - s, False)
    elif op == "reduce_scatter":
        run("reduce-scatter", lambda k, s: k - s - 1, True)
    else:
        run("all-gather", lambda k, s: k - s, False)

    final: dict[int, np.ndarray] = {}
    for k, r in enumerate(g):
        chunks = state[r]
        if op == "all_reduce":
            flat: np.ndarray = np.concatenate(_filled(chunks))
            if avg:
                flat = flat / n if flat.dtype.kind in "fc" else flat // n
            final[r] = flat.reshape(ins[r].shape).astype(ins[r].dtype)
        elif op == "reduce_scatter":
            mine: np.ndarray = _filled(chunks)[k]
            if avg:
                mine = mine / n if mine.dtype.kind in "fc" else mine // n
            final[r] = np.asarray(mine).astype(ins[r].dtype)
        else:
            final[r] = np.concatenate(_filled(chunks), axis=0)
    return Ring(op, g, event.reduce_op, initial, tuple(steps), final, _check(event, final, n))


def _filled(chunks: list[np.ndarray | None]) -> list[np.ndarray]:
    """A rank's chunks once the ring has run: every one is there by then."""
    out = [c for c in chunks if c is not None]
    assert len(out) == len(chunks), "the ring left a chunk empty"
    return out


def _check(event: CollectiveEvent, final: dict[int, np.ndarray], n: int) -> FlowCheck:
    errors: dict[int, float] = {}
    ok = True
    checked = False
    for r, mine in final.items():
        snap = event.outputs.get(r)
        got = _snap_values(snap)
        if isinstance(snap, list) and event.op == "all_gather":
            vals = [s.values for s in snap if s.values is not None]
            got = np.concatenate(vals, axis=0) if len(vals) == len(snap) else None
        if got is None:
            continue
        assert snap is not None  # values came from it
        checked = True
        dtype = (snap[0] if isinstance(snap, list) else snap).dtype
        d = compare(mine, np.asarray(got).reshape(mine.shape) if got.size == mine.size else got, dtype, n)
        if d is None:
            ok = False
            same = got.size == mine.size
            errors[r] = (
                float(np.nanmax(np.abs(mine.astype(np.float64) - got.reshape(mine.shape))))
                if same
                else float("inf")
            )
        else:
            errors[r] = d
    note = "" if ok else "the ring's result differs from the recorded output"
    return FlowCheck(ok, checked, errors, note if checked else "not checked: outputs not kept")
