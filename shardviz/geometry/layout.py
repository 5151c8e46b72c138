"""Per-rank shard geometry as plain data, computed without a process group.

``Layout`` answers "which rank holds which elements" for a global shape, a mesh shape and
placements. It is a pure function so that a 512-rank mesh takes milliseconds instead of a
simulation, and so that views never need torch. Shards are applied left to right over the mesh
dims, following ``torch.chunk`` semantics (DTensor's own convention), so uneven and empty shards
come out exactly as DTensor makes them; ``_StridedShard`` produces non-contiguous indices.
Tensor types that choose their own shard sizes (PhysicsNeMo's ShardTensor: 3, 3, 2, 2 where
chunking gives 3, 3, 3, 1) pass them as ``shard_sizes``, which replace chunking on those mesh dims.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from . import mesh as _mesh
from .placement import Placement, normalize

# An index set along one tensor dim: sorted, disjoint, non-empty (start, stop) runs.
Runs = list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """What one rank holds: its mesh coordinate and the global elements of its local tensor.

    ``group`` is the instance of a sub-mesh the rank belongs to (an index into ``Layout.groups``;
    always 0 on a whole-world mesh).
    """

    rank: int
    coord: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    indices: tuple[tuple[range, ...], ...]
    partial: bool = False
    group: int = 0

    @property
    def empty(self) -> bool:
        """Whether this rank holds no element (a 0 in its local shape)."""
        return 0 in self.shape

    @property
    def contiguous(self) -> bool:
        """Whether the shard is one block of the global tensor (one range per dim; a strided shard is not)."""
        return all(len(r) <= 1 for r in self.indices)

    def numel(self) -> int:
        """The number of elements this rank holds."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, slots=True)
class Layout:
    """The geometry of a distributed tensor: one ShardInfo per rank that holds it.

    ``mesh_ranks`` are the global ranks of the mesh in row-major order. A sub-mesh (a slice or a
    flatten of a larger mesh, such as ``mesh["tp"]``) exists once per group of ranks: ``groups``
    lists every instance's global ranks in row-major order (``groups[0] == mesh_ranks``), and
    ``shards`` holds every rank of every instance, instance by instance, each with its ``group``.
    ``groups`` is empty for a mesh that exists once (a whole-world mesh).
    """

    global_shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: tuple[str, ...] | None
    placements: tuple[str, ...]
    shards: tuple[ShardInfo, ...]
    mesh_ranks: tuple[int, ...] = field(default=())
    groups: tuple[tuple[int, ...], ...] = field(default=())
    # What the geometry alone does not say: a DTensor whose ranks hold pieces other than its spec
    # gives them (the layout is then the pieces the ranks hold).
    notes: tuple[str, ...] = field(default=())

    @property
    def world_size(self) -> int:
        """How many ranks hold the tensor (every instance of a sub-mesh counted)."""
        return len(self.shards)

    @property
    def instances(self) -> tuple[tuple[int, ...], ...]:
        """Each instance's global ranks: ``groups``, or the one mesh's ranks."""
        return self.groups or (self.mesh_ranks or self.ranks,)

    def group_layout(self, group: int) -> Layout:
        """The Layout of one instance of a sub-mesh alone (this layout itself when there is one):
        a mesh that exists once, so its shards are of group 0, as in any whole-world layout (and
        ``to_dict`` / ``from_dict`` give it back equal)."""
        if not self.groups:
            if group != 0:
                raise IndexError(f"group {group}: this layout's mesh exists once (group 0)")
            return self
        if not 0 <= group < len(self.groups):
            raise IndexError(f"group {group}: this sub-mesh has groups 0..{len(self.groups) - 1}")
        return Layout(
            global_shape=self.global_shape,
            dtype=self.dtype,
            mesh_shape=self.mesh_shape,
            mesh_dim_names=self.mesh_dim_names,
            placements=self.placements,
            shards=tuple(dataclasses.replace(s, group=0) for s in self.shards if s.group == group),
            mesh_ranks=self.groups[group],
        )

    @property
    def ranks(self) -> tuple[int, ...]:
        """The global ranks that hold a shard, in the order of ``shards``."""
        return tuple(s.rank for s in self.shards)

    def shard(self, rank: int) -> ShardInfo:
        """What global ``rank`` holds (KeyError for a rank off this layout's mesh)."""
        for s in self.shards:
            if s.rank == rank:
                return s
        raise KeyError(f"rank {rank} is not on this layout's mesh (ranks {self.ranks[0]}..{self.ranks[-1]})")

    def dim_name(self, mesh_dim: int) -> str:
        """The name of mesh dim ``mesh_dim``, or "mesh dim N" when the mesh has no names."""
        if self.mesh_dim_names:
            return self.mesh_dim_names[mesh_dim]
        return f"mesh dim {mesh_dim}"

    def owners(self, index: Sequence[int]) -> list[int]:
        """Ranks whose local tensor holds the global element at ``index``."""
        out = []
        for s in self.shards:
            if all(any(i in r for r in runs) for i, runs in zip(index, s.indices, strict=True)):
                out.append(s.rank)
        return out

    def __iter__(self) -> Iterator[ShardInfo]:
        return iter(self.shards)

    def __str__(self) -> str:
        return _table(self)

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        groups = f", groups={len(self.groups)}" if self.groups else ""
        return (
            f"Layout(global_shape={self.global_shape}, dtype={self.dtype!r}, mesh_shape={self.mesh_shape}"
            f"{names}, placements={list(self.placements)}{groups})"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (ranges as [start, stop, step] triples); ``groups`` (and each shard's
        ``group``) only for a sub-mesh, so that a whole-world layout reads as before."""
        out: dict[str, Any] = {
            "global_shape": list(self.global_shape),
            "dtype": self.dtype,
            "mesh_shape": list(self.mesh_shape),
            "mesh_dim_names": list(self.mesh_dim_names) if self.mesh_dim_names else None,
            "mesh_ranks": list(self.mesh_ranks),
            "placements": list(self.placements),
            "shards": [
                {
                    "rank": s.rank,
                    "coord": list(s.coord),
                    "offset": list(s.offset),
                    "shape": list(s.shape),
                    "indices": [[[r.start, r.stop, r.step] for r in runs] for runs in s.indices],
                    "partial": s.partial,
                    **({"group": s.group} if self.groups else {}),
                }
                for s in self.shards
            ],
        }
        if self.groups:
            out["groups"] = [list(g) for g in self.groups]
        if self.notes:
            out["notes"] = list(self.notes)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        """The layout ``to_dict`` wrote (no checks: ``sv.load`` checks a file's layouts as it reads them)."""
        shards = tuple(
            ShardInfo(
                rank=int(s["rank"]),
                coord=tuple(s["coord"]),
                offset=tuple(s["offset"]),
                shape=tuple(s["shape"]),
                indices=tuple(tuple(range(*r) for r in runs) for runs in s["indices"]),
                partial=bool(s["partial"]),
                group=int(s.get("group", 0)),
            )
            for s in d["shards"]
        )
        names = d.get("mesh_dim_names")
        groups = tuple(tuple(int(r) for r in g) for g in d.get("groups") or ())
        return cls(
            global_shape=tuple(d["global_shape"]),
            dtype=str(d["dtype"]),
            mesh_shape=tuple(d["mesh_shape"]),
            mesh_dim_names=tuple(names) if names else None,
            placements=tuple(d["placements"]),
            shards=shards,
            mesh_ranks=tuple(d.get("mesh_ranks") or (s.rank for s in shards)),
            groups=groups,
            notes=tuple(str(n) for n in d.get("notes") or ()),
        )


def _length(runs: Runs) -> int:
    return sum(b - a for a, b in runs)


def _slice(runs: Runs, start: int, stop: int) -> Runs:
    """Positions [start, stop) of the index sequence that ``runs`` describes."""
    out: Runs = []
    pos = 0
    for a, b in runs:
        n = b - a
        lo, hi = max(start - pos, 0), min(stop - pos, n)
        if lo < hi:
            out.append((a + lo, a + hi))
        pos += n
        if pos >= stop:
            break
    return out


def _chunk(runs: Runs, n: int, i: int) -> Runs:
    """Chunk ``i`` of ``n`` as ``torch.chunk`` cuts it (missing trailing chunks are empty)."""
    length = _length(runs)
    size = -(-length // n)
    start = min(i * size, length)
    return _slice(runs, start, min(start + size, length))


def _merge(runs: Runs) -> Runs:
    out: Runs = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def _split(runs: Runs, p: Placement, n: int, i: int) -> Runs:
    if p.kind == "shard":
        return _chunk(runs, n, i)
    # _StridedShard: first split into split_factor pieces, then each piece into n; this rank
    # keeps its chunk of every piece, concatenated.
    pieces = [_chunk(runs, p.split_factor, j) for j in range(p.split_factor)]
    return _merge([r for piece in pieces for r in _chunk(piece, n, i)])


def _split_sizes(runs: Runs, sizes: tuple[int, ...], m: int, coord: tuple[int, ...]) -> Runs:
    """Piece ``coord[m]`` of ``runs`` cut into the given sizes, in coordinate order."""
    length = _length(runs)
    if sum(sizes) != length:
        raise ValueError(
            f"shard_sizes for mesh dim {m} are {list(sizes)}, which add up to {sum(sizes)}, but the "
            f"piece mesh dim {m} splits at coordinate {coord} has {length} element(s) along that dim: "
            "the sizes along a mesh dim must add up to what it splits"
        )
    start = sum(sizes[: coord[m]])
    return _slice(runs, start, start + sizes[coord[m]])


def _check_shard_sizes(
    shard_sizes: Mapping[int, Sequence[int]] | None, pls: Sequence[Placement], mshape: Sequence[int]
) -> dict[int, tuple[int, ...]]:
    """Explicit sizes per mesh dim, checked against the placements and the mesh shape."""
    if not shard_sizes:
        return {}
    out: dict[int, tuple[int, ...]] = {}
    for m, given in shard_sizes.items():
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m < len(mshape):
            raise ValueError(f"shard_sizes has mesh dim {m!r}; this mesh has dims 0..{len(mshape) - 1}")
        if pls[m].kind != "shard":
            raise ValueError(
                f"shard_sizes gives sizes for mesh dim {m}, whose placement is {pls[m]}: sizes apply to "
                'a "S(d)" placement only'
            )
        try:
            sizes = tuple(given)
        except TypeError:
            raise TypeError(f"shard_sizes[{m}] must be a list of ints, one per coordinate") from None
        if len(sizes) != mshape[m] or any(
            isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes
        ):
            raise ValueError(
                f"shard_sizes[{m}] is {list(sizes)}: give {mshape[m]} non-negative int(s), one per "
                f"coordinate along mesh dim {m}"
            )
        out[m] = sizes
    return out


def compute(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[str | Placement],
    mesh_dim_names: Sequence[str] | None = None,
    *,
    dtype: str = "float32",
    mesh_ranks: Sequence[int] | None = None,
    shard_order: Mapping[int, Sequence[int]] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    shard_sizes: Mapping[int, Sequence[int]] | None = None,
) -> Layout:
    """The pure geometry behind ``sv.layout(shape, mesh_shape, placements)``, cached: a Layout is
    immutable, and recording sees the same few layouts again and again.

    ``groups`` makes the mesh a sub-mesh of a larger world: every instance's global ranks, each in
    row-major order (``shardviz.mesh.submesh_groups`` computes them for a slice of a world mesh).
    ``shard_sizes`` gives, for a mesh dim with a ``S(d)`` placement, the size of dim ``d`` at each
    coordinate along it (``{0: (3, 3, 2, 2)}``), where the tensor does not follow chunking.
    """
    try:
        key = (
            tuple(global_shape) if not isinstance(global_shape, int) else global_shape,
            tuple(mesh_shape) if not isinstance(mesh_shape, int) else mesh_shape,
            tuple(placements) if not isinstance(placements, str) else placements,
            tuple(mesh_dim_names)
            if mesh_dim_names is not None and not isinstance(mesh_dim_names, str)
            else mesh_dim_names,
            dtype,
            tuple(mesh_ranks) if mesh_ranks is not None else None,
            tuple((k, tuple(v)) for k, v in sorted(shard_order.items())) if shard_order else None,
            tuple(tuple(g) for g in groups) if groups is not None else None,
            tuple((k, tuple(v)) for k, v in sorted(shard_sizes.items())) if shard_sizes else None,
        )
        hash(key)
    except TypeError:  # unhashable input: let the checks below explain it
        return _compute(
            global_shape,
            mesh_shape,
            placements,
            mesh_dim_names,
            dtype=dtype,
            mesh_ranks=mesh_ranks,
            shard_order=shard_order,
            groups=groups,
            shard_sizes=shard_sizes,
        )
    return _cached(key)


@functools.lru_cache(maxsize=512)
def _cached(key: tuple[Any, ...]) -> Layout:
    shape, mesh_shape, placements, names, dtype, ranks, order, groups, sizes = key
    return _compute(
        shape,
        mesh_shape,
        placements,
        names,
        dtype=dtype,
        mesh_ranks=ranks,
        shard_order=dict(order) if order else None,
        groups=groups,
        shard_sizes=dict(sizes) if sizes else None,
    )


def check_arguments(
    global_shape: object,
    mesh_shape: object,
    placements: object,
    mesh_dim_names: object = None,
    mesh_ranks: Sequence[int] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
) -> None:
    """Raise the error ``compute`` would raise for wrong arguments, before any geometry runs: a
    front end calls it to raise from its own line instead of from deep inside the cached geometry."""
    shape = _check_shape(global_shape)
    mshape = _mesh.check_mesh_shape(mesh_shape)
    _check_names(cast("Sequence[str] | None", mesh_dim_names), len(mshape))
    normalize(placements, len(shape), len(mshape))
    nranks = _mesh.size(mshape)
    _check_groups(groups, nranks, mesh_ranks)
    if mesh_ranks is not None and groups is None and len(tuple(mesh_ranks)) != nranks:
        raise ValueError(f"mesh_ranks has {len(tuple(mesh_ranks))} ranks for a mesh of {nranks}")


def _compute(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[str | Placement],
    mesh_dim_names: Sequence[str] | None = None,
    *,
    dtype: str = "float32",
    mesh_ranks: Sequence[int] | None = None,
    shard_order: Mapping[int, Sequence[int]] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    shard_sizes: Mapping[int, Sequence[int]] | None = None,
) -> Layout:
    """The geometry itself.

    ``shard_order`` maps a tensor dim to the order its mesh dims are applied in, for DTensors
    whose spec records a non-default order; by default mesh dims apply left to right. ``groups``:
    see :func:`compute`; one group is the same as ``mesh_ranks``. ``shard_sizes``: see
    :func:`compute`.
    """
    shape = _check_shape(global_shape)
    mshape = _mesh.check_mesh_shape(mesh_shape)
    names = _check_names(mesh_dim_names, len(mshape))
    pls = normalize(placements, len(shape), len(mshape))
    nranks = _mesh.size(mshape)
    instances = _check_groups(groups, nranks, mesh_ranks)
    if instances:
        mesh_ranks = instances[0]
        if len(instances) == 1:
            instances = ()
    if mesh_ranks is None:
        ranks = tuple(range(nranks))
    else:
        ranks = tuple(int(r) for r in mesh_ranks)
        if len(ranks) != nranks:
            raise ValueError(f"mesh_ranks has {len(ranks)} ranks for a mesh of {nranks}")

    # Which mesh dims split each tensor dim, in application order.
    order: dict[int, list[int]] = {}
    for m, p in enumerate(pls):
        if p.is_shard:
            assert p.dim is not None
            order.setdefault(p.dim, []).append(m)
    if shard_order:
        for d, mesh_dims in shard_order.items():
            if sorted(mesh_dims) != sorted(order.get(d, [])):
                raise ValueError(
                    f"shard_order for dim {d} names mesh dims {list(mesh_dims)}, "
                    f"but the placements shard it over {order.get(d, [])}"
                )
            order[d] = list(mesh_dims)
    is_partial = any(p.kind == "partial" for p in pls)
    sizes = _check_shard_sizes(shard_sizes, pls, mshape)

    shards = []
    for rank, coord in zip(ranks, _mesh.coords(mshape), strict=True):
        offset, local, indices = [], [], []
        for d, n in enumerate(shape):
            runs: Runs = [(0, n)] if n else []
            for m in order.get(d, ()):
                if m in sizes:
                    runs = _split_sizes(runs, sizes[m], m, coord)
                else:
                    runs = _split(runs, pls[m], mshape[m], coord[m])
            length = _length(runs)
            local.append(length)
            offset.append(runs[0][0] if runs else n)
            indices.append(tuple(range(a, b) for a, b in runs))
        shards.append(
            ShardInfo(
                rank=rank,
                coord=coord,
                offset=tuple(offset),
                shape=tuple(local),
                indices=tuple(indices),
                partial=is_partial,
            )
        )
    # Every instance of a sub-mesh holds the same geometry at the same coordinates.
    for gi, grp in enumerate(instances[1:], start=1):
        shards.extend(
            dataclasses.replace(s, rank=r, group=gi) for s, r in zip(shards[:nranks], grp, strict=True)
        )
    return Layout(
        global_shape=shape,
        dtype=dtype,
        mesh_shape=mshape,
        mesh_dim_names=names,
        placements=tuple(str(p) for p in pls),
        shards=tuple(shards),
        mesh_ranks=ranks,
        groups=instances,
    )


def _check_groups(
    groups: Sequence[Sequence[int]] | None, nranks: int, mesh_ranks: Sequence[int] | None
) -> tuple[tuple[int, ...], ...]:
    """The instances of a sub-mesh as tuples, checked; () for a mesh that exists once."""
    if groups is None:
        return ()
    try:
        out = tuple(tuple(int(r) for r in g) for g in groups)
    except TypeError:
        raise TypeError("groups must be a list of rank lists, one per instance of the sub-mesh") from None
    if not out:
        raise ValueError("groups is empty: give each instance's ranks, or leave groups unset")
    for g in out:
        if len(g) != nranks:
            raise ValueError(f"groups has a group of {len(g)} ranks {list(g)} for a mesh of {nranks}")
    flat = [r for g in out for r in g]
    if len(set(flat)) != len(flat) or min(flat) < 0:
        raise ValueError(f"groups {[list(g) for g in out]}: each rank may be in one group only")
    if mesh_ranks is not None and tuple(int(r) for r in mesh_ranks) != out[0]:
        raise ValueError(f"mesh_ranks {list(mesh_ranks)} is not the first group {list(out[0])}")
    return out


def _check_shape(shape: object) -> tuple[int, ...]:
    if isinstance(shape, int):
        shape = (shape,)
    try:
        # Anything tuple() accepts (old-style __getitem__ sequences too); a TypeError says why not.
        dims = tuple(cast("Iterable[object]", shape))
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints, not {type(shape).__name__}") from None
    checked: list[int] = []
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, int) or d < 0:
            raise ValueError(f"shape {dims}: every dim must be a non-negative int")
        checked.append(int(d))
    return tuple(checked)


def _check_names(names: Sequence[str] | None, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    if isinstance(names, str):
        names = (names,)
    out = tuple(names)
    if len(out) != ndim or not all(isinstance(n, str) and n for n in out):
        raise ValueError(f"mesh_dim_names {out!r}: give {ndim} non-empty string(s), one per mesh dim")
    if len(set(out)) != len(out):
        raise ValueError(f"mesh_dim_names {out!r} repeat a name: each mesh dim needs its own")
    return out


def _fmt_runs(runs: tuple[range, ...]) -> str:
    if not runs:
        return "-"
    return ",".join(f"{r.start}:{r.stop}" for r in runs)


def _table(layout: Layout) -> str:
    names = f" {layout.mesh_dim_names}" if layout.mesh_dim_names else ""
    head = (
        f"Layout {layout.global_shape} {layout.dtype} on mesh {layout.mesh_shape}{names} "
        f"placements [{', '.join(layout.placements)}]"
    )
    grouped = bool(layout.groups)
    rows: list[tuple[str, ...]] = [("rank", "group", "coord", "offset", "shape", "indices", "")]
    lines = [head]
    if grouped:
        per = len(layout.groups[0])
        lines.append(
            f"sub-mesh in {len(layout.groups)} groups of {per} rank{'s' if per != 1 else ''}, each holding "
            "the whole tensor: " + " ".join("[" + ", ".join(map(str, g)) + "]" for g in layout.groups)
        )
    for s in layout.shards:
        notes = []
        if s.partial:
            notes.append("partial")
        if s.empty:
            notes.append("empty")
        if not s.contiguous:
            notes.append("strided")
        rows.append(
            (
                str(s.rank),
                str(s.group),
                str(s.coord),
                str(s.offset) if not s.empty else "-",
                str(s.shape),
                "[" + ", ".join(_fmt_runs(r) for r in s.indices) + "]",
                " ".join(notes),
            )
        )
    if not grouped:  # a mesh that exists once: no group column
        rows = [(r[0], *r[2:]) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].rjust(widths[0])] + [c.ljust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    lines += [f"note: {n}" for n in layout.notes]
    return "\n".join(lines)


def as_held(
    spec: Layout, held: Mapping[int, Sequence[int]], note: str | None = None, whole: bool = False
) -> Layout:
    """``spec`` as the ranks hold it: ``held`` gives ranks' local shapes (all of them, or only
    some: a real rank knows its own). Where they all match the spec, the spec; else, when the
    pieces tile the tensor along each ``S(d)`` mesh dim in coordinate order (``shard_sizes``), that
    layout, and otherwise the spec; either way with a note naming the disagreement. ``whole``:
    the spec's global shape is a guess, to be replaced by the one the pieces make."""
    got = {r: tuple(int(x) for x in s) for r, s in held.items()}
    wrong = [s.rank for s in spec.shards if s.rank in got and got[s.rank] != s.shape]
    if not wrong and not whole:
        return spec
    if note is None:
        want = ", ".join(str(spec.shard(r).shape) for r in wrong)
        note = (
            f"the ranks' local tensors disagree with this DTensor's spec ({list(spec.global_shape)}, "
            f"[{', '.join(spec.placements)}]): rank{'s' if len(wrong) > 1 else ''} "
            f"{', '.join(map(str, wrong))} hold{'' if len(wrong) > 1 else 's'} "
            f"{', '.join(str(got[r]) for r in wrong)} where the spec gives {want}; DTensor computes with "
            "the spec's sizes (from_local with run_check=False and shape=, or a framework's conversion "
            "of its own uneven shards), so its results may not be what the ranks hold."
        )
    if set(got) >= set(spec.ranks):
        sizes = _sizes_held(spec, got)
        if sizes is not None:
            shape = list(spec.global_shape)
            for m, sz in sizes.items():
                d = int(spec.placements[m][2:-1])
                if not whole and sum(sz) != shape[d]:
                    sizes = None  # the pieces do not add up to the spec's global shape
                    break
                shape[d] = sum(sz)
        if sizes is not None:
            try:
                drawn = compute(
                    shape,
                    spec.mesh_shape,
                    spec.placements,
                    spec.mesh_dim_names,
                    dtype=spec.dtype,
                    mesh_ranks=spec.mesh_ranks or None,
                    groups=spec.groups or None,
                    shard_sizes=sizes,
                )
            except ValueError:
                drawn = None
            if drawn is not None and all(got[s.rank] == s.shape for s in drawn.shards):
                return dataclasses.replace(
                    drawn, notes=(*spec.notes, note + " Drawn as the ranks hold them.")
                )
    why = (
        "the pieces do not tile the tensor"
        if set(got) >= set(spec.ranks)
        else "the other ranks' are not known here"
    )
    return dataclasses.replace(spec, notes=(*spec.notes, f"{note} Drawn as the spec gives it: {why}."))


def _sizes_held(spec: Layout, held: Mapping[int, tuple[int, ...]]) -> dict[int, tuple[int, ...]] | None:
    """For each mesh dim with a plain ``S(d)``, the size along ``d`` of the piece at each
    coordinate, read from the ranks at that coordinate (all of which must agree)."""
    out: dict[int, tuple[int, ...]] = {}
    for m, p in enumerate(spec.placements):
        if not (p.startswith("S(") and p.endswith(")")):
            continue
        d = int(p[2:-1])
        by_coord: dict[int, set[int]] = {}
        for s in spec.shards:
            if s.rank in held and d < len(held[s.rank]):
                by_coord.setdefault(s.coord[m], set()).add(held[s.rank][d])
        if any(len(v) != 1 for v in by_coord.values()) or len(by_coord) != spec.mesh_shape[m]:
            return None
        out[m] = tuple(next(iter(by_coord[c])) for c in range(spec.mesh_shape[m]))
    return out or None
