"""The ring reply: a ring all-reduce / all-gather / reduce-scatter's states step by step, with
which ranks' data each chunk holds and a few leading values per chunk, packed for the player."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..data import ring as _ring
from ..data.events import CollectiveEvent
from .buffers import check_json, snapshots_of

# Values per ring chunk sent with a ring reply (the view prints a few per chunk).
RING_VALUES = 6


def contributors(rg: _ring.Ring, op: str) -> list[list[list[int]]]:
    """Per ring state (initial, then after each step), per rank, per chunk: the bit mask of the
    group's ranks whose data the chunk holds (0: not there yet)."""
    n = rg.n
    if op == "all_gather":
        cur = [[(1 << k) if c == k else 0 for c in range(n)] for k in range(n)]
    else:
        cur = [[1 << k for _ in range(n)] for k in range(n)]
    pos = {r: i for i, r in enumerate(rg.group)}
    states = [[list(row) for row in cur]]
    for st in rg.steps:
        sent = {pos[dst]: (c, cur[pos[src]][c]) for src, dst, c in st.sends}
        for d, (c, mask) in sent.items():
            cur[d][c] = (cur[d][c] | mask) if st.phase == "reduce-scatter" else mask
        states.append([list(row) for row in cur])
    return states


def _first(a: np.ndarray | None, k: int) -> np.ndarray | None:
    if a is None:
        return None
    flat = np.asarray(a).reshape(-1)[:k]
    return np.real(flat).astype(np.float64) if flat.dtype.kind == "c" else flat.astype(np.float64)


def ring_reply(k: int, group: int, rg: _ring.Ring, e: CollectiveEvent) -> tuple[dict[str, Any], list[bytes]]:
    """The ring reply: per state (initial, after each step, then the ring's final result and the
    recorded output), per rank, per chunk, how many leading values are sent (``counts``, -1: the
    chunk is not there yet) and, in one buffer, those values packed in that order."""
    n, kv = rg.n, RING_VALUES
    states = [rg.initial, *[s.chunks for s in rg.steps]]
    rows = len(states) + 2
    counts = np.full((rows, n, n), -1, dtype=np.int64)
    packed: list[np.ndarray] = []
    sizes = [[0] * n for _ in range(n)]

    def put(si: int, i: int, c: int, arr: np.ndarray | None) -> None:
        f = _first(arr, kv)
        if f is not None:
            counts[si, i, c] = f.size
            packed.append(f)

    for si, state in enumerate(states):
        for i, r in enumerate(rg.group):
            for c, chunk in enumerate(state[r]):
                if chunk is not None:
                    sizes[i][c] = max(sizes[i][c], int(np.asarray(chunk).size))
                put(si, i, c, chunk)
    for i, r in enumerate(rg.group):  # the ring's final result, then what was recorded
        put(len(states), i, 0, rg.final.get(r))
    for i, r in enumerate(rg.group):
        put(len(states) + 1, i, 0, _recorded(e, r))
    values = np.concatenate(packed) if packed else np.zeros(0)
    wide = any(
        x.dtype.kind != "f" or x.dtype.itemsize > 4
        for x in (rg.final.get(r) for r in rg.group)
        if x is not None
    )
    fmt = "f8" if wide or e_dtype(e) in ("float64", "int64", "int32", "uint32", "uint64") else "f4"
    meta = {
        "step": k,
        "group": group,
        "op": rg.op,
        "reduce_op": rg.reduce_op,
        "ranks": list(rg.group),
        "n": n,
        "states": len(states),
        "phases": [s.phase for s in rg.steps],
        "sends": [[x for send in s.sends for x in send] for s in rg.steps],
        "contributors": [m for state in contributors(rg, rg.op) for row in state for m in row],
        "chunk_sizes": sizes,
        "counts": counts.reshape(-1).tolist(),
        "format": fmt,
        "final_sizes": [int(np.asarray(rg.final[r]).size) if r in rg.final else 0 for r in rg.group],
        "check": check_json(rg.check),
    }
    return meta, [np.ascontiguousarray(values, dtype="<f8" if fmt == "f8" else "<f4").tobytes()]


def e_dtype(e: CollectiveEvent) -> str:
    """The source dtype of a collective's buffers ("" when none is recorded)."""
    for per_rank in (e.inputs, e.outputs):
        for s in per_rank.values():
            snaps = snapshots_of(s)
            if snaps:
                return snaps[0].dtype
    return ""


def _recorded(e: CollectiveEvent, r: int) -> np.ndarray | None:
    s = e.outputs.get(r)
    snaps = snapshots_of(s)
    if not snaps or any(x.values is None for x in snaps):
        return None
    if len(snaps) == 1:
        return snaps[0].values
    return np.concatenate([np.asarray(x.values).reshape(-1) for x in snaps])
