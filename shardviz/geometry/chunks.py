"""Hand-partitioned tensors: each rank's plain chunk placed in the global tensor it came from.

Code that splits a tensor itself (``x.chunk(n)[rank]``, ceil-divided row ranges, blocks) has no
placements, but the picture is the same as for a DTensor: which rank holds which elements. Given
each rank's chunk and its global offset — or found by searching the global tensor for a unique
match — the chunks become a ``Layout`` whose mesh is the grid they tile (rows, columns or
blocks), so the layout view draws them like any other. Plain numpy: real ranks use it too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .layout import Layout, ShardInfo

# Beyond this many element comparisons, searching for a chunk's offset is too slow: ask for it.
SEARCH_LIMIT = 50_000_000

Offsets = Mapping[int, Sequence[int]] | Sequence[Sequence[int]] | Callable[[int], Sequence[int]]


def find_offset(whole: np.ndarray, chunk: np.ndarray, rank: int) -> tuple[int, ...]:
    """Where ``chunk`` sits in ``whole``: the unique position whose window equals it exactly."""
    if chunk.ndim != whole.ndim:
        raise ValueError(
            f"rank {rank}'s chunk has {chunk.ndim} dim(s), the global tensor {whole.ndim}: "
            "a chunk must be a block of the global tensor"
        )
    if any(c > w for c, w in zip(chunk.shape, whole.shape, strict=True)):
        raise ValueError(f"rank {rank}'s chunk {chunk.shape} is larger than the global tensor {whole.shape}")
    if chunk.size == 0:
        return tuple(w if c == 0 else 0 for c, w in zip(chunk.shape, whole.shape, strict=True))
    if whole.size * chunk.size > SEARCH_LIMIT:
        raise ValueError(
            f"searching a {whole.shape} tensor for rank {rank}'s {chunk.shape} chunk is too slow: "
            "pass offsets= (each rank's global offset)"
        )
    windows = np.lib.stride_tricks.sliding_window_view(whole, chunk.shape)
    axes = tuple(range(whole.ndim, 2 * whole.ndim))
    hits = np.argwhere(np.all(windows == chunk, axis=axes))
    if len(hits) == 1:
        return tuple(int(i) for i in hits[0])
    places = ", ".join(str(tuple(int(i) for i in h)) for h in hits[:3])
    where = "nowhere" if len(hits) == 0 else f"at {len(hits)} places ({places}, ...)"
    raise ValueError(
        f"rank {rank}'s chunk {chunk.shape} matches the global tensor {where}; pass offsets= to say where "
        "each rank's chunk sits, e.g. offsets={rank: (row, col)} or offsets=lambda rank: (rank * 3, 0)"
    )


def resolve_offsets(offsets: Offsets | None, ranks: Sequence[int]) -> dict[int, tuple[int, ...]] | None:
    if offsets is None:
        return None
    if callable(offsets):
        return {r: tuple(int(x) for x in offsets(r)) for r in ranks}
    if isinstance(offsets, Mapping):
        missing = [r for r in ranks if r not in offsets]
        if missing:
            raise ValueError(f"offsets= has no entry for rank(s) {missing}")
        return {r: tuple(int(x) for x in offsets[r]) for r in ranks}
    seq = list(offsets)
    if len(seq) < len(ranks):
        raise ValueError(f"offsets= lists {len(seq)} offsets for {len(ranks)} ranks")
    return {r: tuple(int(x) for x in seq[r]) for r in ranks}


def chunk_layout(
    chunks: Mapping[int, np.ndarray],
    offsets: Mapping[int, Sequence[int]],
    global_shape: Sequence[int],
    dtype: str,
) -> Layout:
    """The Layout of hand-made chunks: a mesh with one dim per tensor dim the chunks split.

    Row-wise chunks give a 1-D mesh ``S(0)``, column-wise ``S(1)``, blocks a 2-D mesh
    ``[S(0), S(1)]``; chunk sizes are the real ones (an uneven last chunk stays uneven).
    """
    ranks = sorted(chunks)
    shape = tuple(int(s) for s in global_shape)
    for r in ranks:
        off, ch = offsets[r], chunks[r].shape
        if len(off) != len(shape) or any(o < 0 or o + c > g for o, c, g in zip(off, ch, shape, strict=True)):
            raise ValueError(f"rank {r}'s chunk {tuple(ch)} at offset {tuple(off)} does not fit in {shape}")
    # The tensor dims along which the chunks start at different places are the split dims.
    split = [d for d in range(len(shape)) if len({offsets[r][d] for r in ranks if chunks[r].size}) > 1]
    starts = {d: sorted({offsets[r][d] for r in ranks if chunks[r].size}) for d in split}
    coords: dict[int, tuple[int, ...]] = {}
    for r in ranks:
        if chunks[r].size:
            coords[r] = tuple(starts[d].index(offsets[r][d]) for d in split)
    mesh_shape = tuple(len(starts[d]) for d in split) or (len(ranks),)
    # Empty chunks go after the others, on the first split dim, like DTensor's empty shards.
    taken = set(coords.values())
    if not split:
        coords = {r: (i,) for i, r in enumerate(ranks)}
    else:
        empties = [r for r in ranks if r not in coords]
        if empties and len(split) == 1:  # e.g. 5 rows over 4 ranks: the last rank holds none
            mesh_shape = (mesh_shape[0] + len(empties),)
        spare = [c for c in np.ndindex(*mesh_shape) if c not in taken]
        if len(empties) > len(spare) or len(set(coords.values())) != len(coords):
            raise ValueError(
                "these chunks do not tile the global tensor as a grid of rows, columns or blocks (two "
                "ranks start at the same place, or the starts do not form a grid); sv.show draws "
                "row-, column- and block-wise partitions"
            )
        for r, c in zip(empties, spare, strict=False):
            coords[r] = tuple(int(x) for x in c)
        if len(coords) != int(np.prod(mesh_shape)):
            raise ValueError(
                f"{len(ranks)} chunks do not fill a {mesh_shape} grid of blocks: sv.show draws row-, column- "
                "and block-wise partitions where every block has a rank"
            )
    by_coord = {c: r for r, c in coords.items()}
    mesh_ranks = tuple(by_coord[c] for c in sorted(by_coord))
    shards = []
    for r in mesh_ranks:
        chunk, start = chunks[r], offsets[r]
        indices = tuple(((range(o, o + c),) if c else ()) for o, c in zip(start, chunk.shape, strict=True))
        shards.append(
            ShardInfo(
                rank=r,
                coord=coords[r],
                offset=tuple(int(o) for o in start),
                shape=tuple(chunk.shape),
                indices=indices,
            )
        )
    placements = tuple(f"S({d})" for d in split) or ("R",)
    return Layout(
        global_shape=shape,
        dtype=dtype,
        mesh_shape=mesh_shape,
        mesh_dim_names=tuple(f"split dim {d}" for d in split) or ("rank",),
        placements=placements,
        shards=tuple(shards),
        mesh_ranks=mesh_ranks,
    )
