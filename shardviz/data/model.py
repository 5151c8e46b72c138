"""The model map: every parameter, buffer, gradient and optimizer state of a module, as plain data.

``capture.model_map`` walks a module tree once and turns each tensor into a
``TensorRow``: global shape, dtype, mesh, placements, and the index of its ``Layout`` (pure
geometry from ``layout.compute``, never a simulation). Bytes per rank are one int64 matrix (rows ×
world ranks) built from one vector per distinct layout, so a 512-rank map of a large model costs
milliseconds per distinct layout, not per parameter or per rank.

Plain (non-DTensor) tensors count as fully replicated on every rank of the world. A DTensor on a
sub-mesh holds bytes on the ranks its ``Layout.shards`` name; every other rank holds none of it.

The map is plain data (tuples, ints, strings, Layouts, one numpy matrix): views read it, a rank can
build it and send it back, ``to_dict``/``from_dict`` round-trip it through JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..geometry.layout import Layout
from ..geometry.layout import compute as _compute_layout
from . import describe
from .describe import bytes_exact, bytes_text, rank_list
from .events import DTYPE_SIZES

KINDS = ("param", "buffer", "grad", "optimizer")


@dataclass(frozen=True, slots=True)
class TensorRow:
    """One tensor of the model: a parameter, a buffer, a parameter's grad or an optimizer state.

    ``name`` is unique in the map: ``"fc1.weight"``, ``"fc1.weight.grad"``,
    ``"fc1.weight:exp_avg"``. ``module`` is the qualified name of the owning module ("" for the
    root), ``param`` the parameter a grad or optimizer state belongs to. ``layout`` indexes
    ``ModelMap.layouts``; ``distributed`` is False for a plain tensor (replicated on every rank).
    """

    name: str
    kind: str
    module: str
    param: str
    global_shape: tuple[int, ...]
    dtype: str
    itemsize: int
    distributed: bool
    layout: int

    @property
    def numel(self) -> int:
        n = 1
        for s in self.global_shape:
            n *= s
        return n

    @property
    def global_bytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True)
class MeshDimTotal:
    """How much of the model one mesh dim shards: global bytes of the tensors that are
    ``S``/``_S`` (sharded), ``R`` (replicated) or ``P`` (partial) along it."""

    name: str
    size: int
    sharded: int
    replicated: int
    partial: int


@dataclass(frozen=True, eq=False)
class ModelMap:
    """A module's tensors, their layouts and the bytes each rank holds.

    ``rows``: one TensorRow per tensor, in module order (a parameter, then its grad and optimizer
    states). ``layouts``: the distinct Layouts the rows index. ``nbytes``: int64 matrix, row ×
    rank, of the bytes each rank holds of each tensor. ``modules``: (qualified name, class name)
    of every module in ``named_modules`` order; the tree is in the dotted names.
    """

    name: str
    world_size: int
    modules: tuple[tuple[str, str], ...]
    rows: tuple[TensorRow, ...]
    layouts: tuple[Layout, ...]
    nbytes: np.ndarray

    # ---- lookups ----

    def row(self, name: str) -> TensorRow:
        """The row of the tensor named ``name`` (``"layers.0.attention.wq.weight"``; KeyError if none)."""
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no tensor named {name!r} in this model map (names look like {self.rows[0].name!r})")

    def index(self, name: str) -> int:
        """The position of the tensor named ``name`` in ``rows``."""
        return self.rows.index(self.row(name))

    def layout(self, name: str | int) -> Layout:
        """The Layout of a tensor (by name or row index): open it with ``sv.show``."""
        r = self.rows[name] if isinstance(name, int) else self.row(name)
        return self.layouts[r.layout]

    def local_shape(self, name: str | int, rank: int) -> tuple[int, ...] | None:
        """The local shape ``rank`` holds of a tensor, or None if it holds none of it."""
        for s in self.layout(name).shards:
            if s.rank == rank:
                return s.shape
        return None

    def bytes_of(self, name: str | int) -> np.ndarray:
        """Bytes each rank holds of one tensor (int64, one entry per rank of the world)."""
        i = name if isinstance(name, int) else self.index(name)
        return self.nbytes[i]

    # ---- totals ----

    def totals(self, kind: str | None = None) -> np.ndarray:
        """Bytes each rank holds (int64 per rank): the sum over rows, or over one kind's rows."""
        if kind is None:
            return self.nbytes.sum(axis=0, dtype=np.int64)
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}")
        mask = np.array([r.kind == kind for r in self.rows], dtype=bool)
        return self.nbytes[mask].sum(axis=0, dtype=np.int64)

    def totals_by_kind(self) -> dict[str, np.ndarray]:
        """Bytes per rank of each kind present (param, buffer, grad, optimizer)."""
        kinds = [k for k in KINDS if any(r.kind == k for r in self.rows)]
        return {k: self.totals(k) for k in kinds}

    def by_mesh_dim(self) -> tuple[MeshDimTotal, ...]:
        """Per mesh dim (by name and size): global bytes sharded, replicated and partial along it.
        Plain tensors are on no mesh and count in none."""
        acc: dict[tuple[str, int], list[int]] = {}
        for r in self.rows:
            if not r.distributed:
                continue
            lay = self.layouts[r.layout]
            for m, p in enumerate(lay.placements):
                key = (lay.dim_name(m), lay.mesh_shape[m])
                slot = acc.setdefault(key, [0, 0, 0])
                kind = 0 if p.startswith(("S", "_S")) else 2 if p.startswith("P") else 1
                slot[kind] += r.global_bytes
        return tuple(MeshDimTotal(n, s, *v) for (n, s), v in acc.items())

    @property
    def global_bytes(self) -> int:
        """Bytes of the whole model state, unsharded (each tensor counted once)."""
        return sum(r.global_bytes for r in self.rows)

    # ---- plain data ----

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; ``from_dict`` restores an equal map."""
        return {
            "name": self.name,
            "world_size": self.world_size,
            "modules": [list(m) for m in self.modules],
            "rows": [
                {
                    "name": r.name,
                    "kind": r.kind,
                    "module": r.module,
                    "param": r.param,
                    "global_shape": list(r.global_shape),
                    "dtype": r.dtype,
                    "itemsize": r.itemsize,
                    "distributed": r.distributed,
                    "layout": r.layout,
                }
                for r in self.rows
            ],
            "layouts": [lay.to_dict() for lay in self.layouts],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelMap:
        """The model map ``to_dict`` wrote."""
        rows = tuple(
            TensorRow(
                name=str(r["name"]),
                kind=str(r["kind"]),
                module=str(r["module"]),
                param=str(r["param"]),
                global_shape=tuple(int(s) for s in r["global_shape"]),
                dtype=str(r["dtype"]),
                itemsize=int(r["itemsize"]),
                distributed=bool(r["distributed"]),
                layout=int(r["layout"]),
            )
            for r in d["rows"]
        )
        layouts = tuple(Layout.from_dict(x) for x in d["layouts"])
        world = int(d["world_size"])
        return cls(
            name=str(d["name"]),
            world_size=world,
            modules=tuple((str(a), str(b)) for a, b in d["modules"]),
            rows=rows,
            layouts=layouts,
            nbytes=_matrix(rows, layouts, world),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelMap):
            return NotImplemented
        return (
            self.name == other.name
            and self.world_size == other.world_size
            and self.modules == other.modules
            and self.rows == other.rows
            and self.layouts == other.layouts
            and np.array_equal(self.nbytes, other.nbytes)
        )

    __hash__ = None  # type: ignore[assignment]

    # ---- text ----

    def __str__(self) -> str:
        return text(self)

    def __repr__(self) -> str:
        counts = ", ".join(f"{sum(r.kind == k for r in self.rows)} {k}" for k in KINDS)
        return f"ModelMap({self.name!r}, world_size={self.world_size}, {len(self.rows)} tensors: {counts})"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


# ---- building -----------------------------------------------------------------------------------


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype given by name ("float32", "bfloat16", ...)."""
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}") from None


def _bytes_vector(layout: Layout, size: int, world: int) -> np.ndarray:
    out = np.zeros(world, dtype=np.int64)
    for s in layout.shards:
        if s.rank < world:
            out[s.rank] += s.numel() * size
    return out


def _matrix(rows: Sequence[TensorRow], layouts: Sequence[Layout], world: int) -> np.ndarray:
    memo: dict[tuple[int, int], np.ndarray] = {}
    vecs = []
    for r in rows:
        key = (r.layout, r.itemsize)
        v = memo.get(key)
        if v is None:
            v = memo[key] = _bytes_vector(layouts[r.layout], r.itemsize, world)
        vecs.append(v)
    if not vecs:
        return np.zeros((0, world), dtype=np.int64)
    return np.stack(vecs)


class Builder:
    """A ModelMap row by row: tensors with a Layout, and plain tensors, replicated over the world
    once it is known (``finish``). ``capture.model_map`` feeds it a live module's tensors."""

    def __init__(self, world: int | None) -> None:
        self.world = world
        self.rows: list[TensorRow] = []
        self.layouts: list[Layout] = []
        self.layout_ids: dict[int, int] = {}  # id(Layout) -> index (compute() memoises layouts)
        self.names: set[str] = set()
        self.pending_plain: list[int] = []  # rows whose replicated layout waits for the world size

    def _index(self, layout: Layout) -> int:
        i = self.layout_ids.get(id(layout))
        if i is None:
            i = self.layout_ids[id(layout)] = len(self.layouts)
            self.layouts.append(layout)
        return i

    def _name(self, name: str) -> None:
        if name in self.names:
            raise ValueError(f"model_map: two tensors named {name!r}")
        self.names.add(name)

    def add_layout(
        self,
        name: str,
        kind: str,
        module: str,
        param: str,
        layout: Layout,
        distributed: bool,
        size: int | None = None,
    ) -> None:
        """A tensor laid out by ``layout`` (``size``: bytes per element, else from its dtype)."""
        self._name(name)
        self.rows.append(
            TensorRow(
                name=name,
                kind=kind,
                module=module,
                param=param,
                global_shape=tuple(layout.global_shape),
                dtype=layout.dtype,
                itemsize=itemsize(layout.dtype) if size is None else size,
                distributed=distributed,
                layout=self._index(layout),
            )
        )

    def add_plain(
        self, name: str, kind: str, module: str, param: str, shape: tuple[int, ...], dtype: str, size: int
    ) -> None:
        """A plain tensor: whole on every rank of the world (which later DTensors may still widen)."""
        self._name(name)
        self.pending_plain.append(len(self.rows))
        self.rows.append(TensorRow(name, kind, module, param, shape, dtype, size, False, -1))

    def finish(self, name: str, modules: tuple[tuple[str, str], ...], default_world: int = 1) -> ModelMap:
        """The map; without a world size given, ``default_world`` or one past the largest rank a
        layout names, whichever is larger."""
        world = self.world
        if world is None:
            world = default_world
            for lay in self.layouts:
                world = max(world, max((s.rank for s in lay.shards), default=-1) + 1)
        for i in self.pending_plain:
            r = self.rows[i]
            lay = _compute_layout(r.global_shape, (world,), ["R"], dtype=r.dtype)
            self.rows[i] = TensorRow(
                r.name,
                r.kind,
                r.module,
                r.param,
                r.global_shape,
                r.dtype,
                r.itemsize,
                False,
                self._index(lay),
            )
        rows = tuple(self.rows)
        layouts = tuple(self.layouts)
        return ModelMap(name, world, modules, rows, layouts, _matrix(rows, layouts, world))


def from_layouts(
    layouts: Mapping[Any, Any],
    *,
    world_size: int | None = None,
    name: str | None = None,
    default_world: int = 1,
) -> ModelMap:
    """The model map of ``{name: Layout}``: pure geometry (e.g. from ``sv.layout(shape, mesh,
    placements)``), each a parameter of the module its dotted name names."""
    b = Builder(world_size)
    for key, lay in layouts.items():
        if not isinstance(lay, Layout):
            raise TypeError(
                f"model_map of a mapping takes {{name: Layout}} (from sv.layout); {key!r} is a "
                f"{type(lay).__name__}"
            )
        module = str(key).rpartition(".")[0]
        b.add_layout(str(key), "param", module, str(key), lay, True)
    return b.finish(name or "layouts", _modules_from_names(b.rows), default_world)


def _modules_from_names(rows: Iterable[TensorRow]) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {"": ""}
    for r in rows:
        parts = r.module.split(".") if r.module else []
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]), "")
    return tuple(out.items())


# ---- text ---------------------------------------------------------------------------------------


def mesh_label(layout: Layout, distributed: bool) -> str:
    if not distributed:
        return "-"
    if layout.mesh_dim_names:
        return " ".join(f"{n}={s}" for n, s in zip(layout.mesh_dim_names, layout.mesh_shape, strict=True))
    return "x".join(str(s) for s in layout.mesh_shape)


def groups(values: Sequence[Any], ranks: Sequence[int]) -> list[tuple[Any, list[int]]]:
    """Equal values grouped with their ranks, in order of first rank."""
    out: dict[Any, list[int]] = {}
    for v, r in zip(values, ranks, strict=True):
        out.setdefault(v, []).append(r)
    return list(out.items())


def shape_summary(m: ModelMap, i: int) -> str:
    """Local shapes per rank, grouped: ``"(3, 3) r0-2 · (1, 3) r3"``; one shape alone if all equal."""
    lay = m.layouts[m.rows[i].layout]
    gs = groups([s.shape for s in lay.shards], [s.rank for s in lay.shards])
    held = len(lay.shards)
    missing = m.world_size - held
    if len(gs) == 1 and not missing:
        return describe.shape_tuple(gs[0][0])
    parts = [f"{describe.shape_tuple(v)} r{rank_list(rs)}" for v, rs in gs[:3]]
    if len(gs) > 3:
        parts.append(f"… {len(gs) - 3} more")
    if missing:
        parts.append(f"none on {missing} ranks")
    return " · ".join(parts)


def bytes_summary(row_bytes: np.ndarray) -> str:
    """Bytes per rank, grouped when ranks differ: ``"36 r0-2 · 12 r3"``."""
    vals = row_bytes.tolist()
    gs = groups(vals, list(range(len(vals))))
    if len(gs) == 1:
        return str(gs[0][0])
    parts = [f"{v} r{rank_list(rs)}" for v, rs in gs[:3]]
    if len(gs) > 3:
        parts.append(f"… {len(gs) - 3} more")
    return " · ".join(parts)


def text(m: ModelMap) -> str:
    """The text table: module headers, one line per tensor, then totals per rank and per mesh dim."""
    plural = {"param": "params", "buffer": "buffers", "grad": "grads", "optimizer": "optimizer states"}
    single = {"optimizer": "optimizer state"}
    counts = []
    for k in KINDS:
        n = sum(r.kind == k for r in m.rows)
        if n:
            counts.append(f"{n} {single.get(k, k) if n == 1 else plural[k]}")
    lines = [f"ModelMap {m.name}: {m.world_size} ranks, {', '.join(counts) or 'no tensors'}"]
    table: list[tuple[str, ...]] = [
        ("name", "kind", "shape", "dtype", "mesh", "placements", "local shape", "bytes/rank")
    ]
    classes = dict(m.modules)
    current: str | None = None
    for i, r in enumerate(m.rows):
        if r.module != current:
            current = r.module
            cls = classes.get(r.module, "")
            label = r.module or "(root)"
            table.append((f"{label} ({cls})" if cls else label,))
        lay = m.layouts[r.layout]
        leaf = r.name[len(r.module) + 1 :] if r.module else r.name
        table.append(
            (
                "  " + leaf,
                r.kind,
                describe.shape_tuple(r.global_shape),
                r.dtype,
                mesh_label(lay, r.distributed),
                "[" + ", ".join(lay.placements) + "]" if r.distributed else "plain",
                shape_summary(m, i),
                bytes_summary(m.nbytes[i]),
            )
        )
    widths = [max(len(t[c]) for t in table if len(t) > 1) for c in range(len(table[0]))]
    for t in table:
        if len(t) == 1:
            lines.append(t[0])
        else:
            lines.append("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())
    tot = m.totals()
    if len(tot):
        gs = groups(tot.tolist(), list(range(len(tot))))
        if len(gs) == 1:
            lines.append(f"total per rank: {bytes_exact(gs[0][0])} on every rank")
        else:
            lo, hi = int(tot.min()), int(tot.max())
            spread = " · ".join(f"{v} r{rank_list(rs)}" for v, rs in gs[:4])
            more = f" · … {len(gs) - 4} more" if len(gs) > 4 else ""
            lines.append(f"total per rank: {spread}{more} (min {bytes_text(lo)}, max {bytes_text(hi)})")
        kinds = m.totals_by_kind()
        if len(kinds) > 1:
            lines.append(
                "by kind (max over ranks): "
                + ", ".join(f"{k} {bytes_text(int(v.max()))}" for k, v in kinds.items())
            )
    lines.append(f"unsharded: {bytes_exact(m.global_bytes)}")
    for d in m.by_mesh_dim():
        parts = [f"sharded {bytes_text(d.sharded)}"]
        if d.replicated:
            parts.append(f"replicated {bytes_text(d.replicated)}")
        if d.partial:
            parts.append(f"partial {bytes_text(d.partial)}")
        label = d.name if d.name.startswith("mesh dim") else f"mesh dim {d.name}"
        lines.append(f"{label} ({d.size}): " + ", ".join(parts))
    return "\n".join(lines)
