"""Torch objects as the plain data a layout view draws: a ``Layout`` and each rank's values.

A DTensor gives its layout (pure geometry of its mesh and placements) and every rank's local
values as numpy arrays; a LocalTensor (per-rank values, no placements) gives its ranks' tensors
side by side; a per-rank tensor of hand-cut chunks is placed inside the global tensor it was cut
from. The front end (``shardviz.show``) hands the result to the views, which never see torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..geometry.chunks import chunk_layout, find_offset, resolve_offsets
from ..geometry.layout import Layout, ShardInfo, as_held
from ..geometry.layout import compute as compute_layout
from . import torch as _torch
from .recorder import to_numpy

# A layout, each rank's values (or None: geometry only), and the view's default options.
Drawn = tuple[Layout, dict[int, np.ndarray] | None, dict[str, Any]]


def values(tensors: Mapping[int, torch.Tensor]) -> dict[int, np.ndarray]:
    """Each rank's tensor as numpy, read outside any dispatch mode."""
    with _torch.no_dispatch():
        return {int(r): to_numpy(t) for r, t in tensors.items()}


def of_dtensor(dt: Any) -> Drawn:
    layout = held_layout(dt)
    drawn = of_sharded(layout, _torch.local_of(dt), "DTensor")
    if layout.notes:
        return drawn[0], drawn[1], {**drawn[2], "values_note": " ".join(layout.notes)}
    return drawn


def held_layout(dt: Any) -> Layout:
    """A DTensor's layout as its ranks hold it: its spec's geometry, unless the ranks' local
    tensors have other shapes (``DTensor.from_local(..., run_check=False, shape=...)`` of uneven
    pieces, a framework's conversion of its own uneven shards, or ``from_local`` of uneven pieces
    without ``shape=``, whose global shape then differs per rank): then the pieces they hold, with
    a note naming the disagreement (``geometry.layout.as_held``)."""
    local = _torch.local_tensors(_torch.local_of(dt))
    per_rank = _torch.dtensor_shape_per_rank(dt)
    if per_rank is not None:
        first = next(iter(per_rank.values()))
        spec = compute_layout(**_torch.dtensor_geometry(dt, first))
        held = {int(r): tuple(int(x) for x in t.shape) for r, t in (local or {}).items()}
        note = (
            f"this DTensor's global shape differs per rank ({dict(sorted(per_rank.items()))}): "
            "DTensor.from_local without shape= takes each rank's local shape times the mesh size, "
            "right only for even pieces, and any operator on it fails (pass shape= and stride=)."
        )
        return as_held(spec, held, note, whole=True)
    spec = compute_layout(**_torch.dtensor_geometry(dt))
    if local is None:  # a real rank, or a rank's thread: only its own piece to compare
        rank = _own_rank(spec)
        if rank is None:
            return spec
        return as_held(spec, {rank: tuple(int(x) for x in _torch.local_of(dt).shape)})
    return as_held(spec, {int(r): tuple(int(x) for x in t.shape) for r, t in local.items()})


def _own_rank(layout: Layout) -> int | None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        r = int(dist.get_rank())
        return r if r in layout.ranks else None
    return None


def of_sharded(layout: Layout, local: Any, kind: str) -> Drawn:
    """A sharded tensor's layout and each rank's values, from its local tensor (per rank in the
    simulator; on a real rank, only its own); ``kind`` names the tensor's type in a note."""
    per_rank = _torch.local_tensors(local)
    try:
        if per_rank is not None:
            return layout, values(per_rank), {}
        replicated = all(p == "R" for p in layout.placements)
        if replicated or layout.world_size == 1:
            # A Replicate-only DTensor may hold one plain tensor: every rank has the same values.
            same = values({0: local})[0]
            return layout, {r: same for r in layout.ranks}, {}
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return layout, None, {"values_note": f"values unavailable ({type(e).__name__}: {e}); geometry only"}
    return (
        layout,
        None,
        {
            "values_note": f"values unknown: this {kind} holds only this process's shard; inside a "
            "%%spmd cell sv.show gathers every rank's"
        },
    )


def of_local_tensor(lt: Any) -> Drawn:
    """Per-rank tensors side by side: concatenated along the last dim, one mesh cell per rank."""
    per_rank = _torch.local_tensors(lt)
    assert per_rank is not None
    vals = values(dict(sorted(per_rank.items())))
    ndims = {a.ndim for a in vals.values()}
    if len(ndims) != 1:
        raise ValueError(
            f"this LocalTensor's ranks hold tensors of different ranks (ndim {sorted(ndims)}); sv.show draws "
            "per-rank tensors side by side only when they have the same number of dims"
        )
    vals = {r: a.reshape(1) if a.ndim == 0 else a for r, a in vals.items()}
    nd = max(ndims.pop(), 1)
    ranks = tuple(vals)
    last = nd - 1
    starts = np.cumsum([0] + [a.shape[last] for a in vals.values()])
    lead = tuple(max(a.shape[d] for a in vals.values()) for d in range(last))
    shape = (*lead, int(starts[-1]))
    shards = []
    for i, (rank, a) in enumerate(vals.items()):
        indices = tuple(
            (range(int(starts[i]), int(starts[i + 1])),)
            if d == last
            else ((range(0, a.shape[d]),) if a.shape[d] else ())
            for d in range(nd)
        )
        indices = tuple(runs if all(len(r) for r in runs) else () for runs in indices)
        offset = tuple(int(starts[i]) if d == last else 0 for d in range(nd))
        shards.append(ShardInfo(rank=rank, coord=(i,), offset=offset, shape=a.shape, indices=indices))
    layout = Layout(
        global_shape=shape,
        dtype=_torch.dtype_name(lt.dtype),
        mesh_shape=(len(ranks),),
        mesh_dim_names=("rank",),
        placements=(f"S({last})",),
        shards=tuple(shards),
        mesh_ranks=ranks,
    )
    title = f"LocalTensor: {len(ranks)} ranks' tensors side by side along dim {last} (no placements)"
    return layout, vals, {"title": title}


def of_chunks(obj: Any, whole: Any, offsets: Any, who: str) -> Drawn:
    """Each rank's hand-made chunk (a per-rank tensor) drawn inside the global tensor ``whole``."""
    per_rank = _torch.local_tensors(obj)
    if per_rank is None:
        kind = "DTensor (it knows its placements: drop of=)" if _torch.is_dtensor(obj) else type(obj).__name__
        raise TypeError(
            f"{who}(chunk, of=global) needs a per-rank tensor (each rank's chunk, e.g. from "
            f"sv.per_rank(lambda rank: x.chunk(4)[rank])), not a {kind}"
        )
    if not isinstance(whole, torch.Tensor) or _torch.is_local_tensor(whole) or _torch.is_dtensor(whole):
        raise TypeError(f"{who}(..., of=...) takes the plain global tensor the chunks were cut from")
    chunks = values(dict(sorted(per_rank.items())))
    with _torch.no_dispatch():
        full = to_numpy(whole)
    given = resolve_offsets(offsets, sorted(chunks))
    found = given if given is not None else {r: find_offset(full, c, r) for r, c in chunks.items()}
    layout = chunk_layout(chunks, found, full.shape, _torch.dtype_name(whole.dtype))
    title = f"{len(chunks)} ranks' chunks of a {'×'.join(map(str, full.shape))} tensor (partitioned by hand)"
    return layout, chunks, {"title": title}
