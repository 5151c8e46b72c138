"""Plain-data preparation for the layout view, shared by the widget, matplotlib and HTML export.

Everything here reads a ``Layout`` and numpy arrays, never torch. The browser view gets the compact
geometry from :func:`payload` and draws it itself; matplotlib uses :func:`blocks` for the same
picture; values travel on demand through :func:`encode` as one binary buffer per request.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from ..data import describe
from ..data.describe import rank_list
from ..geometry.layout import Layout
from ..geometry.placement import parse

# Paul Tol's "muted" scheme: nine colours chosen to stay apart for the common colour-vision
# deficiencies. Ranks past nine reuse a colour with a different pattern, so that (colour, pattern)
# stays unique for 36 ranks, and every drawn region carries its rank number where it fits.
PALETTE = ("#CC6677", "#332288", "#DDCC77", "#117733", "#88CCEE", "#882255", "#44AA99", "#999933", "#AA4499")
TEXT_ON = ("#000000", "#FFFFFF", "#000000", "#FFFFFF", "#000000", "#FFFFFF", "#000000", "#000000", "#FFFFFF")
PATTERNS = ("solid", "diagonal", "dots", "cross")

# Blocks owned by more ranks than this are drawn as one aggregated region, not one stripe per rank.
MAX_STRIPES = 16
# Elements per values reply; larger arrays are sampled with a step per dim (the reply says which).
VALUES_LIMIT = 1 << 20


def delta_e(a: str, b: str) -> float:
    """CIE76 distance of two ``#rrggbb`` colours in CIELAB: a colour that encodes a state keeps 25 or
    more from every rank's colour, so that it never reads as a rank."""
    import numpy as np

    def lab(h: str) -> Any:
        c = np.array([int(h[i : i + 2], 16) for i in (1, 3, 5)], dtype=float) / 255
        c = np.where(c > 0.04045, ((c + 0.055) / 1.055) ** 2.4, c / 12.92)
        m = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
        xyz = m @ c / np.array([0.95047, 1.0, 1.08883])
        f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
        return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])

    return float(np.linalg.norm(lab(a) - lab(b)))


def rank_style(rank: int) -> tuple[str, str, str]:
    """(fill colour, text colour, pattern) of a rank: the same in every view."""
    i = rank % len(PALETTE)
    return PALETTE[i], TEXT_ON[i], PATTERNS[(rank // len(PALETTE)) % len(PATTERNS)]


def dim_labels(layout: Layout) -> list[str]:
    return [layout.dim_name(m) for m in range(len(layout.mesh_shape))]


def notes(layout: Layout) -> list[str]:
    """One line per mesh dim saying what its placement does, then uneven/empty shards.

    Written once here so the widget, the figure and the HTML export say the same thing.
    """
    labels = dim_labels(layout)
    lines = []
    if layout.groups:
        per = len(layout.groups[0])
        lines.append(
            f"sub-mesh: {len(layout.groups)} groups of {per} rank{'s' if per != 1 else ''}, each holding the "
            "whole tensor with its own values: "
            + "; ".join(f"group {i}: ranks {rank_list(grp)}" for i, grp in enumerate(layout.groups))
        )
    for m, text in enumerate(layout.placements):
        p = parse(text)
        n = layout.mesh_shape[m]
        head = f"{labels[m]} ({n}): {text}"
        if p.kind == "shard":
            lines.append(f"{head}: tensor dim {p.dim} split into {n} chunks")
        elif p.kind == "strided":
            lines.append(
                f"{head}: tensor dim {p.dim} split into {n} strided chunks (split factor "
                f"{p.split_factor}): shards hold non-contiguous rows"
            )
        elif p.kind == "partial":
            lines.append(f"{head}: hatched = partial values, pending {p.reduce_op} over {labels[m]}")
        else:
            lines.append(f"{head}: replicated, each element held by the {n} ranks along {labels[m]}")
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for s in layout.shards:
        by_shape.setdefault(s.shape, []).append(s.rank)
    if len(by_shape) > 1:
        parts = [
            f"{describe.extent(shape)} on rank(s) {rank_list(ranks)}" for shape, ranks in by_shape.items()
        ]
        lines.append("uneven shards: " + "; ".join(parts))
    empty = [s.rank for s in layout.shards if s.empty]
    if empty and layout.global_shape and 0 not in layout.global_shape:
        lines.append(f"empty shards (hold no elements): rank(s) {rank_list(empty)}")
    return lines


# A sub-mesh's groups are drawn side by side up to this many ranks in all; past it, one at a time.
MAX_SIDE_BY_SIDE = 16


def check_group(layout: Layout, group: int | None) -> int:
    """A group index of ``layout`` (0 when None), checked."""
    n = len(layout.instances)
    if group is None:
        return 0
    if isinstance(group, bool) or not isinstance(group, int | np.integer) or not 0 <= int(group) < n:
        raise ValueError(f"group={group!r}: this layout has group(s) 0..{n - 1}")
    return int(group)


def shown_groups(layout: Layout, group: int | None = None) -> list[int]:
    """The groups a view draws: all of them side by side when they fit, else ``group`` alone."""
    g = check_group(layout, group)
    if layout.world_size <= MAX_SIDE_BY_SIDE:
        return list(range(len(layout.instances)))
    return [g]


def partial_info(layout: Layout) -> dict[str, Any] | None:
    dims = [m for m, p in enumerate(layout.placements) if parse(p).kind == "partial"]
    if not dims:
        return None
    op = parse(layout.placements[dims[0]]).reduce_op
    return {"op": op, "mesh_dims": dims, "over": [layout.dim_name(m) for m in dims]}


def payload(layout: Layout) -> dict[str, Any]:
    """The geometry the browser view draws from: small JSON, no values.

    Runs are flat ``[start, stop, start, stop, ...]`` lists per tensor dim, so a 256-rank mesh
    costs a few kilobytes.
    """
    return {
        "global_shape": list(layout.global_shape),
        "dtype": layout.dtype,
        "mesh_shape": list(layout.mesh_shape),
        "mesh_dim_names": list(layout.mesh_dim_names) if layout.mesh_dim_names else None,
        "dim_labels": dim_labels(layout),
        "placements": list(layout.placements),
        "partial": partial_info(layout),
        "ranks": [s.rank for s in layout.shards],
        "coords": [list(s.coord) for s in layout.shards],
        "shapes": [list(s.shape) for s in layout.shards],
        "runs": [[[x for r in runs for x in (r.start, r.stop)] for runs in s.indices] for s in layout.shards],
        "notes": notes(layout),
        "palette": {"fill": list(PALETTE), "text": list(TEXT_ON), "patterns": list(PATTERNS)},
        "max_stripes": MAX_STRIPES,
        # Every instance of a sub-mesh (one for a whole-world mesh) and each shard's instance.
        "groups": [list(grp) for grp in layout.instances],
        "group_of": [s.group for s in layout.shards],
        "max_side_by_side": MAX_SIDE_BY_SIDE,
    }


# ---- which part of the global tensor is drawn -------------------------------------------------


def view_dims(ndim: int, dims: Sequence[int] | None = None) -> tuple[int | None, int | None]:
    """(row dim, column dim) drawn for a tensor of ``ndim`` dims; None where there is none.

    A 1-D tensor is a strip (one row), a 0-d one a single cell.
    """
    if ndim == 0:
        if dims not in (None, (), []):
            raise ValueError("a 0-d tensor has no dims to choose: leave dims unset")
        return None, None
    if ndim == 1:
        if dims not in (None, (), [], (0,), [0]):
            raise ValueError(
                f"dims={dims!r}: a 1-D tensor is drawn as a strip of its one dim; leave dims unset"
            )
        return None, 0
    if dims is None:
        return ndim - 2, ndim - 1
    d = [int(x) for x in dims]
    if len(d) != 2 or d[0] == d[1] or not all(-ndim <= x < ndim for x in d):
        raise ValueError(
            f"dims={dims!r}: give two different tensor dims to draw (rows, columns), each in 0..{ndim - 1}"
        )
    return d[0] % ndim, d[1] % ndim


def view_index(shape: Sequence[int], index: Sequence[int] | None = None) -> tuple[int, ...]:
    """Positions of the dims that are not drawn (the sliders); entries of drawn dims are ignored."""
    if index is None:
        return tuple(0 for _ in shape)
    idx = tuple(int(i) for i in index)
    if len(idx) != len(shape):
        raise ValueError(f"index={index!r}: give one position per tensor dim ({len(shape)})")
    for i, n in zip(idx, shape, strict=True):
        if not 0 <= i < max(n, 1):
            raise ValueError(f"index={index!r}: position {i} is outside a dim of size {n}")
    return idx


@dataclass(frozen=True, slots=True)
class Block:
    """A rectangle of the drawn slice whose elements all have the same owners."""

    row0: int
    row1: int
    col0: int
    col1: int
    owners: tuple[int, ...]


def _covers(runs: Sequence[range], i: int) -> bool:
    return any(i in r for r in runs)


def _cuts(n: int, runs_per_shard: list[tuple[range, ...]]) -> list[int]:
    cuts = {0, n}
    for runs in runs_per_shard:
        for r in runs:
            cuts.add(r.start)
            cuts.add(r.stop)
    return sorted(cuts)


def blocks(layout: Layout, dims: tuple[int | None, int | None], index: Sequence[int]) -> list[Block]:
    """The drawn 2-D slice cut into blocks of equal ownership (the same algorithm as layout.js).

    Shards that do not hold the slider position of an undrawn dim are not in this slice.
    """
    rd, cd = dims
    shape = layout.global_shape
    visible = [
        s
        for s in layout.shards
        if all(_covers(s.indices[d], index[d]) for d in range(len(shape)) if d not in (rd, cd))
    ]
    nrows = shape[rd] if rd is not None else 1
    ncols = shape[cd] if cd is not None else 1
    rcuts = _cuts(nrows, [s.indices[rd] for s in visible]) if rd is not None else [0, 1]
    ccuts = _cuts(ncols, [s.indices[cd] for s in visible]) if cd is not None else [0, 1]
    out = []
    for r0, r1 in pairwise(rcuts):
        rows = [s for s in visible if rd is None or _covers(s.indices[rd], r0)]
        for c0, c1 in pairwise(ccuts):
            owners = tuple(s.rank for s in rows if cd is None or _covers(s.indices[cd], c0))
            out.append(Block(r0, r1, c0, c1, owners))
    return out


# ---- values -----------------------------------------------------------------------------------


def check_values(layout: Layout, values: Mapping[int, Any] | None) -> dict[int, np.ndarray] | None:
    """Per-rank arrays checked against the layout: every key a rank, every shape its shard's."""
    if values is None:
        return None
    if not isinstance(values, Mapping):
        raise TypeError(f"values must be a mapping rank -> array, not {type(values).__name__}")
    out: dict[int, np.ndarray] = {}
    ranks = set(layout.ranks)
    for rank, v in values.items():
        if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or int(rank) not in ranks:
            raise ValueError(
                f"values has key {rank!r}, which is not a rank of this layout ({rank_list(ranks)})"
            )
        a = np.asarray(v)
        if a.dtype == object:
            raise TypeError(f"values[{rank}] is not a numeric array (dtype object)")
        want = layout.shard(int(rank)).shape
        if tuple(a.shape) != want:
            raise ValueError(
                f"values[{rank}] has shape {tuple(a.shape)}, but rank {rank}'s shard is {want}: pass each "
                "rank's local tensor (its shard), not the global tensor"
            )
        out[int(rank)] = a
    return out


def _index_arrays(indices: tuple[tuple[range, ...], ...]) -> tuple[np.ndarray, ...]:
    return tuple(
        np.concatenate([np.arange(r.start, r.stop) for r in runs]) if runs else np.zeros(0, dtype=np.int64)
        for runs in indices
    )


def global_values(layout: Layout, values: Mapping[int, np.ndarray], group: int = 0) -> np.ndarray:
    """The logical global tensor (what ``full_tensor()`` gives), assembled from per-rank shards.

    On a sub-mesh every group holds its own copy: ``group`` says whose (an index into
    ``layout.groups``).

    Replicated copies are read from coordinate 0 of each Replicate mesh dim; Partial values are
    reduced (sum, avg, max, min, product) over the Partial mesh dims. Elements no rank with values
    holds are NaN. Complex values stay complex, everything else becomes float64.
    """
    layout = layout.group_layout(group)
    complex_ = any(np.asarray(v).dtype.kind == "c" for v in values.values())
    out = np.zeros(layout.global_shape, dtype=np.complex128 if complex_ else np.float64)
    seen = np.zeros(layout.global_shape, dtype=np.int64)
    rep = [m for m, p in enumerate(layout.placements) if parse(p).kind == "replicate"]
    info = partial_info(layout)
    op = info["op"] if info else None
    for s in layout.shards:
        if s.rank not in values or s.empty or any(s.coord[m] != 0 for m in rep):
            continue
        v = np.asarray(values[s.rank]).astype(out.dtype)
        ix = np.ix_(*_index_arrays(s.indices)) if layout.global_shape else ()
        cur, n = out[ix], seen[ix]
        if op in ("max", "min"):
            f = np.maximum if op == "max" else np.minimum
            new = np.where(n > 0, f(cur, v), v)
        elif op == "product":
            new = np.where(n > 0, cur * v, v)
        else:
            new = np.where(n > 0, cur + v, v)
        out[ix] = new
        seen[ix] = n + 1
    if op == "avg":
        out = np.divide(out, np.maximum(seen, 1))
    out[seen == 0] = np.nan
    return out


def heat(values: np.ndarray) -> np.ndarray:
    """Real numbers to colour by: magnitude of complex values, 0/1 for bools."""
    a = np.asarray(values)
    if a.dtype.kind == "c":
        return np.abs(a)
    return a.astype(np.float64)


def encode(a: np.ndarray, dtype: str, limit: int = VALUES_LIMIT) -> tuple[dict[str, Any], bytes]:
    """One array as (metadata, little-endian bytes) for the browser.

    Formats: ``f4``/``f8`` (ints go as f8, exact up to 2**53), ``u1`` for bool, ``c8``/``c16`` as
    interleaved (re, im). An array over ``limit`` elements is sampled with ``step`` per dim.
    """
    a = np.asarray(a)
    source = list(a.shape)
    step = [1] * a.ndim
    while a.ndim and math.prod(math.ceil(n / s) for n, s in zip(source, step, strict=True)) > limit:
        d = max(range(a.ndim), key=lambda i: math.ceil(source[i] / step[i]))
        step[d] *= 2
    if any(s > 1 for s in step):
        a = a[tuple(slice(None, None, s) for s in step)]
    kind = a.dtype.kind
    if kind == "b":
        fmt, out = "u1", a.astype(np.uint8)
    elif kind == "f" and a.dtype.itemsize <= 4:
        fmt, out = "f4", a.astype("<f4")
    elif kind == "c":
        fmt, out = ("c8", a.astype("<c8")) if a.dtype.itemsize <= 8 else ("c16", a.astype("<c16"))
    else:
        fmt, out = "f8", a.astype("<f8")
    meta = {"shape": list(a.shape), "source_shape": source, "step": step, "format": fmt, "dtype": dtype}
    return meta, np.ascontiguousarray(out).tobytes()


def decode(meta: Mapping[str, Any], data: bytes) -> np.ndarray:
    """The inverse of :func:`encode` (tests, and any Python reader of the buffers)."""
    dt = {"u1": "<u1", "f4": "<f4", "f8": "<f8", "c8": "<c8", "c16": "<c16"}[meta["format"]]
    a = np.frombuffer(data, dtype=dt).reshape(meta["shape"])
    return a.astype(bool) if meta["format"] == "u1" else a
