"""Layer-by-layer numerics of a training step, as plain data: full tensors from per-rank shards,
and where a parallel run first leaves a reference run.

A run reports, for every module call, what went in and out, the gradients flowing back out of
it, each parameter at the start, its gradient and its value after the optimizer step — as each
rank's local tensor and, for a DTensor, its placements (``RawCapture``, built by
``shardviz.numerics_capture`` on every rank, or once for all simulated ranks). ``build_run``
turns the per-rank pieces into one full tensor per row (``assemble``): Shard concatenated at its
true (uneven, strided) indices, Partial reduced by its op, FSDP's padding dropped, and every
replica — Replicate mesh dims, the groups of a sub-mesh, plain tensors on every rank — checked
against the others: replicas that disagree are a finding of their own, with the ranks named.
A plain local tensor (what ``to_local()`` hands a module in tensor-parallel code) has no
placements; its layout is inferred from the reference's global shape and the run's meshes, and
marked as inferred. ``compare`` sets two runs side by side and returns a ``NumericsReport``.

No torch here: a report is made on any rank, saved in a notebook, drawn by the views.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from . import mesh as _mesh
from .layout import Layout
from .layout import compute as _compute_layout
from .placement import parse

# --- tolerances ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Tolerance:
    """When two values of one row count as equal: ``|a - b| <= atol * scale + rtol * |b|``, where
    ``b`` is the reference and ``scale`` the largest ``|b|`` in the tensor. ``atol`` is relative to
    the tensor's scale so that a gradient of size 1e-4 and an activation of size 10 are held to the
    same relative precision; zero for both means exact (integers, booleans)."""

    rtol: float
    atol: float

    def __str__(self) -> str:
        if not self.rtol and not self.atol:
            return "exact"
        return f"rtol {self.rtol:g}, atol {self.atol:g} x max|ref|"


# Float reductions reordered across ranks (a sharded matmul, a reduce-scatter) differ from a
# single device's in the last bits; these leave room for that and catch anything larger.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-9, 1e-9),
    "complex128": Tolerance(1e-9, 1e-9),
    "float32": Tolerance(1e-5, 1e-5),
    "complex64": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(1e-3, 1e-3),
    "complex32": Tolerance(1e-3, 1e-3),
    "bfloat16": Tolerance(1e-2, 1e-2),
}
_LOW_PRECISION = Tolerance(1e-1, 1e-1)  # float8 variants
EXACT = Tolerance(0.0, 0.0)

ToleranceSpec = float | tuple[float, float] | Tolerance | Mapping[str, Any] | None


def _one_tolerance(value: Any, what: str) -> Tolerance:
    if isinstance(value, Tolerance):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return Tolerance(float(value), float(value))
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        return Tolerance(float(value[0]), float(value[1]))
    raise TypeError(
        f"tolerance {what}{value!r}: give a number (rtol = atol), a (rtol, atol) pair, a Tolerance, or a "
        'dict by dtype name such as {"float32": 1e-4, "bfloat16": (2e-2, 1e-2)}'
    )


def tolerance_for(dtype: str, spec: ToleranceSpec = None) -> Tolerance:
    """The tolerance of a dtype: the default table, overridden by ``spec`` (a number or pair for
    every float dtype, or a dict by dtype name). Integers and booleans compare exactly."""
    exact = not (dtype.startswith(("float", "complex", "bfloat")))
    if isinstance(spec, Mapping):
        if dtype in spec:
            return _one_tolerance(spec[dtype], f"for {dtype}: ")
        spec = None
    if exact:
        return EXACT
    if spec is not None:
        return _one_tolerance(spec, "")
    return TOLERANCES.get(dtype, _LOW_PRECISION if dtype.startswith("float8") else TOLERANCES["float32"])


def check_tolerance(spec: ToleranceSpec) -> None:
    """Refuse a malformed tolerance before any run starts (a typo found after minutes is costly)."""
    if spec is None:
        return
    if isinstance(spec, Mapping):
        for k, v in spec.items():
            if not isinstance(k, str):
                raise TypeError(f"tolerance dict keys are dtype names such as 'float32', not {k!r}")
            _one_tolerance(v, f"for {k}: ")
        return
    _one_tolerance(spec, "")


# --- what is captured ------------------------------------------------------------------------------

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


@dataclass(frozen=True, slots=True)
class RawCapture:
    """What one process captured of a step (every simulated rank, or one real rank)."""

    world_size: int
    root: str  # the root module's class name
    modules: tuple[tuple[str, str], ...]  # (path, class name), in the module tree's order
    tensors: tuple[RawTensor, ...]
    nbytes: int = 0


# --- findings ----------------------------------------------------------------------------------------


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
            return f"ranks {_ranks(g)}" if len(g) > 1 else f"rank {g[0]}"

        others = self.groups[1:]
        verb = "differs" if len(others) == 1 and len(others[0]) == 1 else "differ"
        at = f" at {list(self.index)}" if self.index else ""
        return (
            f"{self.scope}: {', '.join(who(g) for g in others)} {verb} from {who(self.groups[0])} "
            f"(max abs {_num(self.max_abs)}{at})"
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


def _ranks(ranks: Iterable[int]) -> str:
    rs = sorted(set(ranks))
    out = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ",".join(out)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.2g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.1e}"


def _widened(a: np.ndarray) -> np.ndarray:
    """Values as compared: float64 (complex128 for complex), integers and booleans as they are."""
    if a.dtype.kind == "c":
        return a.astype(np.complex128, copy=False)
    if a.dtype.kind in "biu":
        return a
    return a.astype(np.float64, copy=False)


def _reduce(values: Sequence[np.ndarray], op: str | None) -> np.ndarray:
    if len(values) == 1 or op is None:
        return _widened(values[0])
    stack = [_widened(v) for v in values]
    if op == "max":
        return np.maximum.reduce(stack)
    if op == "min":
        return np.minimum.reduce(stack)
    if op == "product":
        return np.multiply.reduce(stack)
    total = np.add.reduce([s.astype(np.result_type(s, np.float64)) for s in stack])
    return total / len(stack) if op == "avg" else total


def _close(a: np.ndarray, b: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Element-wise: is ``a`` within ``tol`` of the reference ``b`` (NaN equals NaN)."""
    if (a.dtype.kind in "biu" and b.dtype.kind in "biu") or (not tol.rtol and not tol.atol):
        with np.errstate(invalid="ignore"):
            return (a == b) | (_isnan(a) & _isnan(b))
    diff = _absdiff(a, b)
    scale = _scale(b)
    with np.errstate(invalid="ignore"):
        return diff <= tol.atol * scale + tol.rtol * np.abs(b)


def _isnan(a: np.ndarray) -> np.ndarray:
    return np.isnan(a) if a.dtype.kind in "fc" else np.zeros(a.shape, dtype=bool)


def _absdiff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in float64, 0 where both are NaN or the same infinity, inf where one is NaN."""
    x, y = _widened(a), _widened(b)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x.astype(np.result_type(x, np.float64)) - y.astype(np.result_type(y, np.float64)))
    d = np.asarray(d, dtype=np.float64)
    if x.dtype.kind in "fc" or y.dtype.kind in "fc":
        nx, ny = _isnan(x), _isnan(y)
        same_inf = np.isinf(x) & np.isinf(y) & (x == y) if x.dtype.kind in "fc" else np.zeros(d.shape, bool)
        d = np.where(nx & ny, 0.0, d)
        d = np.where(nx ^ ny, np.inf, d)
        d = np.where(same_inf, 0.0, d)
    return d


def _scale(b: np.ndarray) -> float:
    """The tensor's largest finite magnitude (what ``atol`` is relative to)."""
    if b.size == 0:
        return 0.0
    m = np.abs(_widened(b))
    finite = m[np.isfinite(m)] if m.dtype.kind in "fc" else m
    return float(finite.max()) if finite.size else 0.0


def _cluster(
    units: Sequence[tuple[tuple[int, ...], np.ndarray]], tol: Tolerance
) -> list[tuple[tuple[int, ...], np.ndarray]]:
    """Copies grouped by agreement (each joins the first group whose value it is close to);
    largest group first, then the one holding the lowest rank."""
    groups: list[tuple[list[int], np.ndarray]] = []
    for ranks, value in units:
        for members, rep in groups:
            if value.shape == rep.shape and bool(np.all(_close(value, rep, tol))):
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
        d = _absdiff(v, first)
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


def _index_arrays(indices: tuple[tuple[range, ...], ...]) -> tuple[np.ndarray, ...]:
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
        return Assembled(None, layout, problem=f"no values from rank(s) {_ranks(missing)}")
    notes = []
    if padded:
        notes.append(f"padding cut from the local tensors of ranks {_ranks(padded)} (FSDP pads short shards)")
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
                out[np.ix_(*_index_arrays(first.indices))] = chosen
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


# --- layouts of plain tensors ------------------------------------------------------------------------

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
        if not bool(np.all(_close(other.full, first.full, tol))):
            return Assembled(
                None,
                None,
                problem=f"plain local tensors split along dim {dim}, but by shape alone they fit both "
                f"{first.layout.mesh_dim_names} and {other.layout.mesh_dim_names}, which give different "
                "tensors (return a DTensor to compare it)",
            )
    return first


# --- one run ---------------------------------------------------------------------------------------


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
    candidates = axes(layouts)
    entries: dict[RowKey, Entry] = {}
    for t in raw.tensors:
        tol = tolerance_for(t.dtype, tolerance)
        values = _per_rank(t.values, world)
        base = Entry(t.key, t.order, t.dtype, None, events=t.events)
        if t.layout is not None:
            got = assemble(t.layout, values, tol)
        elif world == 1:
            (v,) = values.values()
            got = Assembled(np.asarray(v), None)
        else:
            got = _plain(values, world, (shapes or {}).get(t.key), candidates, tol)
        entries[t.key] = dataclasses.replace(
            base,
            full=got.full,
            layout=got.layout,
            inferred=got.inferred,
            notes=got.notes,
            disagreements=got.disagreements,
            problem=got.problem,
        )
    return StepNumerics(label, world, raw.root, raw.modules, entries, dict(events or {}), trace)


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
    return infer(ref_shape, values, candidates, tol)


# --- two runs --------------------------------------------------------------------------------------

STATUSES = ("ok", "differs", "replicas", "shape", "unassembled", "missing")


@dataclass(frozen=True, slots=True)
class DiffRow:
    """One row of the report: a tensor of the parallel run against the reference's.

    ``status``: ``ok``; ``differs`` (beyond ``tolerance``); ``replicas`` (equal to the reference
    where it was read, but copies that should agree do not); ``shape``; ``unassembled`` (its
    full tensor could not be made: ``notes`` says why); ``missing`` (in one run only).
    ``spans`` are, per tensor dim, the index ranges holding elements that differ; ``ranks`` the
    ranks whose shards hold them; ``error`` the per-element error in units of the tolerance
    (above 1 differs), for heat-maps.
    """

    key: RowKey
    module: str
    status: str
    dtype: str
    shape: tuple[int, ...] | None
    tolerance: Tolerance
    order: int
    max_abs: float | None = None
    max_rel: float | None = None
    worst: float | None = None  # the largest error, in units of the tolerance
    index: tuple[int, ...] | None = None  # where it is
    values: tuple[Any, Any] | None = None  # (parallel, reference) there
    count: int = 0  # elements beyond the tolerance
    numel: int = 0
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()
    ranks: tuple[int, ...] = ()
    disagreements: tuple[Disagreement, ...] = ()
    reference_disagreements: tuple[Disagreement, ...] = ()
    events: tuple[EventNote, ...] = ()
    events_during: bool = False  # the events ran while this row was computed (else: just before)
    notes: tuple[str, ...] = ()
    layout: Layout | None = None
    inferred: bool = False
    error: np.ndarray | None = None

    @property
    def phase(self) -> str:
        return self.key.phase

    @property
    def what(self) -> str:
        return self.key.what

    @property
    def differs(self) -> bool:
        """A finding: beyond tolerance, replicas that disagree, or another shape."""
        return self.status in ("differs", "replicas", "shape")

    def where(self) -> str:
        """The index ranges that differ, per dim: ``dim 1 [0:4, 8:12], dim 2 [all 64]``."""
        if not self.spans or self.shape is None:
            return ""
        parts = []
        for d, runs in enumerate(self.spans):
            n = self.shape[d]
            if runs == ((0, n),):
                parts.append(f"dim {d} [all {n}]")
            else:
                parts.append(f"dim {d} [{', '.join(f'{a}:{b}' if b - a > 1 else str(a) for a, b in runs)}]")
        return ", ".join(parts)

    def __str__(self) -> str:
        return f"{self.module} {self.phase} {self.what}: {self.status}"


def _runs(idx: np.ndarray) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for i in idx.tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


def _errors(got: np.ndarray, want: np.ndarray, tol: Tolerance) -> dict[str, Any]:
    """The numbers of a comparison: max abs / rel error, the worst element, which differ."""
    diff = _absdiff(got, want)
    scale = _scale(want)
    absw = np.abs(_widened(want)).astype(np.float64)
    bound = tol.atol * scale + tol.rtol * absw
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(bound > 0, diff / np.where(bound > 0, bound, 1), np.where(diff > 0, np.inf, 0.0))
        rel = diff / np.maximum(absw, max(tol.atol * scale, np.finfo(np.float64).tiny))
    bad = units > 1
    out: dict[str, Any] = {
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "max_rel": float(rel.max()) if rel.size else 0.0,
        "count": int(bad.sum()),
        "numel": int(diff.size),
        "error": units.astype(np.float32),
    }
    if diff.size:
        k = int(np.argmax(units))
        index = tuple(int(i) for i in np.unravel_index(k, diff.shape))
        out["worst"] = float(units.flat[k])
        out["index"] = index
        out["values"] = (_item(got, index), _item(want, index))
    if bad.any():
        nd = bad.ndim
        out["spans"] = tuple(
            _runs(np.flatnonzero(bad.any(axis=tuple(a for a in range(nd) if a != d)))) for d in range(nd)
        )
    return out


def _item(a: np.ndarray, index: tuple[int, ...]) -> Any:
    v = a[index] if index else a[()]
    return v.item() if hasattr(v, "item") else v


def _holding(layout: Layout | None, bad: np.ndarray) -> tuple[int, ...]:
    """Ranks whose local tensors hold any of the elements marked in ``bad``."""
    if layout is None or not bad.any():
        return ()
    out = []
    for s in layout.shards:
        if s.empty:
            continue
        if not bad.shape or bool(bad[np.ix_(*_index_arrays(s.indices))].any()):
            out.append(s.rank)
    return tuple(sorted(out))


def compare(
    reference: StepNumerics,
    parallel: StepNumerics,
    tolerance: ToleranceSpec = None,
    *,
    context: int = 6,
) -> NumericsReport:
    """Every row of ``parallel`` against the same row of ``reference``; the report's first
    difference is the first row, in the parallel run's order, that differs. ``context`` is how
    many collectives and redistributes each row keeps from just before it."""
    keys = list(parallel.entries)
    keys += [k for k in reference.entries if k not in parallel.entries]
    last = max((e.order for e in parallel.entries.values()), default=0) + 1
    rows: list[DiffRow] = []
    for key in keys:
        p = parallel.entries.get(key)
        r = reference.entries.get(key)
        entry = p if p is not None else r
        assert entry is not None
        tol = _looser(
            tolerance_for(p.dtype, tolerance) if p else None, tolerance_for(r.dtype, tolerance) if r else None
        )
        base = DiffRow(
            key=key,
            module=reference.name(key.module) if r is not None else parallel.name(key.module),
            status="ok",
            dtype=entry.dtype,
            shape=entry.shape,
            tolerance=tol,
            order=p.order if p is not None else last + (r.order if r is not None else 0),
        )
        if p is None or r is None:
            side = "the reference" if p is None else "the parallel run"
            rows.append(dataclasses.replace(base, status="missing", notes=(f"only in {side}",)))
            continue
        events, during = _events_for(p, parallel, context)
        notes = list(p.notes)
        if r.dtype != p.dtype:
            notes.append(f"dtype {p.dtype} here, {r.dtype} in the reference")
        row = dataclasses.replace(
            base,
            disagreements=p.disagreements,
            reference_disagreements=r.disagreements,
            events=events,
            events_during=during,
            layout=p.layout,
            inferred=p.inferred,
        )
        if p.full is None or r.full is None:
            why = p.problem if p.full is None else f"the reference: {r.problem}"
            rows.append(dataclasses.replace(row, status="unassembled", notes=(*notes, why or "no values")))
            continue
        if p.full.shape != r.full.shape:
            notes.append(f"shape {tuple(p.full.shape)} here, {tuple(r.full.shape)} in the reference")
            rows.append(dataclasses.replace(row, status="shape", notes=tuple(notes)))
            continue
        stats = _errors(p.full, r.full, tol)
        ranks = _holding(p.layout, stats["error"] > 1)
        status = "differs" if stats["count"] else ("replicas" if p.disagreements else "ok")
        notes += [hint for d in p.disagreements if (hint := _partial_hint(d, r.full, tol))]
        rows.append(
            dataclasses.replace(
                row,
                status=status,
                max_abs=stats["max_abs"],
                max_rel=stats["max_rel"],
                worst=stats.get("worst"),
                index=stats.get("index"),
                values=stats.get("values"),
                count=stats["count"],
                numel=stats["numel"],
                spans=stats.get("spans", ()),
                ranks=ranks,
                notes=tuple(notes),
                error=stats["error"],
            )
        )
    rows.sort(key=lambda row: row.order)
    return NumericsReport(
        reference.label,
        parallel.label,
        reference.root,
        _tree(reference, parallel),
        tuple(rows),
        parallel.world_size,
        tolerance,
        parallel.trace,
    )


def _partial_hint(d: Disagreement, want: np.ndarray, tol: Tolerance) -> str | None:
    """A note when copies that should agree add up (or average) to the reference: the classic
    Partial value read as if it were replicated (an output left Partial, a missing all-reduce)."""
    values = [v for v in d.values if v.shape == want.shape]
    if len(values) < 2 or len(values) != len(d.values):
        return None
    total = np.add.reduce([_widened(v).astype(np.result_type(v, np.float64)) for v in values])
    for op, candidate in (("sum", total), ("avg", total / len(values))):
        if bool(np.all(_close(candidate, want, tol))):
            groups = "; ".join(_ranks(g) for g in d.groups)
            verb = "add up" if op == "sum" else "average"
            return (
                f"the {len(values)} differing copies (ranks {groups}) {verb} to the reference: a "
                f"Partial({op}) value used as if it were replicated (an output left Partial, or a missing "
                "all-reduce)"
            )
    return None


def _looser(a: Tolerance | None, b: Tolerance | None) -> Tolerance:
    if a is None or b is None:
        return a or b or EXACT
    return Tolerance(max(a.rtol, b.rtol), max(a.atol, b.atol))


def _events_for(entry: Entry, run: StepNumerics, context: int) -> tuple[tuple[EventNote, ...], bool]:
    """The collectives and redistributes that ran while the row was computed (its module's own,
    for a gradient or a parameter), or else the last ones before it."""
    if entry.events is None or not run.events:
        return (), False
    start, end = entry.events
    notes = [run.events[i] for i in sorted(run.events) if i < end]
    if entry.key.kind in ("grad", "param", "weight"):
        mod = entry.key.module
        own = [
            n
            for n in notes
            if n.id >= start
            and n.module is not None
            and (n.module == "" or mod == n.module or mod.startswith(n.module + "."))
        ]
        if own:
            return tuple(own[-context:]), True
    during = [n for n in notes if n.id >= start]
    if during:
        return tuple(during[-context:]), True
    return tuple(notes[-min(context, 3) :]), False


def _tree(reference: StepNumerics, parallel: StepNumerics) -> tuple[tuple[str, str], ...]:
    mods = list(reference.modules)
    mods += [m for m in parallel.modules if m[0] not in {p for p, _ in mods}]
    return tuple(mods)


# --- the report ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class NumericsReport:
    """Where a parallel run of a training step leaves a reference run, row by row.

    ``rows`` are in the parallel run's order (forward, loss, backward, gradients, the step);
    ``first`` is the first that differs (None when none does). ``str(report)`` is the summary
    and the module tree with the error of every row; ``sv.show`` / ``sv.plot`` /
    ``sv.export_html`` draw it.
    """

    reference: str
    parallel: str
    root: str
    modules: tuple[tuple[str, str], ...]
    rows: tuple[DiffRow, ...]
    world_size: int
    tolerance: ToleranceSpec = None
    # The parallel run's Trace (event ids in the rows are its ids): sv.play(report.trace, step=...).
    trace: Any = field(default=None, repr=False, compare=False)

    @property
    def differences(self) -> list[DiffRow]:
        return [r for r in self.rows if r.differs]

    @property
    def unassembled(self) -> list[DiffRow]:
        return [r for r in self.rows if r.status == "unassembled"]

    @property
    def missing(self) -> list[DiffRow]:
        return [r for r in self.rows if r.status == "missing"]

    @property
    def first(self) -> DiffRow | None:
        for r in self.rows:
            if r.differs:
                return r
        return None

    @property
    def ok(self) -> bool:
        """No difference, nothing missing and every row assembled."""
        return not any(r.status != "ok" for r in self.rows)

    def after(self) -> list[DiffRow]:
        """The rows that differ after the first one."""
        diffs = self.differences
        return diffs[1:]

    def row(self, module: str, what: str = "output", call: int = 0) -> DiffRow:
        """A row by module name (with or without the root's class name) and ``what`` as printed
        (``"output"``, ``"input[0]"``, ``"grad_input[0]"``, ``"weight.grad"``, ...)."""
        path = module.removeprefix(self.root).removeprefix(".") if module.startswith(self.root) else module
        for r in self.rows:
            if r.key.module == path and r.key.call == call and r.what == what:
                return r
        raise KeyError(f"no row {what!r} of {module!r} (call {call}) in this report")

    def summary(self) -> str:
        """What was compared and the first difference, with no per-row table."""
        return "\n".join(self._head())

    def _head(self) -> list[str]:
        n = len(self.differences)
        lines = [
            f"NumericsReport: {self.parallel} against {self.reference}: {len(self.rows)} rows, "
            + (f"{n} differ" if n else "no difference beyond tolerance")
        ]
        first = self.first
        if first is None:
            largest = max(
                (r for r in self.rows if r.worst is not None and r.status == "ok"),
                key=lambda r: r.worst or 0.0,
                default=None,
            )
            if largest is not None and largest.worst:
                lines.append(
                    f"largest error: {largest.worst:.2g} of the tolerance ({largest.tolerance}) at "
                    f"{largest.module} {largest.phase} {largest.what}"
                )
        else:
            lines += describe_row(first, "first difference: ")
            later = self.after()
            if later:
                names = ", ".join(f"{r.module} {r.phase} {r.what}" for r in later[:3])
                more = f", ... ({len(later) - 3} more)" if len(later) > 3 else ""
                lines.append(
                    f"then {len(later)} more row{'s' if len(later) != 1 else ''} differ: {names}{more}"
                )
        if self.unassembled:
            names = ", ".join(f"{r.module} {r.phase} {r.what}" for r in self.unassembled[:3])
            lines.append(f"not assembled: {len(self.unassembled)} row(s) ({names}); see their notes")
        if self.missing:
            lines.append(f"in one run only: {len(self.missing)} row(s)")
        return lines

    def tree(self) -> list[tuple[int, str | None, DiffRow | None]]:
        """The module tree as (depth, module name or None, row or None): one line per module, then
        its rows, modules in the tree's order."""
        by_module: dict[str, list[DiffRow]] = {}
        for r in self.rows:
            by_module.setdefault(r.key.module, []).append(r)
        order = [p for p, _ in self.modules]
        order += [m for m in by_module if m not in order]
        shown = {""} if by_module else set()
        for m in by_module:
            parts = m.split(".") if m else []
            shown.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        out: list[tuple[int, str | None, DiffRow | None]] = []
        for path in order:
            if path not in shown:
                continue
            rows = by_module.get(path, [])
            depth = 0 if not path else path.count(".") + 1
            cls = dict(self.modules).get(path, "")
            name = (path.rsplit(".", 1)[-1] if path else self.root) + (f" ({cls})" if cls and path else "")
            out.append((depth, name, None))
            rows.sort(key=lambda r: (KINDS.index(r.key.kind), r.key.call, r.order))
            out += [(depth + 1, None, r) for r in rows]
        return out

    def table(self) -> str:
        """The module tree, one line per row with its error and status."""
        head = ("module / tensor", "phase", "shape", "dtype", "max abs", "max rel", "status")
        lines: list[tuple[str, ...]] = [head]
        for depth, name, row in self.tree():
            if row is None:
                lines.append(("  " * depth + (name or ""), "", "", "", "", "", ""))
                continue
            call = f" #{row.key.call}" if row.key.call else ""
            lines.append(
                (
                    "  " * depth + row.what + call,
                    row.phase,
                    _shape(row.shape),
                    row.dtype,
                    _num(row.max_abs),
                    _num(row.max_rel),
                    _STATUS_TEXT[row.status],
                )
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in lines
        )

    def __str__(self) -> str:
        return "\n".join([*self._head(), "", self.table()])

    def __repr__(self) -> str:
        first = self.first
        where = f", first at {first.module} {first.phase} {first.what}" if first else ""
        return f"<NumericsReport {self.parallel} vs {self.reference}: {len(self.differences)} differ{where}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


_STATUS_TEXT = {
    "ok": "ok",
    "differs": "DIFFERS",
    "replicas": "REPLICAS DISAGREE",
    "shape": "SHAPE DIFFERS",
    "unassembled": "not assembled",
    "missing": "in one run only",
}


def _shape(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "-"
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def describe_row(row: DiffRow, lead: str = "") -> list[str]:
    """A differing row in words: where, how much, which ranks, and what ran just before."""
    call = f" (call {row.key.call})" if row.key.call else ""
    lines = [f"{lead}{row.module} · {row.phase} · {row.what}{call} · {_STATUS_TEXT[row.status]}"]
    if row.max_abs is not None and row.count:
        lines.append(
            f"  max abs {_num(row.max_abs)}, max rel {_num(row.max_rel)}; {row.count} of {row.numel} "
            f"elements beyond {row.dtype} tolerance ({row.tolerance})"
        )
        if row.index is not None and row.values is not None:
            at = list(row.index) if row.index else "the scalar"
            lines.append(
                f"  worst at {at}: {_value(row.values[0])} here, {_value(row.values[1])} in the reference"
            )
        if row.where():
            lines.append(f"  differs in {row.where()}")
        if row.ranks:
            lines.append(f"  held by rank{'s' if len(row.ranks) > 1 else ''} {_ranks(row.ranks)}")
    lines += [f"  {d}" for d in row.disagreements]
    lines += [f"  in the reference: {d}" for d in row.reference_disagreements]
    if row.layout is not None:
        how = " (inferred)" if row.inferred else ""
        lines.append(
            f"  layout [{', '.join(row.layout.placements)}] on mesh {row.layout.mesh_shape}"
            + (f" {row.layout.mesh_dim_names}" if row.layout.mesh_dim_names else "")
            + how
        )
    lines += [f"  note: {n}" for n in row.notes]
    if row.events:
        lines.append(
            "  collectives and redistributes " + ("while it ran:" if row.events_during else "just before it:")
        )
        lines += [f"    #{e.id} {e.text}" for e in row.events]
    return lines
