"""Placements and meshes as plain data: torch placements to and from shardviz's, a DeviceMesh's
shape, names and rank groups (cached per mesh), the meshes alive, and a DTensor's geometry."""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from ...geometry.mesh import MeshInfo
from ...geometry.placement import Placement
from .gate import StridedShard, strided_split_factor
from .modes import active_local_mode, local_modes, no_dispatch
from .per_rank import symint_at_rank
from .tensors import dtype_name


def placement_to_plain(p: Any) -> Placement:
    """A torch placement as shardviz's plain Placement."""
    if isinstance(p, StridedShard):
        return Placement("strided", dim=int(p.dim), split_factor=strided_split_factor(p))
    if isinstance(p, Shard):
        return Placement("shard", dim=int(p.dim))
    if isinstance(p, Replicate):
        return Placement("replicate")
    if isinstance(p, Partial):
        return Placement("partial", reduce_op=str(p.reduce_op))
    raise TypeError(f"placement {p!r} ({type(p).__name__}) is not one shardviz knows how to draw")


def placement_from_plain(p: Placement) -> Any:
    """shardviz's plain Placement as a torch placement."""
    if p.kind == "shard":
        return Shard(p.dim)  # type: ignore[arg-type]
    if p.kind == "strided":
        return StridedShard(p.dim, split_factor=p.split_factor)
    if p.kind == "partial":
        return Partial(p.reduce_op)
    return Replicate()


_placement_names: dict[Any, tuple[str, ...]] = {}


def placements_str(placements: Sequence[Any]) -> tuple[str, ...]:
    """Placement strings of torch placements; memoised (placements are hashable and few)."""
    if type(placements) is tuple:  # a DTensor's own (its spec's): no copy to look it up
        try:
            hit = _placement_names.get(placements)
        except TypeError:  # an unhashable placement: handled below
            hit = None
        if hit is not None:
            return hit
    key = tuple(placements)
    try:
        return _placement_names[key]
    except KeyError:
        names = tuple(str(placement_to_plain(p)) for p in key)
        if len(_placement_names) < 4096:
            _placement_names[key] = names
        return names
    except TypeError:
        return tuple(str(placement_to_plain(p)) for p in key)


def _forget(cache: dict[int, Any], key: int) -> Callable[[object], object]:
    """A weakref callback that drops ``key`` from ``cache`` once the object it was cached for dies."""
    return lambda _: cache.pop(key, None)


# By id, with a weak reference to tell a reused id apart (DeviceMesh's own hash reads its tensor).
_mesh_infos: dict[int, tuple[weakref.ReferenceType[Any], MeshInfo]] = {}


def mesh_info(mesh: Any) -> MeshInfo:
    """(mesh shape, dim names, ranks in row-major order) of a DeviceMesh; cached per mesh, since
    reading the mesh tensor under the simulation costs milliseconds."""
    hit = _mesh_infos.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    # Both reads of the mesh tensor stay out of the user's dispatch modes: computing it runs aten
    # ops (eq, nonzero, item) that a CommDebugMode or DebugMode around the user's code would list.
    with no_dispatch():
        tensor = mesh.mesh
        ranks = tuple(int(r) for r in tensor.flatten().tolist())
        shape = tuple(int(s) for s in tensor.shape)
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    info = (shape, names, ranks)
    with contextlib.suppress(TypeError):
        key = id(mesh)
        _mesh_infos[key] = (weakref.ref(mesh, _forget(_mesh_infos, key)), info)
    return info


MeshGroups = tuple[tuple[int, ...], ...]
_mesh_groups: dict[int, tuple[weakref.ReferenceType[Any], MeshGroups]] = {}


def mesh_groups(mesh: Any) -> MeshGroups:
    """Every instance of a DeviceMesh in its world, each as global ranks in row-major order: one
    instance for a whole-world mesh, several for a sub-mesh (a slice or a flatten of a larger mesh:
    ``mesh["tp"]`` on a (2, 4) mesh gives ``((0, 1, 2, 3), (4, 5, 6, 7))``). Cached per mesh.

    ``mesh.mesh`` holds one instance only (rank 0's in the simulator, the calling rank's on a real
    backend); the mesh's CuTe layout over the root's rank map (``_layout``, ``_flatten_rank_map``,
    torch >= 2.13) lists them all, the same on every rank. A mesh without them gives its own.
    """
    hit = _mesh_groups.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    groups: MeshGroups | None = None
    layout = getattr(mesh, "_layout", None)
    flat = getattr(mesh, "_flatten_rank_map", None)
    if layout is not None and flat is not None and hasattr(layout, "remap_to_tensor"):
        try:
            with no_dispatch():
                full = layout.remap_to_tensor(torch.tensor([int(r) for r in flat], dtype=torch.int64))
                groups = tuple(tuple(int(r) for r in g) for g in full.reshape(full.shape[0], -1).tolist())
        except Exception:  # a layout torch itself cannot map: the mesh's own instance
            groups = None
    if not groups or len(groups[0]) != len(mesh_info(mesh)[2]):
        groups = (mesh_info(mesh)[2],)
    with contextlib.suppress(TypeError):
        key = id(mesh)
        _mesh_groups[key] = (weakref.ref(mesh, _forget(_mesh_groups, key)), groups)
    return groups


# Meshes seen alive, by id: their coordinates may be reused across simulated cells, and their
# dims name the groups of later collectives. Weak values: a dead mesh's id can be reused.
_live_meshes: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_mesh_births = 0


def _forget_coordinates(key: int) -> None:
    """A dead mesh's cached coordinates go with it. torch 2.13 keys LocalTensorMode's coordinate
    cache by ``id(mesh)``, which the next mesh can take while the simulation runs: a dead
    ``mesh["tp"]``'s coordinates then answered for a new ``mesh["dp"]``, whenever the garbage
    collector freed the first in between. (From 2.14 on the keys are no ints: nothing to drop.)"""
    for mode in local_modes():
        cache = getattr(mode, "_coordinate_cache", None)
        if isinstance(cache, dict):
            cache.pop(key, None)  # atomic: no lock, which a collection inside torch's may hold


def remember_mesh(mesh: Any) -> None:
    global _mesh_births
    if _live_meshes.get(id(mesh)) is mesh:
        return  # known: every recording notes its meshes again
    with contextlib.suppress(TypeError):  # a mesh that takes no weak reference is not kept
        _live_meshes[id(mesh)] = mesh
        weakref.finalize(mesh, _forget_coordinates, id(mesh))
        _mesh_births += 1


def mesh_generation() -> tuple[int, int]:
    """Changes whenever a mesh is remembered or freed: the key for what is derived from them."""
    return _mesh_births, len(_live_meshes)


def known_mesh_infos() -> list[MeshInfo]:
    return [mesh_info(m) for m in list(_live_meshes.values())]


def live_mesh_ids() -> frozenset[int]:
    """The ids of the meshes known alive now (to tell the ones a step builds from older ones)."""
    return frozenset(id(m) for m in list(_live_meshes.values()))


def meshes_since(before: frozenset[int]) -> list[tuple[tuple[int, ...], tuple[str, ...] | None, MeshGroups]]:
    """(shape, dim names, every instance's ranks) of each mesh known alive that was not in
    ``before``: the meshes a step built, and the ways they split the world."""
    out = []
    for m in list(_live_meshes.values()):
        if id(m) not in before:
            shape, names, _ = mesh_info(m)
            out.append((shape, names, mesh_groups(m)))
    return out


def reuse_local_mode(mode: Any) -> None:
    """Prepare a LocalTensorMode for another entry, keeping its cached mesh coordinates.

    torch 2.13 keys that cache by ``id(mesh)``, which a new mesh can reuse: those entries are kept
    only for meshes known to be alive. From 2.14 on the key is what the coordinates are computed
    from (ndim, flattened rank map, layout), so every entry stays true and is kept: dropping them
    would cost a 256-rank redistribute seconds per cell, and make a ``torch.compile`` trace
    recompute them on fake tensors, which fails.
    """
    cache = getattr(mode, "_coordinate_cache", None)
    if isinstance(cache, dict):
        for key in [k for k in cache if isinstance(k, int) and _live_meshes.get(k) is None]:
            del cache[key]


def dtensor_geometry(dt: Any, shape: Sequence[int] | None = None) -> dict[str, Any]:
    """What the pure layout function needs to describe a DTensor (``shape``: a global shape to use
    instead of the DTensor's own, which may differ per rank)."""
    spec = dt._spec
    order = None
    so = getattr(spec, "shard_order", None)
    if so and not getattr(spec, "use_strided_shard_as_shard_order", False):
        order = {int(e.tensor_dim): tuple(int(m) for m in e.mesh_dims) for e in so}
    return {**_spec_fields(spec, dt.shape if shape is None else shape, dt.dtype), "shard_order": order}


def spec_geometry(spec: Any) -> dict[str, Any] | None:
    """What the pure layout needs, from a DTensorSpec (as found in a sharding error's frames);
    None for a spec whose global shape differs per rank (``spec_shape_per_rank``)."""
    meta = getattr(spec, "tensor_meta", None)
    if meta is None or not hasattr(spec, "placements") or spec_shape_per_rank(spec) is not None:
        return None
    return _spec_fields(spec, meta.shape, meta.dtype)


def dtensor_shape_per_rank(dt: Any) -> dict[int, tuple[int, ...]] | None:
    """``spec_shape_per_rank`` of a DTensor's spec."""
    return spec_shape_per_rank(dt._spec)


def spec_shape_per_rank(spec: Any) -> dict[int, tuple[int, ...]] | None:
    """Each simulated rank's global shape of a DTensorSpec whose global shape differs per rank (a
    ``DTensor.from_local`` without ``shape=`` of uneven local tensors); None when it is one shape."""
    meta = getattr(spec, "tensor_meta", None)
    if meta is None:
        return None
    dims = [getattr(getattr(s, "node", None), "_local_ints", None) for s in meta.shape]
    if all(d is None for d in dims):
        return None
    ranks = sorted(next(d for d in dims if d is not None))
    return {
        r: tuple(
            int(d[r]) if d is not None else symint_at_rank(s, r)
            for d, s in zip(dims, meta.shape, strict=True)
        )
        for r in ranks
    }


def _spec_fields(spec: Any, shape: Any, dtype: torch.dtype) -> dict[str, Any]:
    mesh_shape, names, ranks = mesh_info(spec.mesh)
    groups = mesh_groups(spec.mesh)
    # A sub-mesh is laid out over every instance, group 0 first, the same on every rank.
    return {
        "global_shape": tuple(int(s) for s in shape),
        "dtype": dtype_name(dtype),
        "mesh_shape": mesh_shape,
        "mesh_dim_names": names,
        "mesh_ranks": groups[0] if len(groups) > 1 else ranks,
        "placements": placements_str(spec.placements),
        "groups": groups if len(groups) > 1 else None,
    }


@contextlib.contextmanager
def tracking_meshes() -> Iterator[None]:
    """Remember every DeviceMesh built while the simulation runs (sub-meshes too), so that its
    cached per-rank coordinates can be kept from cell to cell (see ``reuse_local_mode``)."""
    original = DeviceMesh.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        remember_mesh(self)
        # LocalTensorMode computes each rank's coordinates on a mesh's first use and caches them:
        # computed here, where real ranks compute theirs, its tensor ops do not show up later in a
        # CommDebugMode or DebugMode around the first DTensor op on the mesh.
        if active_local_mode() is not None:
            with contextlib.suppress(Exception):
                self.get_coordinate()

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]
