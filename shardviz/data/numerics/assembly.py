"""A full tensor from each rank's local tensor, by its placements: Shard concatenated at its true
(uneven, strided) indices, Partial reduced by its op, FSDP's padding dropped, and every replica
checked against the others (``assemble``). A plain local tensor has no placements: ``infer``
finds the split of the run's meshes that its local shapes fit, and says when none or several do.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ...geometry import mesh as _mesh
from ...geometry.layout import Layout
from ...geometry.layout import compute as _compute_layout
from ...geometry.placement import parse
from .text import number, rank_ranges
from .tolerance import EXACT, Tolerance, absdiff, close, same, widened


@dataclass(frozen=True, slots=True, eq=False)
class Disagreement:
    """Copies of one value that should be equal and are not: ``groups`` are the ranks that agree
    with each other, largest group first; ``max_abs`` the largest difference from the first
    group's value, at global ``index``; ``scope`` says which copies were compared."""

    scope: str
    groups: tuple[tuple[int, ...], ...]
    max_abs: float
    index: tuple[int, ...]
    # Each group's value, for a whole-tensor comparison (a plain tensor or the groups of a sub-mesh):
    # copies that add up to the reference are a Partial value read as if it were replicated.
    values: tuple[np.ndarray, ...] = field(default=(), repr=False)

    def __eq__(self, other: object) -> bool:
        return same(self, other)

    def __str__(self) -> str:
        def who(g: tuple[int, ...]) -> str:
            return f"ranks {rank_ranges(g)}" if len(g) > 1 else f"rank {g[0]}"

        others = self.groups[1:]
        verb = "differs" if len(others) == 1 and len(others[0]) == 1 else "differ"
        at = f" at {list(self.index)}" if self.index else ""
        return (
            f"{self.scope}: {', '.join(who(g) for g in others)} {verb} from {who(self.groups[0])} "
            f"(max abs {number(self.max_abs)}{at})"
        )


@dataclass(frozen=True, slots=True)
class Assembled:
    """A full tensor made from per-rank pieces, or why it could not be made."""

    full: np.ndarray | None
    layout: Layout | None
    inferred: bool = False
    notes: tuple[str, ...] = ()
    disagreements: tuple[Disagreement, ...] = ()
    problem: str | None = None


def _reduce(values: Sequence[np.ndarray], op: str | None) -> np.ndarray:
    if len(values) == 1 or op is None:
        return widened(values[0])
    stack = [widened(v) for v in values]
    if op == "max":
        return np.maximum.reduce(stack)
    if op == "min":
        return np.minimum.reduce(stack)
    if op == "product":
        return np.multiply.reduce(stack)
    total = np.add.reduce([s.astype(np.result_type(s, np.float64)) for s in stack])
    return total / len(stack) if op == "avg" else total


def _cluster(
    units: Sequence[tuple[tuple[int, ...], np.ndarray]], tol: Tolerance
) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Copies grouped by agreement (each joins the first group whose value it is close to);
    largest group first, then the one holding the lowest rank."""
    groups: list[tuple[list[int], np.ndarray]] = []
    for ranks, value in units:
        for members, rep in groups:
            if value.shape == rep.shape and bool(np.all(close(value, rep, tol))):
                members.extend(ranks)
                break
        else:
            groups.append((list(ranks), value))
    groups.sort(key=lambda g: (-len(g[0]), min(g[0])))
    return [(tuple(sorted(m)), v) for m, v in groups]


def _disagreement(
    scope: str,
    groups: list[tuple[tuple[int, ...], np.ndarray]],
    indices: tuple[tuple[range, ...], ...] | None,
) -> Disagreement:
    first = groups[0][1]
    worst, where = 0.0, cast(tuple[int, ...], ())
    for _, v in groups[1:]:
        if v.shape != first.shape or not v.size:
            continue
        d = absdiff(v, first)
        k = int(np.argmax(d))
        if d.flat[k] >= worst:
            worst = float(d.flat[k])
            local = tuple(int(i) for i in np.unravel_index(k, d.shape))
            where = local
            if indices is not None:
                where = tuple(_global_index(runs, i) for runs, i in zip(indices, local, strict=True))
    values = tuple(v for _, v in groups) if indices is None else ()
    return Disagreement(scope, tuple(g for g, _ in groups), worst, where, values)


def _global_index(runs: tuple[range, ...], i: int) -> int:
    for r in runs:
        if i < len(r):
            return r[i]
        i -= len(r)
    return i


def index_arrays(indices: tuple[tuple[range, ...], ...]) -> tuple[np.ndarray, ...]:
    return tuple(
        np.concatenate([np.arange(r.start, r.stop, r.step) for r in runs])
        if runs
        else np.zeros(0, dtype=np.int64)
        for runs in indices
    )


def _out_dtype(values: Iterable[np.ndarray], op: str | None) -> Any:
    kinds = {np.asarray(v).dtype.kind for v in values}
    if "c" in kinds:
        return np.complex128
    if kinds <= {"b"} and op is None:
        return np.bool_
    if kinds <= {"i", "u", "b"} and op in (None, "sum", "max", "min", "product"):
        return np.int64
    return np.float64


def assemble(layout: Layout, values: Mapping[int, np.ndarray], tol: Tolerance = EXACT) -> Assembled:
    """The full tensor of ``layout`` from each rank's local tensor: shards at their true indices,
    Partial reduced by its op (in float64), replicas compared (``tol``), and a local tensor larger
    than its shard (FSDP's padding of a short shard) cut to the shard.

    Replicas are the ranks that differ only in Replicate mesh dims (each reduced over the Partial
    dims first) and the groups of a sub-mesh (each holds the whole tensor). Where they disagree,
    the value the most ranks agree on is kept and the disagreement is reported.
    """
    pls = [parse(p) for p in layout.placements]
    rep = [m for m, p in enumerate(pls) if p.kind == "replicate"]
    par = [m for m, p in enumerate(pls) if p.kind == "partial"]
    op = pls[par[0]].reduce_op if par else None
    local: dict[int, np.ndarray] = {}
    missing: list[int] = []
    padded: list[int] = []
    for s in layout.shards:
        a = values.get(s.rank)
        if a is None:
            missing.append(s.rank)
            continue
        a = np.asarray(a)
        if a.shape != s.shape:
            if a.ndim == len(s.shape) and all(x >= y for x, y in zip(a.shape, s.shape, strict=True)):
                a = a[tuple(slice(0, n) for n in s.shape)]
                padded.append(s.rank)
            else:
                return Assembled(
                    None,
                    layout,
                    problem=f"rank {s.rank} holds a local tensor of shape {a.shape} where its layout "
                    f"({', '.join(layout.placements)}) gives {s.shape}",
                )
        local[s.rank] = a
    if missing:
        return Assembled(None, layout, problem=f"no values from rank(s) {rank_ranges(missing)}")
    notes = []
    if padded:
        notes.append(
            f"padding cut from the local tensors of ranks {rank_ranges(padded)} (FSDP pads short shards)"
        )
    if op is not None:
        names = ", ".join(layout.dim_name(m) for m in par)
        notes.append(f"Partial({op}) reduced over {names}")
    dtype = _out_dtype(local.values(), op)
    shape = layout.global_shape
    findings: list[Disagreement] = []
    fulls: list[tuple[tuple[int, ...], np.ndarray]] = []
    rep_scope = "replicas over " + ", ".join(layout.dim_name(m) for m in rep) if rep else ""
    for g, ranks in enumerate(layout.instances):
        out = np.zeros(shape, dtype=dtype)
        by_pos: dict[tuple[int, ...], dict[tuple[int, ...], list[Any]]] = {}
        for s in layout.shards:
            if s.group != g:
                continue
            pos = tuple(c for m, c in enumerate(s.coord) if m not in rep and m not in par)
            by_pos.setdefault(pos, {}).setdefault(tuple(s.coord[m] for m in rep), []).append(s)
        for units in by_pos.values():
            shards = next(iter(units.values()))
            first = shards[0]
            reduced = [
                (tuple(s.rank for s in ss), _reduce([local[s.rank] for s in ss], op)) for ss in units.values()
            ]
            chosen = reduced[0][1]
            if len(reduced) > 1:
                groups = _cluster(reduced, tol)
                chosen = groups[0][1]
                if len(groups) > 1:
                    whole = first.shape == shape  # one copy is the whole tensor: keep the copies' values
                    findings.append(_disagreement(rep_scope, groups, None if whole else first.indices))
            if not first.empty and shape:
                out[np.ix_(*index_arrays(first.indices))] = chosen
            elif not shape:
                out = np.asarray(chosen, dtype=dtype).reshape(())
        fulls.append((tuple(ranks), out))
    full = fulls[0][1]
    if len(fulls) > 1:
        groups = _cluster(fulls, tol)
        full = groups[0][1]
        if len(groups) > 1:
            findings.append(
                _disagreement("the groups of the sub-mesh (each holds the whole tensor)", groups, None)
            )
    return Assembled(full, layout, notes=tuple(notes), disagreements=tuple(findings))


def across_groups(
    layout: Layout, values: Mapping[int, np.ndarray], ref_shape: Sequence[int], tol: Tolerance
) -> Assembled | None:
    """A DTensor on a sub-mesh whose groups each hold their own rows (data parallel over the other
    mesh dims: each dp group's tensor-parallel DTensor is its part of the batch): the groups
    stacked along the one dim where the reference is ``len(groups)`` times larger, as a layout
    with the groups as an outer mesh dim. None when the shapes do not say so."""
    k = len(layout.groups)
    shape = layout.global_shape
    ref = tuple(int(x) for x in ref_shape)
    if k < 2 or len(ref) != len(shape):
        return None
    dims = [d for d, (a, b) in enumerate(zip(shape, ref, strict=True)) if a != b]
    if len(dims) != 1 or ref[dims[0]] != k * shape[dims[0]]:
        return None
    (d,) = dims
    names = layout.mesh_dim_names or tuple(f"mesh dim {m}" for m in range(len(layout.mesh_shape)))
    try:
        stacked = _compute_layout(
            ref,
            (k, *layout.mesh_shape),
            [f"S({d})", *layout.placements],
            ("groups", *names),
            dtype=layout.dtype,
            mesh_ranks=tuple(r for g in layout.groups for r in g),
        )
    except ValueError:
        return None
    if any(tuple(np.asarray(values[s.rank]).shape) != s.shape for s in stacked.shards if s.rank in values):
        return None
    got = assemble(stacked, values, tol)
    if got.full is None:
        return None
    note = (
        f"each of the {k} groups of the {'x'.join(map(str, layout.mesh_shape))} sub-mesh holds its own "
        f"rows (data parallel over the other mesh dims): assembled along dim {d} over the groups"
    )
    return dataclasses.replace(got, inferred=True, notes=(note, *got.notes))


# One way to split the world: the groups along one mesh dim (or a whole mesh flattened), each
# group's ranks in coordinate order.
Axis = tuple[str, int, tuple[tuple[int, ...], ...]]


def axes(
    layouts: Iterable[Layout],
    meshes: Iterable[tuple[tuple[int, ...], tuple[str, ...] | None, tuple[tuple[int, ...], ...]]] = (),
    collectives: Iterable[tuple[str, tuple[tuple[int, ...], ...]]] = (),
) -> list[Axis]:
    """Every mesh dim of the meshes these layouts live on and of ``meshes`` ((shape, dim names,
    every instance's ranks): the meshes a step built), each multi-dim mesh flattened too, and
    ``collectives`` (name, rank groups: a collective's), as the groups of ranks along each across the
    world: the ways a plain local tensor may be split."""
    out: list[Axis] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()

    def add(name: str, groups: tuple[tuple[int, ...], ...]) -> None:
        key = tuple(sorted(groups))
        if key not in seen and groups:
            seen.add(key)
            out.append((name, len(groups[0]), groups))

    known = {(lay.mesh_shape, lay.mesh_dim_names, lay.instances) for lay in layouts}
    known |= {(tuple(s), tuple(n) if n else None, tuple(tuple(g) for g in i)) for s, n, i in meshes}
    for shape, names, instances in sorted(known, key=lambda m: (len(m[0]), m[0], str(m[1]))):
        coords = _mesh.coords(shape)
        for m in range(len(shape)):
            groups: list[tuple[int, ...]] = []
            for inst in instances:
                lines: dict[tuple[int, ...], list[tuple[int, int]]] = {}
                for rank, c in zip(inst, coords, strict=True):
                    lines.setdefault(c[:m] + c[m + 1 :], []).append((c[m], rank))
                groups += [tuple(r for _, r in sorted(line)) for line in lines.values()]
            add(names[m] if names else f"mesh dim {m}", tuple(groups))
        if len(shape) > 1:
            add(
                f"({', '.join(names)})" if names else "the whole mesh",
                tuple(tuple(inst) for inst in instances),
            )
    for name, gs in collectives:
        add(name, gs)
    return out


def infer(
    global_shape: Sequence[int],
    values: Mapping[int, np.ndarray],
    candidates: Sequence[Axis],
    tol: Tolerance,
    meshes: Sequence[MeshOf] = (),
    batch: str | None = None,
) -> Assembled:
    """A plain per-rank tensor's full value when its local shapes show it is split along one tensor
    dim over one mesh dim of the run (``axes``), as tensor-parallel code hands a module its local
    shard, or along several tensor dims over as many dims of one of the run's ``meshes`` (a data
    and tensor parallel activation: rows over dp, features over tp); every fit is assembled, and
    one that leaves replicas disagreeing loses to one that does not; where shapes alone fit
    several, the one splitting dim 0 over ``batch`` (the mesh dim that split the model's input
    rows) wins. No fit, or fits that give different tensors, is a problem, never a guess."""
    shape = tuple(int(s) for s in global_shape)
    shapes = {r: tuple(np.asarray(v).shape) for r, v in values.items()}
    dims = sorted(
        {
            d
            for s in shapes.values()
            if len(s) == len(shape)
            for d, (a, b) in enumerate(zip(s, shape, strict=True))
            if a != b
        }
    )
    local_shapes = sorted(set(shapes.values()))
    if len(dims) > 1 and all(len(s) == len(shape) for s in shapes.values()):
        return _pick(
            _multi_fits(shape, values, shapes, dims, meshes, tol), shape, dims, local_shapes, tol, batch
        )
    if len(dims) != 1 or any(len(s) != len(shape) for s in shapes.values()):
        return Assembled(
            None,
            None,
            problem=f"plain local tensors of shape {' / '.join(map(str, local_shapes))} where the reference "
            f"has {shape}: not a split of one dim, so their layout is unknown (return a DTensor, e.g. "
            "use_local_output=False in the parallel style, to compare it)",
        )
    (dim,) = dims
    fits: list[Assembled] = []
    for name, size, groups in candidates:
        ranks = {r for g in groups for r in g}
        if ranks != set(values) or size < 2:
            continue
        lay = _compute_layout(
            shape,
            (size,),
            [f"S({dim})"],
            (name,),
            groups=groups if len(groups) > 1 else None,
            mesh_ranks=groups[0],
        )
        how = ""
        if not all(s.shape == shapes[s.rank] for s in lay.shards):
            # Not torch.chunk's sizes: pieces cut in coordinate order with sizes of their own
            # (torch.tensor_split's 3, 3, 2, 2 of 10), the same in every group.
            sizes = {tuple(shapes[r][dim] for r in g) for g in groups}
            if len(sizes) != 1 or sum(next(iter(sizes))) != shape[dim]:
                continue
            (cut,) = sizes
            lay = _compute_layout(
                shape,
                (size,),
                [f"S({dim})"],
                (name,),
                groups=groups if len(groups) > 1 else None,
                mesh_ranks=groups[0],
                shard_sizes={0: cut},
            )
            how = f", in pieces of {', '.join(map(str, cut))} in rank order"
        if all(s.shape == shapes[s.rank] for s in lay.shards):
            got = assemble(lay, values, tol)
            if got.full is not None:
                note = f"layout inferred from shapes: split along dim {dim} over {name} ({size}){how}"
                fits.append(dataclasses.replace(got, inferred=True, notes=(note, *got.notes)))
    return _pick(fits, shape, dims, local_shapes, tol, batch)


def batch_axis(layout: Layout | None) -> str | None:
    """The name of the mesh dim that splits tensor dim 0 of ``layout`` (the batch, for data
    parallel), or None."""
    if layout is None:
        return None
    for m, p in enumerate(layout.placements):
        if p == "S(0)":
            return layout.dim_name(m)
    return None


# A mesh as the ways it splits the world: (mesh shape, dim names, every instance's global ranks).
MeshOf = tuple[tuple[int, ...], tuple[str, ...] | None, tuple[tuple[int, ...], ...]]


def _multi_fits(
    shape: tuple[int, ...],
    values: Mapping[int, np.ndarray],
    shapes: Mapping[int, tuple[int, ...]],
    dims: Sequence[int],
    meshes: Sequence[MeshOf],
    tol: Tolerance,
) -> list[Assembled]:
    """Layouts that split each of ``dims`` over its own dim of one mesh (chunked), which the local
    shapes fit."""
    fits: list[Assembled] = []
    for mshape, names, instances in meshes:
        if len(mshape) < len(dims) or {r for g in instances for r in g} != set(values):
            continue
        for assign in itertools.permutations(range(len(mshape)), len(dims)):
            placements = ["R"] * len(mshape)
            for d, m in zip(dims, assign, strict=True):
                placements[m] = f"S({d})"
            lay = _compute_layout(
                shape,
                mshape,
                placements,
                names,
                groups=instances if len(instances) > 1 else None,
                mesh_ranks=instances[0],
            )
            if all(sh.shape == shapes[sh.rank] for sh in lay.shards):
                got = assemble(lay, values, tol)
                if got.full is not None:
                    where = ", ".join(
                        f"dim {d} over {lay.dim_name(m)}" for d, m in zip(dims, assign, strict=True)
                    )
                    note = f"layout inferred from shapes: split along {where}"
                    fits.append(dataclasses.replace(got, inferred=True, notes=(note, *got.notes)))
    return fits


def _pick(
    fits: list[Assembled],
    shape: tuple[int, ...],
    dims: Sequence[int],
    local_shapes: Sequence[tuple[int, ...]],
    tol: Tolerance,
    batch: str | None = None,
) -> Assembled:
    """The one full tensor the fits agree on, or a problem."""
    which = " and ".join(f"dim {d}" for d in dims)
    if not fits:
        return Assembled(
            None,
            None,
            problem=f"plain local tensors of shape {' / '.join(map(str, local_shapes))} where the reference "
            f"has {shape}: no mesh dim of this run splits {which} that way (return a DTensor to compare "
            "it)",
        )
    clean = [f for f in fits if not f.disagreements] or fits
    if batch is not None and len(clean) > 1:
        clean = [f for f in clean if batch_axis(f.layout) == batch] or clean
    first = clean[0]
    assert first.full is not None
    for other in clean[1:]:
        assert other.full is not None and other.layout is not None and first.layout is not None
        if not bool(np.all(close(other.full, first.full, tol))):
            return Assembled(
                None,
                None,
                problem=f"plain local tensors split along {which}, but by shape alone they fit both "
                f"{first.layout.mesh_dim_names} and {other.layout.mesh_dim_names}, which give different "
                "tensors (return a DTensor to compare it)",
            )
    return first
