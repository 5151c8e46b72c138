"""One run of a step as plain data: what a process captured (``RawCapture``: each rank's local
tensors and, for a DTensor, its layout), merged across processes (``merge_raw``), and assembled
into one full tensor per row (``build_run`` -> ``StepNumerics``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...geometry.layout import Layout
from ...geometry.layout import compute as _compute_layout
from .assembly import Assembled, Axis, Disagreement, across_groups, assemble, axes, batch_axis, infer
from .tolerance import Tolerance, ToleranceSpec, tolerance_for

# What a row holds, and the phase of the step it belongs to.
KINDS = ("weight", "input", "output", "loss", "grad_input", "grad", "param")
PHASES = {
    "weight": "start",
    "input": "forward",
    "output": "forward",
    "loss": "forward",
    "grad_input": "backward",
    "grad": "backward",
    "param": "step",
}


@dataclass(frozen=True, slots=True, order=True)
class RowKey:
    """One tensor of a step: ``module`` (qualified path, "" for the root), ``call`` (the module's
    n-th forward call, or n-th backward), ``kind`` and ``slot`` (an input's or output's position
    or keyword, a parameter's name)."""

    module: str
    call: int
    kind: str
    slot: str

    @property
    def phase(self) -> str:
        return PHASES[self.kind]

    @property
    def what(self) -> str:
        """``output``, ``input[0]``, ``grad_input[1]``, ``weight.grad``, ``weight after step``."""
        if self.kind == "loss":
            return "loss"
        if self.kind in ("input", "output", "grad_input"):
            return self.kind if self.slot == "" else f"{self.kind}[{self.slot}]"
        if self.kind == "weight":
            return f"{self.slot} at start"
        if self.kind == "grad":
            return f"{self.slot}.grad"
        return f"{self.slot} after step"


@dataclass(frozen=True, slots=True)
class RawTensor:
    """One row as one process saw it: the local tensor of each rank it holds (``None``: every
    rank of the world holds this same value), and the exact Layout when it was a DTensor."""

    key: RowKey
    order: int
    dtype: str
    values: Mapping[int | None, np.ndarray]
    layout: Layout | None = None
    events: tuple[int, int] | None = None  # trace event ids [start, end) while it was computed
    problem: str | None = None  # why no full tensor can be made of it, seen while capturing


# A mesh as the ways it splits the world: (mesh shape, dim names, every instance's global ranks).
MeshSplit = tuple[tuple[int, ...], tuple[str, ...] | None, tuple[tuple[int, ...], ...]]


@dataclass(frozen=True, slots=True)
class RawCapture:
    """What one process captured of a step (every simulated rank, or one real rank)."""

    world_size: int
    root: str  # the root module's class name
    modules: tuple[tuple[str, str], ...]  # (path, class name), in the module tree's order
    tensors: tuple[RawTensor, ...]
    nbytes: int = 0
    notes: tuple[str, ...] = ()  # about the run as a whole (a forward-only step)
    meshes: tuple[MeshSplit, ...] = ()  # the meshes the step built


@dataclass(frozen=True, slots=True)
class Entry:
    """One row of one run: the full tensor (or why there is none) and how it was made."""

    key: RowKey
    order: int
    dtype: str
    full: np.ndarray | None
    layout: Layout | None = None  # None: a single device's tensor
    inferred: bool = False
    notes: tuple[str, ...] = ()
    disagreements: tuple[Disagreement, ...] = ()
    problem: str | None = None
    events: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...] | None:
        if self.full is not None:
            return tuple(self.full.shape)
        return self.layout.global_shape if self.layout is not None else None


@dataclass(frozen=True, slots=True)
class EventNote:
    """A collective or redistribute of the parallel run, in words (the report holds no Trace)."""

    id: int
    kind: str
    text: str
    module: str | None  # module path ("" for the root), as rows name modules
    phase: str | None
    parent: int | None = None


@dataclass(frozen=True)
class StepNumerics:
    """Every row of one run of a step, assembled into full tensors: what ``sv.diff`` compares.

    ``label`` names the run ("plain torch", "local, 8 ranks"); ``trace`` is the run's recorded
    Trace (None for plain torch), ``events`` its collectives and redistributes in words."""

    label: str
    world_size: int
    root: str
    modules: tuple[tuple[str, str], ...]
    entries: Mapping[RowKey, Entry]
    events: Mapping[int, EventNote] = field(default_factory=dict)
    trace: Any = None
    notes: tuple[str, ...] = ()
    # Each row's rounding error, measured against the same step in float64 (a reference run in a
    # dtype below float32 carries it): what the tolerance allows beyond the dtype's rule.
    rounding: Mapping[RowKey, float] = field(default_factory=dict)

    def __getitem__(self, key: RowKey) -> Entry:
        return self.entries[key]

    def __len__(self) -> int:
        return len(self.entries)

    def name(self, module: str) -> str:
        """A module's name as the report prints it: the root's class name, then the path."""
        return f"{self.root}.{module}" if module else self.root

    def shapes(self) -> dict[RowKey, tuple[int, ...]]:
        """Each row's global shape (what a parallel run's plain local tensors are laid out in)."""
        return {k: e.shape for k, e in self.entries.items() if e.shape is not None}

    def __repr__(self) -> str:
        return (
            f"<StepNumerics {self.label}: {self.root}, {len(self.entries)} rows, {self.world_size} rank(s)>"
        )

    def __str__(self) -> str:
        bad = [e for e in self.entries.values() if e.problem or e.disagreements]
        head = (
            f"StepNumerics {self.label}: {self.root}, {len(self.entries)} rows on {self.world_size} rank(s)"
        )
        lines = [head]
        for e in sorted(bad, key=lambda e: e.order):
            where = f"{self.name(e.key.module)} {e.key.phase} {e.key.what}"
            for d in e.disagreements:
                lines.append(f"  {where}: {d}")
            if e.problem:
                lines.append(f"  {where}: not assembled: {e.problem}")
        return "\n".join(lines)


def rounding_errors(run: StepNumerics, exact: StepNumerics) -> dict[RowKey, float]:
    """Each float row's largest difference between ``run`` and the same step computed in float64
    (``exact``), over the elements finite in both: how far the run's own rounding took it."""
    out: dict[RowKey, float] = {}
    for key, e in run.entries.items():
        x = exact.entries.get(key)
        if e.full is None or x is None or x.full is None or e.full.shape != x.full.shape:
            continue
        a, b = np.asarray(e.full), np.asarray(x.full)
        if a.dtype.kind not in "fc" or not a.size:
            continue
        a, b = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), b.astype(np.float64)
        both = np.isfinite(a) & np.isfinite(b)
        if both.any():
            out[key] = float(np.abs(a[both] - b[both]).max())
    return out


def merge_raw(raws: Sequence[RawCapture]) -> RawCapture:
    """One capture from every process's (real ranks each report their own pieces)."""
    if not raws:
        raise ValueError("no captures to merge")
    first = raws[0]
    if len(raws) == 1 or all(r is first for r in raws):
        return first
    by_key: dict[RowKey, RawTensor] = {}
    for raw in raws:
        for t in raw.tensors:
            have = by_key.get(t.key)
            if have is None:
                by_key[t.key] = t
            else:
                by_key[t.key] = dataclasses.replace(
                    have, values={**have.values, **t.values}, order=min(have.order, t.order)
                )
    modules = list(first.modules)
    for raw in raws[1:]:
        modules += [m for m in raw.modules if m not in modules]
    return RawCapture(
        world_size=first.world_size,
        root=first.root,
        modules=tuple(modules),
        tensors=tuple(sorted(by_key.values(), key=lambda t: t.order)),
        nbytes=sum(r.nbytes for r in raws),
        notes=tuple(dict.fromkeys(n for r in raws for n in r.notes)),
        meshes=tuple(dict.fromkeys(m for r in raws for m in r.meshes)),
    )


def build_run(
    label: str,
    raw: RawCapture,
    *,
    shapes: Mapping[RowKey, tuple[int, ...]] | None = None,
    tolerance: ToleranceSpec = None,
    events: Mapping[int, EventNote] | None = None,
    trace: Any = None,
) -> StepNumerics:
    """Full tensors for every row of one run. ``shapes`` are the reference's global shapes, by
    which a plain local tensor's layout is inferred (see ``infer``)."""
    world = raw.world_size
    layouts = [t.layout for t in raw.tensors if t.layout is not None]
    candidates = axes(layouts, raw.meshes, _trace_groups(trace, world))
    meshes = sorted(
        {(lay.mesh_shape, lay.mesh_dim_names, lay.instances) for lay in layouts} | set(raw.meshes),
        key=lambda m: (len(m[0]), m[0], str(m[1])),
    )
    entries: dict[RowKey, Entry] = {}
    batch: str | None = None  # the mesh dim that split the model's input rows
    for t in raw.tensors:
        tol = tolerance_for(t.dtype, tolerance)
        values = _per_rank(t.values, world)
        base = Entry(t.key, t.order, t.dtype, None, events=t.events)
        if t.problem is not None:
            got = Assembled(None, None, problem=t.problem)
        elif t.layout is not None:
            got = assemble(t.layout, values, tol)
            ref_shape = (shapes or {}).get(t.key)
            if ref_shape is not None and tuple(ref_shape) != t.layout.global_shape and t.layout.groups:
                got = across_groups(t.layout, values, ref_shape, tol) or got
        elif world == 1:
            (v,) = values.values()
            got = Assembled(np.asarray(v), None)
        else:
            got = _plain(values, world, (shapes or {}).get(t.key), candidates, tol, meshes, batch)
            if batch is None and got.inferred and t.key.kind == "input":
                batch = batch_axis(got.layout)
        entries[t.key] = dataclasses.replace(
            base,
            full=got.full,
            layout=got.layout,
            inferred=got.inferred,
            notes=got.notes,
            disagreements=got.disagreements,
            problem=got.problem,
        )
    return StepNumerics(label, world, raw.root, raw.modules, entries, dict(events or {}), trace, raw.notes)


def _trace_groups(trace: Any, world: int) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """The rank groups of the run's collectives that split the whole world in equal parts (a
    hand-written data parallel's gradient all-reduce): ways a plain local tensor may be split,
    where the run built no mesh shardviz saw (real ranks)."""
    out: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
    for e in getattr(trace, "events", ()):
        groups = getattr(e, "groups", None)
        if not groups or len({len(g) for g in groups}) != 1:
            continue
        if sorted(r for g in groups for r in g) != list(range(world)):
            continue
        name = getattr(e, "mesh_dim_name", None) or f"the groups of {len(groups[0])} ranks"
        out.append((name, tuple(tuple(g) for g in groups)))
    return out


def _per_rank(values: Mapping[int | None, np.ndarray], world: int) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    every = values.get(None)
    if every is not None:
        out = {r: every for r in range(world)}
    out.update({r: v for r, v in values.items() if r is not None})
    return out


def _plain(
    values: Mapping[int, np.ndarray],
    world: int,
    ref_shape: tuple[int, ...] | None,
    candidates: Sequence[Axis],
    tol: Tolerance,
    meshes: Sequence[MeshSplit] = (),
    batch: str | None = None,
) -> Assembled:
    """A plain tensor of a parallel run: the same on every rank (checked), or a local shard."""
    shapes = {tuple(np.asarray(v).shape) for v in values.values()}
    if (ref_shape is None and len(shapes) == 1) or shapes == {tuple(ref_shape or ())}:
        (shape,) = shapes
        lay = _compute_layout(shape, (world,), ["R"], ("world",))
        got = assemble(lay, values, tol)
        return dataclasses.replace(
            got,
            disagreements=tuple(
                dataclasses.replace(d, scope="a plain tensor, the same on every rank")
                for d in got.disagreements
            ),
        )
    if ref_shape is None:
        return Assembled(
            None,
            None,
            problem=f"plain local tensors of different shapes ({', '.join(map(str, sorted(shapes)))}) and no "
            "reference shape to lay them out in",
        )
    return infer(ref_shape, values, candidates, tol, meshes, batch)
