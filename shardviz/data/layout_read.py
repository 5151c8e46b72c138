"""Reading a layout from its dict in trace.json: placements that parse, shards on the mesh, indices
within the global shape, so that a view can draw what it reads.

Also the field checks a trace's other decoders share with it (a field by name, a shape, ranks of a
world); ``trace_read`` decodes the rest of the file with them. Errors are ``limits.Bad``, which
``trace_read`` turns into a ``TraceFileError`` naming the file and the field.
"""

from __future__ import annotations

import math
from typing import Any

from ..geometry.layout import Layout, ShardInfo
from .limits import Bad, array, mapping, shape, string


def checked(name: str, d: dict[str, Any], decode: Any, *args: Any) -> Any:
    """``decode(d[name])``, its errors naming the field."""
    if name not in d:
        raise Bad("a value (the field is missing)", None, name)
    try:
        return decode(d[name], *args)
    except Bad as e:
        raise e.at(name) from None


def fields(d: Any, *names: str) -> list[Any]:
    """The named fields of an object (the hot path of decoding: no call per field)."""
    if type(d) is not dict:
        raise Bad("an object", d)
    try:
        return [d[n] for n in names]
    except KeyError as e:
        raise Bad("a value (the field is missing)", None, e.args[0]) from None


def shape_at(v: Any, name: str) -> tuple[int, ...]:
    try:
        return shape(v)
    except Bad as e:
        raise e.at(name) from None


def str_tuple(v: Any) -> tuple[str, ...]:
    if type(v) is not list or any(type(x) is not str for x in v):
        raise Bad("a list of strings", v)
    return tuple(v)


def rank_list(v: Any, world_size: int) -> tuple[int, ...]:
    """Distinct ranks of this world."""
    if type(v) is not list:
        raise Bad(f"a list of ranks in 0..{world_size - 1}", v)
    for r in v:
        if type(r) is not int or not 0 <= r < world_size:
            raise Bad(f"a list of ranks in 0..{world_size - 1}", v)
    t = tuple(v)
    if len(set(t)) != len(t):
        raise Bad("a list of distinct ranks", v)
    return t


def decode_layout(v: Any) -> Layout:
    """A Layout from its dict, checked so that views can draw it: placements that parse, one per
    mesh dim; shards with coordinates on the mesh and indices within the global shape."""
    from ..geometry.placement import parse

    d = mapping(v)
    gshape = checked("global_shape", d, shape)
    mesh = checked("mesh_shape", d, shape)
    if not mesh or 0 in mesh:
        raise Bad("a mesh shape (a non-empty list of sizes >= 1)", d.get("mesh_shape"), "mesh_shape")
    placements = checked("placements", d, str_tuple)
    if len(placements) != len(mesh):
        raise Bad(f"{len(mesh)} placements (one per mesh dim)", list(placements), "placements")
    for i, p in enumerate(placements):
        try:
            parse(p)
        except (TypeError, ValueError):
            raise Bad('a placement ("S(d)", "R", "P(op)", "_S(d,sf=k)")', p, i).at("placements") from None
    names = d.get("mesh_dim_names")
    if names is not None:
        names = checked("mesh_dim_names", d, str_tuple)
        if len(names) != len(mesh):
            raise Bad(f"null or {len(mesh)} mesh dim names", list(names), "mesh_dim_names")
    shards = []
    ranks: set[int] = set()
    for i, s in enumerate(array(checked("shards", d, lambda x: x))):
        try:
            shards.append(_decode_shard(s, gshape, mesh))
        except Bad as e:
            raise e.at(i).at("shards") from None
        ranks.add(shards[-1].rank)
    if len(ranks) != len(shards):
        raise Bad("shards of distinct ranks", "...", "shards")
    groups: tuple[tuple[int, ...], ...] = ()
    if d.get("groups"):
        groups = tuple(tuple(g) for g in checked("groups", d, _layout_groups, math.prod(mesh)))
    per = math.prod(mesh)
    if len(shards) != per * max(1, len(groups)):
        raise Bad(
            f"{per * max(1, len(groups))} shards (one per mesh position and group)", len(shards), "shards"
        )
    mesh_ranks = d.get("mesh_ranks")
    if mesh_ranks:
        mesh_ranks = checked("mesh_ranks", d, _layout_group, per)
    return Layout(
        global_shape=gshape,
        dtype=checked("dtype", d, string),
        mesh_shape=mesh,
        mesh_dim_names=names,
        placements=placements,
        shards=tuple(shards),
        mesh_ranks=tuple(mesh_ranks) if mesh_ranks else tuple(s.rank for s in shards),
        groups=groups,
        notes=checked("notes", d, str_tuple) if "notes" in d else (),
    )


def _layout_group(v: Any, size: int) -> tuple[int, ...]:
    if type(v) is not list or len(v) != size:
        raise Bad(f"{size} ranks", v)
    return rank_list(v, 2**62)


def _layout_groups(v: Any, size: int) -> list[tuple[int, ...]]:
    return [_layout_group(g, size) for g in array(v)]


def _decode_shard(v: Any, gshape: tuple[int, ...], mesh: tuple[int, ...]) -> ShardInfo:
    rank, coord, offset, local, runs, partial = fields(
        v, "rank", "coord", "offset", "shape", "indices", "partial"
    )
    group = v.get("group", 0)
    if type(rank) is not int or not 0 <= rank < 2**62:
        raise Bad("a rank (an integer >= 0)", rank, "rank")
    if type(partial) is not bool:
        raise Bad("true or false", partial, "partial")
    if type(group) is not int or group < 0:
        raise Bad("an integer >= 0", group, "group")
    coord = shape_at(coord, "coord")
    if len(coord) != len(mesh) or any(c >= m for c, m in zip(coord, mesh, strict=True)):
        raise Bad(f"a coordinate on mesh {list(mesh)}", list(coord), "coord")
    offset = shape_at(offset, "offset")
    local = shape_at(local, "shape")
    n = len(gshape)
    if len(offset) != n or len(local) != n:
        raise Bad(f"{n} sizes (one per tensor dim)", list(local), "shape")
    if type(runs) is not list or len(runs) != n:
        raise Bad(f"{n} index lists (one per tensor dim)", runs, "indices")
    indices = []
    for dim in range(n):
        rs, size = runs[dim], gshape[dim]
        if type(rs) is not list:
            raise Bad("a list of [start, stop, step] ranges", rs, dim).at("indices")
        out = []
        count = 0
        for r in rs:
            if type(r) is not list or len(r) != 3:
                raise Bad("[start, stop, step]", r, dim).at("indices")
            start, stop, step = r
            if (
                type(start) is not int
                or type(stop) is not int
                or type(step) is not int
                or not 0 <= start <= stop <= size
                or step < 1
            ):
                raise Bad(f"[start, stop, step] with 0 <= start <= stop <= {size}, step >= 1", r, dim).at(
                    "indices"
                )
            run = range(start, stop, step)
            count += len(run)
            out.append(run)
        if count != local[dim] or offset[dim] > size:
            raise Bad(
                f"indices as many as the shard's size {local[dim]} along dim {dim}, an offset within {size}",
                rs,
                dim,
            ).at("indices")
        indices.append(tuple(out))
    return ShardInfo(
        rank=rank,
        coord=coord,
        offset=offset,
        shape=local,
        indices=tuple(indices),
        partial=partial,
        group=group,
    )
