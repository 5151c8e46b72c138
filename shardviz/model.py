"""The model map: every parameter, buffer, gradient and optimizer state of a module, as plain data.

``model_map(module, optimizer=opt)`` walks the module tree once and turns each tensor into a
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

from . import describe
from .describe import rank_list
from .layout import Layout
from .layout import compute as _compute_layout
from .trace import DTYPE_SIZES

KINDS = ("param", "buffer", "grad", "optimizer")

# Bytes per element of the dtypes torch names; anything else is asked of torch once.
_ITEMSIZE = dict(DTYPE_SIZES)


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype given by name ("float32", "bfloat16", ...)."""
    try:
        return _ITEMSIZE[dtype]
    except KeyError:
        import torch

        size = getattr(torch, dtype, None)
        if not isinstance(size, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}") from None
        _ITEMSIZE[dtype] = size.itemsize
        return size.itemsize


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
        for r in self.rows:
            if r.name == name:
                return r
        raise KeyError(f"no tensor named {name!r} in this model map (names look like {self.rows[0].name!r})")

    def index(self, name: str) -> int:
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


def _world_size() -> int:
    from . import backends

    b = backends.peek()
    if b is not None:
        return int(b.world_size)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


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


class _Builder:
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

    def add_layout(
        self, name: str, kind: str, module: str, param: str, layout: Layout, distributed: bool
    ) -> None:
        if name in self.names:
            raise ValueError(f"model_map: two tensors named {name!r}")
        self.names.add(name)
        self.rows.append(
            TensorRow(
                name=name,
                kind=kind,
                module=module,
                param=param,
                global_shape=tuple(layout.global_shape),
                dtype=layout.dtype,
                itemsize=itemsize(layout.dtype),
                distributed=distributed,
                layout=self._index(layout),
            )
        )

    def add_tensor(self, name: str, kind: str, module: str, param: str, t: Any) -> None:
        from . import _torch, adapters

        if _torch.is_dtensor(t):
            self.add_layout(name, kind, module, param, _compute_layout(**_torch.dtensor_geometry(t)), True)
            return
        adapter = adapters.for_object(t)
        if adapter is not None:  # PhysicsNeMo's ShardTensor: its own shard sizes
            self.add_layout(name, kind, module, param, adapter.layout(t), True)
            return
        shape = tuple(int(s) for s in t.shape)
        dtype = _torch.dtype_name(t.dtype)
        # Placeholder layout until the world size is known (it may come from later DTensors).
        if name in self.names:
            raise ValueError(f"model_map: two tensors named {name!r}")
        self.names.add(name)
        self.pending_plain.append(len(self.rows))
        self.rows.append(TensorRow(name, kind, module, param, shape, dtype, itemsize(dtype), False, -1))

    def finish(self, name: str, modules: tuple[tuple[str, str], ...]) -> ModelMap:
        world = self.world
        if world is None:
            world = _world_size()
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


def model_map(
    model: Any,
    optimizer: Any = None,
    *,
    world_size: int | None = None,
    grads: bool = True,
    buffers: bool = True,
    name: str | None = None,
) -> ModelMap:
    """The model map of an ``nn.Module`` (DTensor or plain parameters, any device, meta too), or of
    a mapping ``{name: Layout}`` (pure geometry, e.g. from ``sv.layout(shape, mesh, placements)``).

    ``optimizer``: its state per parameter (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``) is
    counted as rows of kind ``"optimizer"``; a wrapper of several optimizers (``.optimizers``, as
    torchtitan's OptimizersContainer) or a list of them counts each one's. ``grads``: count each
    parameter's ``.grad`` when it has one. ``world_size``: the world plain tensors are replicated
    over (default: the current backend's, or the largest rank any DTensor names, plus one).
    """
    b = _Builder(world_size)
    if isinstance(model, Mapping):
        for key, lay in model.items():
            if not isinstance(lay, Layout):
                raise TypeError(
                    f"model_map of a mapping takes {{name: Layout}} (from sv.layout); {key!r} is a "
                    f"{type(lay).__name__}"
                )
            module = str(key).rpartition(".")[0]
            b.add_layout(str(key), "param", module, str(key), lay, True)
        return b.finish(name or "layouts", _modules_from_names(b.rows))

    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "sv.model_map takes an nn.Module (or {name: Layout} for pure geometry); got "
            f"{type(model).__name__}"
        )
    state = _optimizer_state(optimizer)
    modules: list[tuple[str, str]] = []
    seen: set[int] = set()
    for mname, mod in model.named_modules():
        modules.append((mname, type(mod).__name__))
        prefix = f"{mname}." if mname else ""
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:  # tied weights: counted once, where first met
                continue
            seen.add(id(p))
            full = prefix + pname
            b.add_tensor(full, "param", mname, full, p)
            g = p.grad if grads else None
            if g is not None:
                b.add_tensor(f"{full}.grad", "grad", mname, full, g)
            for key, v in state.get(id(p), ()):
                b.add_tensor(f"{full}:{key}", "optimizer", mname, full, v)
        if buffers:
            for bname, buf in mod.named_buffers(recurse=False):
                if buf is None or id(buf) in seen:
                    continue
                seen.add(id(buf))
                b.add_tensor(prefix + bname, "buffer", mname, prefix + bname, buf)
    return b.finish(name or type(model).__name__, tuple(modules))


def _optimizer_state(optimizer: Any) -> dict[int, list[tuple[str, Any]]]:
    if optimizer is None:
        return {}
    import torch

    out: dict[int, list[tuple[str, Any]]] = {}
    for opt in _each_optimizer(optimizer):
        state = getattr(opt, "state", None)
        if not isinstance(state, Mapping):
            raise TypeError(
                "optimizer= takes a torch.optim.Optimizer, a wrapper of several with .optimizers "
                f"(torchtitan's OptimizersContainer) or a list of them, not {type(opt).__name__}"
            )
        for p, st in state.items():
            if not isinstance(st, Mapping) or id(p) in out:  # a wrapper mirroring its parts' state
                continue
            items = [(str(k), v) for k, v in st.items() if isinstance(v, torch.Tensor)]
            if items:
                out[id(p)] = items
    return out


def _each_optimizer(optimizer: Any) -> list[Any]:
    """The optimizers holding state: ``optimizer`` itself, or the parts of a wrapper that keeps
    one optimizer per model part in ``.optimizers`` (torchtitan's OptimizersContainer is a
    torch.optim.Optimizer whose own state stays empty), or each of a list."""
    if isinstance(optimizer, list | tuple):
        return [o for part in optimizer for o in _each_optimizer(part)]
    parts = getattr(optimizer, "optimizers", None)
    if isinstance(parts, list | tuple) and parts:
        return [*(o for part in parts for o in _each_optimizer(part)), optimizer]
    return [optimizer]


def _modules_from_names(rows: Iterable[TensorRow]) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {"": ""}
    for r in rows:
        parts = r.module.split(".") if r.module else []
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]), "")
    return tuple(out.items())


# ---- text ---------------------------------------------------------------------------------------


def fmt_bytes(n: int) -> str:
    """Exact bytes, with a binary unit beside them past 1 KiB: ``"1536 B (1.5 KiB)"``."""
    n = int(n)
    return f"{n} B" if n < 1024 else f"{n} B ({short_bytes(n)})"


def short_bytes(n: int) -> str:
    """Bytes in a binary unit only (for narrow columns): ``"1.5 KiB"``; below 1 KiB exact."""
    n = int(n)
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError


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
            lines.append(f"total per rank: {fmt_bytes(gs[0][0])} on every rank")
        else:
            lo, hi = int(tot.min()), int(tot.max())
            spread = " · ".join(f"{v} r{rank_list(rs)}" for v, rs in gs[:4])
            more = f" · … {len(gs) - 4} more" if len(gs) > 4 else ""
            lines.append(f"total per rank: {spread}{more} (min {short_bytes(lo)}, max {short_bytes(hi)})")
        kinds = m.totals_by_kind()
        if len(kinds) > 1:
            lines.append(
                "by kind (max over ranks): "
                + ", ".join(f"{k} {short_bytes(int(v.max()))}" for k, v in kinds.items())
            )
    lines.append(f"unsharded: {fmt_bytes(m.global_bytes)}")
    for d in m.by_mesh_dim():
        parts = [f"sharded {short_bytes(d.sharded)}"]
        if d.replicated:
            parts.append(f"replicated {short_bytes(d.replicated)}")
        if d.partial:
            parts.append(f"partial {short_bytes(d.partial)}")
        label = d.name if d.name.startswith("mesh dim") else f"mesh dim {d.name}"
        lines.append(f"{label} ({d.size}): " + ", ".join(parts))
    return "\n".join(lines)
