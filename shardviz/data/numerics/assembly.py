"""A full tensor from each rank's local tensor, by its placements: Shard concatenated at its true
(uneven, strided) indices, Partial reduced by its op, FSDP's padding dropped, and every replica
checked against the others (``assemble``). A plain local tensor has no placements: ``infer``
finds the split of the run's meshes that its local shapes fit, and says when none or several do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from ...geometry import mesh as _mesh
from ...geometry.layout import Layout
from ...geometry.layout import compute as _compute_layout
from ...geometry.placement import parse
from .text import number, rank_ranges
from .tolerance import EXACT, Tolerance, absdiff, close, widened


@dataclass(frozen=True, slots=True)
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
    values: tuple[np.ndarray, ...] = field(default=(), repr=False, compare=False)

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


# One way to split the world: the groups along one mesh dim (or a whole mesh flattened), each
# group's ranks in coordinate order.
Axis = tuple[str, int, tuple[tuple[int, ...], ...]]


def axes(layouts: Iterable[Layout]) -> list[Axis]:
    """Every mesh dim of the meshes these layouts live on (and each multi-dim mesh flattened), as
    the groups of ranks along it across the world: the ways a plain local tensor may be split."""
    out: list[Axis] = []
    seen: set[tuple[tuple[int, ...], ...]] = set()

    def add(name: str, groups: tuple[tuple[int, ...], ...]) -> None:
        key = tuple(sorted(groups))
        if key not in seen and groups:
            seen.add(key)
            out.append((name, len(groups[0]), groups))

    meshes = {(lay.mesh_shape, lay.mesh_dim_names, lay.instances) for lay in layouts}
    for shape, names, instances in sorted(meshes, key=lambda m: (len(m[0]), m[0], str(m[1]))):
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
    return out


def infer(
    global_shape: Sequence[int],
    values: Mapping[int, np.ndarray],
    candidates: Sequence[Axis],
    tol: Tolerance,
) -> Assembled:
    """A plain per-rank tensor's full value when its local shapes show it is split along one tensor
    dim over one mesh dim of the run (``axes``), as tensor-parallel code hands a module its local
    shard; every fit is assembled, and one that leaves replicas disagreeing loses to one that
    does not. No fit, or fits that give different tensors, is a problem, never a guess."""
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
        if all(s.shape == shapes[s.rank] for s in lay.shards):
            got = assemble(lay, values, tol)
            if got.full is not None:
                note = f"layout inferred from shapes: split along dim {dim} over {name} ({size})"
                fits.append(dataclasses.replace(got, inferred=True, notes=(note, *got.notes)))
    if not fits:
        return Assembled(
            None,
            None,
            problem=f"plain local tensors of shape {' / '.join(map(str, local_shapes))} where the reference "
            f"has {shape}: no mesh dim of this run splits dim {dim} that way (return a DTensor to compare "
            "it)",
        )
    clean = [f for f in fits if not f.disagreements] or fits
    first = clean[0]
    assert first.full is not None
    for other in clean[1:]:
        assert other.full is not None and other.layout is not None and first.layout is not None
        if not bool(np.all(close(other.full, first.full, tol))):
            return Assembled(
                None,
                None,
                problem=f"plain local tensors split along dim {dim}, but by shape alone they fit both "
                f"{first.layout.mesh_dim_names} and {other.layout.mesh_dim_names}, which give different "
                "tensors (return a DTensor to compare it)",
            )
    return first
