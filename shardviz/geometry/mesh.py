"""Mesh arithmetic on plain tuples: coordinates, ranks and the groups of each mesh dim.

Pure functions, so geometry and trace analysis work for any mesh size without a process group.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from itertools import product
from typing import cast

# (mesh shape, dim names, ranks in row-major order): a DeviceMesh as plain data.
MeshInfo = tuple[tuple[int, ...], tuple[str, ...] | None, tuple[int, ...]]


def check_mesh_shape(mesh_shape: object) -> tuple[int, ...]:
    """Validate a mesh shape given as an int or a sequence of positive ints."""
    if isinstance(mesh_shape, int):
        mesh_shape = (mesh_shape,)
    try:
        # Anything tuple() accepts (old-style __getitem__ sequences too); a TypeError says why not.
        dims = tuple(cast("Iterable[object]", mesh_shape))
    except TypeError:
        raise TypeError(f"mesh_shape must be a tuple of ints, not {type(mesh_shape).__name__}") from None
    if not dims:
        raise ValueError("mesh_shape is empty: a mesh needs at least one dimension")
    checked: list[int] = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"mesh_shape {dims}: every mesh dim must be a positive int")
        checked.append(d)
    return tuple(checked)


def coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """All mesh coordinates in row-major order (the order of ranks in a default mesh)."""
    return list(product(*(range(n) for n in mesh_shape)))


def size(mesh_shape: Sequence[int]) -> int:
    return math.prod(mesh_shape)


def dim_groups(mesh_shape: Sequence[int], dim: int, ranks: Sequence[int] | None = None) -> list[list[int]]:
    """Every group of ranks that communicates along mesh dim ``dim``, sorted.

    On a (4, 2) mesh, dim 1 gives ``[[0, 1], [2, 3], [4, 5], [6, 7]]`` and dim 0 gives
    ``[[0, 2, 4, 6], [1, 3, 5, 7]]``.
    """
    flat = list(ranks) if ranks is not None else list(range(size(mesh_shape)))
    strides = [math.prod(mesh_shape[i + 1 :]) for i in range(len(mesh_shape))]
    groups = []
    others = [range(n) if i != dim else range(1) for i, n in enumerate(mesh_shape)]
    for base in product(*others):
        start = sum(c * s for c, s in zip(base, strides, strict=True))
        groups.append(sorted(flat[start + k * strides[dim]] for k in range(mesh_shape[dim])))
    return sorted(groups)


def submesh_groups(
    world_shape: Sequence[int], dims: Sequence[int], ranks: Sequence[int] | None = None
) -> list[list[int]]:
    """Every instance of the sub-mesh that keeps mesh dims ``dims`` of a world mesh (a slice such
    as ``mesh["tp"]``, or a flatten of those dims), each as its global ranks in row-major order.

    Instances come in row-major order of the dims left out, as torch lists them: on a (2, 4) mesh,
    dims ``(1,)`` give ``[[0, 1, 2, 3], [4, 5, 6, 7]]`` and dims ``(0,)`` give
    ``[[0, 4], [1, 5], [2, 6], [3, 7]]``.
    """
    shape = check_mesh_shape(world_shape)
    keep = [int(d) % len(shape) for d in dims]
    if not keep or len(set(keep)) != len(keep) or keep != sorted(keep):
        raise ValueError(f"dims {list(dims)}: give distinct mesh dims of {shape}, in increasing order")
    flat = list(ranks) if ranks is not None else list(range(size(shape)))
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    rest = [d for d in range(len(shape)) if d not in keep]
    out = []
    for base in product(*(range(shape[d]) for d in rest)):
        start = sum(c * strides[d] for c, d in zip(base, rest, strict=True))
        out.append(
            [
                flat[start + sum(c * strides[d] for c, d in zip(pos, keep, strict=True))]
                for pos in product(*(range(shape[d]) for d in keep))
            ]
        )
    return out


def match_dim(
    groups: Sequence[Sequence[int]], mesh_shape: Sequence[int], ranks: Sequence[int] | None = None
) -> int | None:
    """The mesh dim whose groups are exactly ``groups``, or None."""
    return _match_dim(
        tuple(sorted(tuple(sorted(g)) for g in groups)),
        tuple(mesh_shape),
        tuple(ranks) if ranks is not None else None,
    )


@functools.lru_cache(maxsize=1024)
def _match_dim(
    want: tuple[tuple[int, ...], ...], mesh_shape: tuple[int, ...], ranks: tuple[int, ...] | None
) -> int | None:
    # Cached: every collective of every recording asks this of the same few meshes.
    for d in range(len(mesh_shape)):
        if [tuple(g) for g in dim_groups(mesh_shape, d, ranks)] == list(want):
            return d
    return None


def find_dim(
    groups: Sequence[Sequence[int]], meshes: Iterable[MeshInfo], name: str | None = None
) -> tuple[int | None, str | None]:
    """The (dim, dim name) whose groups are exactly ``groups``, on the first of ``meshes`` that
    has one; a dim called ``name`` (the name torch gives a mesh dim's group) wins a tie between
    meshes. No match: (None, ``name``), where a name is known and is not a bare ``dim_<i>``."""
    total = sum(len(g) for g in groups)
    for shape, names, ranks in meshes:
        if len(ranks) != total:
            continue
        d = match_dim(groups, shape, ranks)
        if d is not None and (name is None or (names and names[d] == name) or name == f"dim_{d}"):
            return d, names[d] if names else None
    return None, name if name and not name.startswith("dim_") else None


# The params key of a collective that user code called on the default process group (a raw
# ``dist.*`` call, no group or the world's): it ran on no mesh dim, even where a 1-D mesh of the
# whole world exists (torch gives that mesh the default group, so the groups alone cannot tell).
DEFAULT_GROUP = "default_group"


def group_dim_name(desc: str) -> str | None:
    """The mesh dim name in a process group's description: a DeviceMesh names the group of its dim
    ``tp`` ``mesh_tp``; ``mesh_default`` is the world's, not a dim's."""
    return desc[len("mesh_") :] if desc.startswith("mesh_") and desc != "mesh_default" else None


def tile_groups(group: Sequence[int], world_size: int) -> list[list[int]]:
    """Every group that runs a collective at once, from the group one rank passed.

    SPMD code on every rank names "its" group; the simulation sees rank 0's. The others are the
    same pattern shifted to each rank not yet covered (how LocalTensorMode runs it too). A group
    whose shifts do not tile the world is returned alone.
    """
    first = sorted(int(r) for r in group)
    if not first:
        return []
    rel = [r - first[0] for r in first]
    remaining = set(range(world_size))
    out: list[list[int]] = []
    while remaining:
        start = min(remaining)
        g = [start + r for r in rel]
        if not all(r in remaining for r in g):
            return [first]
        out.append(g)
        remaining.difference_update(g)
    return out
