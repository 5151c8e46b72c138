"""The one module that touches private torch APIs.

Everything shardviz needs from ``torch.distributed._local_tensor``, DTensor internals and the
dispatch machinery is imported here, behind a version check, so that a torch release that moves
one of them fails with a message naming what moved instead of an obscure AttributeError deep in a
notebook. The rest of the package imports from here and speaks in plain data.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import re
import sys
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .placement import Placement

MIN_TORCH = (2, 13)
TESTED_UP_TO = (2, 15)  # `make test-compat` runs the suite on this one

_private: dict[str, Any] = {}

# (module, attribute) pairs shardviz relies on; checked together at import time.
_REQUIRED = {
    "LocalTensor": ("torch.distributed._local_tensor", "LocalTensor"),
    "LocalTensorMode": ("torch.distributed._local_tensor", "LocalTensorMode"),
    "LocalIntNode": ("torch.distributed._local_tensor", "LocalIntNode"),
    "local_tensor_mode": ("torch.distributed._local_tensor", "local_tensor_mode"),
    "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard"),
    "DebugMode": ("torch.utils._debug_mode", "DebugMode"),
    "debug_mode_module": ("torch.utils._debug_mode._mode", None),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "disable_current_modes": ("torch.utils._python_dispatch", "_disable_current_modes"),
    "dispatch_mode_stack": ("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack"),
    "resolve_process_group": ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    "storage_use_count": ("torch._C", "_storage_Use_Count"),
    "DisableTorchDispatch": ("torch._C", "_DisableTorchDispatch"),
    "local_reduce": ("torch.distributed._local_tensor._c10d", "_local_reduce"),
    "local_tensor_module": ("torch.distributed._local_tensor", None),
}


class TorchVersionError(ImportError):
    """The installed torch lacks (or moved) an API that shardviz builds on."""


def _version(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _load() -> None:
    if _version(torch.__version__) < MIN_TORCH:
        raise TorchVersionError(
            f"shardviz needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]} (LocalTensorMode); this is torch "
            f"{torch.__version__}. Install it with: pip install 'torch=={MIN_TORCH[0]}.{MIN_TORCH[1]}.0'"
        )
    missing = []
    for key, (mod_name, attr) in _REQUIRED.items():
        try:
            mod = importlib.import_module(mod_name)
            _private[key] = mod if attr is None else getattr(mod, attr)
        except (ImportError, AttributeError) as e:
            missing.append(f"{mod_name}{'.' + attr if attr else ''} ({type(e).__name__})")
    if missing:
        raise TorchVersionError(
            f"torch {torch.__version__} moved or removed private APIs shardviz relies on: "
            + ", ".join(missing)
            + f". shardviz is tested with torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to {TESTED_UP_TO[0]}."
            f"{TESTED_UP_TO[1]}; install one of those or report the torch version at the shardviz "
            "issue tracker."
        )


_load()

LocalTensor = _private["LocalTensor"]
LocalTensorMode = _private["LocalTensorMode"]
LocalIntNode = _private["LocalIntNode"]
StridedShard = _private["StridedShard"]
DebugMode = _private["DebugMode"]
TorchDispatchMode = _private["TorchDispatchMode"]

# What moved between the torch releases shardviz supports (2.13 to 2.15), detected rather than
# read off the version number, so that a backport or a nightly behaves as what it is:
# - 2.14 made LocalTensorMode patch ``dist.get_rank`` to return a per-rank SymInt (0 on every
#   rank before);
# - 2.14 keyed LocalTensorMode's mesh-coordinate cache by (ndim, rank map, layout) instead of
#   ``id(mesh)`` (see ``reuse_local_mode``).
GET_RANK_PER_RANK = "get_rank" in getattr(_private["local_tensor_module"], "_PATCHED_DIST_FUNCTIONS", ())

from torch.distributed.device_mesh import DeviceMesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard  # noqa: E402
from torch.nn.modules.module import (  # noqa: E402
    register_module_forward_pre_hook as _register_module_forward_pre_hook,
)

__all__ = [
    "DTensor",
    "DebugMode",
    "DeviceMesh",
    "LocalIntNode",
    "LocalTensor",
    "LocalTensorMode",
    "StridedShard",
]


def active_local_mode() -> Any:
    """The innermost active LocalTensorMode, or None."""
    return _private["local_tensor_mode"]()


def dispatch_mode_stack() -> list[Any]:
    return list(_private["dispatch_mode_stack"]())


@contextlib.contextmanager
def no_dispatch() -> Iterator[None]:
    """Run plain tensor code with every dispatch mode suspended (for snapshots)."""
    with _private["disable_current_modes"]():
        yield


def plain_ops() -> Any:
    """Run ops on plain tensors straight to their kernels, past every dispatch mode and subclass
    handler: a C++ guard, some twenty times cheaper than ``no_dispatch`` (which pops and pushes
    the mode stack). Only for plain tensors: a LocalTensor's ops would not reach its handler."""
    return _private["DisableTorchDispatch"]()


def local_reduce(reduce_op: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A group's reduction exactly as LocalTensorMode computes it (same order, same bits)."""
    return _private["local_reduce"](reduce_op, tensors)


def is_local_tensor(t: object) -> bool:
    return isinstance(t, LocalTensor)


def local_tensors(t: object) -> dict[int, torch.Tensor] | None:
    """The per-rank tensors of a LocalTensor (None for anything else)."""
    if isinstance(t, LocalTensor):
        return dict(t._local_tensors)
    return None


def plain_tensors(x: object) -> list[torch.Tensor]:
    """The plain tensors that hold ``x``'s data: a DTensor's local shard(s), a LocalTensor's
    per-rank tensors, or ``x`` itself."""
    if isinstance(x, DTensor):
        x = x._local_tensor
    if isinstance(x, LocalTensor):
        return list(x._local_tensors.values())
    return [x] if isinstance(x, torch.Tensor) else []


def storage_users(t: torch.Tensor) -> int:
    """How many holders share ``t``'s storage (tensors, views, numpy arrays over it)."""
    return int(_private["storage_use_count"](t.untyped_storage()._cdata))


def tensor_users(t: torch.Tensor) -> int:
    """How many C++ owners ``t``'s TensorImpl has (a ``.grad`` slot, autograd's saved tensors)."""
    return int(t._use_count())


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def placement_to_plain(p: Any) -> Placement:
    """A torch placement as shardviz's plain Placement."""
    if isinstance(p, StridedShard):
        return Placement("strided", dim=int(p.dim), split_factor=int(p._split_factor_int()))
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
        return Partial(p.reduce_op)  # type: ignore[arg-type]
    return Replicate()


_placement_names: dict[Any, tuple[str, ...]] = {}


def placements_str(placements: Sequence[Any]) -> tuple[str, ...]:
    """Placement strings of torch placements; memoised (placements are hashable and few)."""
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


MeshInfo = tuple[tuple[int, ...], tuple[str, ...] | None, tuple[int, ...]]
# By id, with a weak reference to tell a reused id apart (DeviceMesh's own hash reads its tensor).
_mesh_infos: dict[int, tuple[weakref.ReferenceType[Any], MeshInfo]] = {}


def mesh_info(mesh: Any) -> MeshInfo:
    """(mesh shape, dim names, ranks in row-major order) of a DeviceMesh; cached per mesh, since
    reading the mesh tensor under the simulation costs milliseconds."""
    hit = _mesh_infos.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    with no_dispatch():
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    info = (tuple(int(s) for s in mesh.mesh.shape), names, ranks)
    with contextlib.suppress(TypeError):
        key = id(mesh)
        _mesh_infos[key] = (weakref.ref(mesh, lambda _, key=key: _mesh_infos.pop(key, None)), info)
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
        _mesh_groups[key] = (weakref.ref(mesh, lambda _, key=key: _mesh_groups.pop(key, None)), groups)
    return groups


# Meshes seen alive, by id: their coordinates may be reused across simulated cells, and their
# dims name the groups of later collectives. Weak values: a dead mesh's id can be reused.
_live_meshes: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_mesh_births = 0


def remember_mesh(mesh: Any) -> None:
    global _mesh_births
    if _live_meshes.get(id(mesh)) is mesh:
        return  # known: every recording notes its meshes again
    with contextlib.suppress(TypeError):  # a mesh that takes no weak reference is not kept
        _live_meshes[id(mesh)] = mesh
        _mesh_births += 1


def mesh_generation() -> tuple[int, int]:
    """Changes whenever a mesh is remembered or freed: the key for what is derived from them."""
    return _mesh_births, len(_live_meshes)


def known_mesh_infos() -> list[MeshInfo]:
    return [mesh_info(m) for m in list(_live_meshes.values())]


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


def dtensor_geometry(dt: Any) -> dict[str, Any]:
    """What the pure layout function needs to describe a DTensor."""
    spec = dt._spec
    order = None
    so = getattr(spec, "shard_order", None)
    if so and not getattr(spec, "use_strided_shard_as_shard_order", False):
        order = {int(e.tensor_dim): tuple(int(m) for m in e.mesh_dims) for e in so}
    return {**_spec_fields(spec, dt.shape, dt.dtype), "shard_order": order}


def spec_geometry(spec: Any) -> dict[str, Any] | None:
    """What the pure layout needs, from a DTensorSpec (as found in a sharding error's frames)."""
    meta = getattr(spec, "tensor_meta", None)
    if meta is None or not hasattr(spec, "placements"):
        return None
    return _spec_fields(spec, meta.shape, meta.dtype)


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _process_group(group: Any) -> Any:
    if isinstance(group, str):
        return _private["resolve_process_group"](group)
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    return group


def process_group_key(group: Any) -> str:
    """A stable name for a process group (c10d ops get short-lived boxed objects, not the group)."""
    if isinstance(group, str):
        return group
    return str(_process_group(group).group_name)


def process_group_ranks(group: Any) -> list[int]:
    """Global ranks of a process group given as a ProcessGroup, a boxed one, or a group name."""
    return list(dist.get_process_group_ranks(_process_group(group)))


def process_group_desc(group: Any) -> str:
    return str(getattr(_process_group(group), "group_desc", "") or "")


def debug_mode_counter(delta: int) -> None:
    """Tell DTensor a DebugMode-like recorder is (or is no longer) active.

    DTensor reports redistributes only when this module-level counter is non-zero.
    """
    _private["debug_mode_module"]._ACTIVE_DEBUG_MODE_COUNT += delta


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass."""
    return torch._C._current_graph_task_id() != -1


def reduce_op_name(op: Any) -> str:
    """Name of a c10d ReduceOp given boxed (as c10d ops receive it) or plain, e.g. ``"SUM"``."""
    kind = op.op() if isinstance(op, torch.ScriptObject) else getattr(op, "op", op)
    if isinstance(kind, int) and not isinstance(kind, dist.ReduceOp.RedOpType):
        kind = dist.ReduceOp.RedOpType(kind)
    return str(getattr(kind, "name", kind)).split(".")[-1]


def symint_at_rank(value: Any, rank: int) -> int:
    """One rank's value of a per-rank SymInt made by LocalTensorMode (a plain int elsewhere)."""
    node = getattr(value, "node", None)
    local = getattr(node, "_local_ints", None)
    if local is not None:
        return int(local[rank])
    return int(value)


def per_rank_ints(value: Any) -> list[int] | None:
    """The per-rank values of a SymInt made by LocalTensorMode (None for a plain int)."""
    local = getattr(getattr(value, "node", None), "_local_ints", None)
    return [int(v) for v in local.values()] if local is not None else None


def new_local_tensor(per_rank: dict[int, torch.Tensor]) -> Any:
    return LocalTensor(per_rank)


class ModuleStack:
    """Which nn.Module is running: its qualified name, in the forward and in the backward.

    Forward: a global pre-forward hook pushes the module and a forward hook of its own, registered
    after the module's existing hooks, pops it, so what tensor-parallel output hooks communicate
    belongs to the module that produced it. Backward: each module call remembers the range of
    autograd sequence numbers created while it ran; a backward collective looks up the node the
    engine is running. This costs two counter reads per module call and no autograd hooks.
    Names follow ModTracker's: the root's class name, then attribute paths (``MLP.net.0``).
    """

    def __init__(self) -> None:
        self._stack: list[tuple[str, int]] = []
        self._names: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._handles: list[Any] = []
        self._spans: list[tuple[int, int, str]] = []

    def _name(self, mod: Any) -> str:
        name = self._names.get(mod)
        if name is None:
            name = type(mod).__name__
            for path, sub in mod.named_modules():
                if path and sub not in self._names:
                    self._names[sub] = f"{name}.{path}"
            self._names[mod] = name
        return name

    def _enter_forward(self, mod: Any, inputs: Any) -> None:
        if mod not in self._hooked:
            self._hooked.add(mod)
            self._handles.append(mod.register_forward_hook(self._leave_forward, always_call=True))
        self._stack.append((self._name(mod), torch._C._autograd._get_sequence_nr()))

    def _leave_forward(self, mod: Any, inputs: Any, output: Any) -> None:
        if not self._stack:
            return
        name, start = self._stack.pop()
        end = torch._C._autograd._get_sequence_nr()
        if end > start:
            self._spans.append((start, end, name))

    def current(self) -> str | None:
        if _fsdp_used:
            owner = _fsdp_owner(sys._getframe(1))
            name = self._names.get(owner) if owner is not None else None  # named once its model ran
            if name is not None:
                return name
        if in_backward():
            node = torch._C._current_autograd_node()
            return self._backward_owner(node._sequence_nr()) if node is not None else None
        return self._stack[-1][0] if self._stack else None

    def _backward_owner(self, seq: int) -> str | None:
        best: tuple[int, str] | None = None
        for start, end, name in reversed(self._spans):
            if start <= seq < end and (best is None or end - start < best[0]):
                best = (end - start, name)
        return best[1] if best else None

    def __enter__(self) -> ModuleStack:
        self._handles.append(_register_module_forward_pre_hook(self._enter_forward))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._hooked:
            self._hooked = weakref.WeakSet()
        self._stack.clear()


def op_schema_inputs(schema: Any) -> tuple[str, list[dict[str, Any]]]:
    """(operator name, geometry of each DTensor input) of a DTensor OpSchema."""
    op = str(getattr(schema, "op", "?")).removesuffix(".default")
    specs = []
    for a in getattr(schema, "args_schema", ()):
        g = spec_geometry(a)
        if g is not None:
            specs.append(g)
    return op, specs


class UserCallWatch:
    """Call back around ``DTensor.to_local``, ``DTensor.from_local`` and ``dist.get_rank`` while a
    simulation is recorded: they are Python calls, not dispatched ops, so a dispatch mode cannot see
    them. Each callback gets the calling frame, to tell user code from torch's own calls.

    While any recording runs, DTensor's redistribute plan strings are also memoised: DTensor
    formats one for every redistribute it reports to a DebugMode, and in a loop it is the same
    string every time. The wrappers are made once and installed while a watch is open.
    """

    def __init__(self, on_to_local: Any, on_from_local: Any, on_get_rank: Any) -> None:
        self.callbacks = (on_to_local, on_from_local, on_get_rank)

    def __enter__(self) -> None:
        if not _watches:
            _swap_watch("wrapper")
        _watches.append(self.callbacks)

    def __exit__(self, *exc: object) -> None:
        _watches.remove(self.callbacks)
        if not _watches:
            _swap_watch("original")


_watches: list[tuple[Any, Any, Any]] = []
_watch_originals: dict[str, Any] = {}


def _swap_watch(which: str) -> None:
    """Put the watch's ``"wrapper"`` or ``"original"`` functions in place."""
    if not _watch_originals:
        from torch.distributed.tensor._redistribute import DTensorRedistributePlanner

        _make_watch_wrappers(DTensorRedistributePlanner)
    w = _watch_originals[which]
    if which == "wrapper":
        # The get_rank underneath is whatever is in place now: from torch 2.14 on, LocalTensorMode
        # has patched in its per-rank one when the recording opens, and restores the real one after.
        _watch_originals["original"]["get_rank"] = dist.get_rank
    DTensor.to_local = w["to_local"]  # type: ignore[method-assign]
    DTensor.from_local = w["from_local"]  # type: ignore[method-assign]
    dist.get_rank = w["get_rank"]
    _watch_originals["planner"].stringify_transform_infos = w["stringify"]


def _make_watch_wrappers(planner: Any) -> None:
    orig_to_local = DTensor.to_local
    orig_from_local = DTensor.__dict__["from_local"]
    orig_get_rank = dist.get_rank
    orig_stringify = planner.__dict__["stringify_transform_infos"]
    stringify = orig_stringify.__func__
    plans: dict[Any, str] = {}

    @functools.wraps(orig_to_local)
    def to_local(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_to_local(self, *args, **kwargs)
        for on_to_local, _, _ in list(_watches):
            on_to_local(self, out, sys._getframe(1))
        return out

    @functools.wraps(orig_from_local.__func__)
    def from_local(*args: Any, **kwargs: Any) -> Any:
        out = orig_from_local.__func__(*args, **kwargs)
        for _, on_from_local, _ in list(_watches):
            on_from_local(out, sys._getframe(1))
        return out

    @functools.wraps(orig_get_rank)
    def get_rank(*args: Any, **kwargs: Any) -> Any:
        for _, _, on_get_rank in list(_watches):
            on_get_rank(sys._getframe(1))
        return _watch_originals["original"]["get_rank"](*args, **kwargs)

    @functools.wraps(stringify)
    def stringify_memo(
        mesh: Any,
        transform_infos: Any,
        src_placement: Any,
        src_shard_order: Any = None,
        use_strided_shard_as_shard_order: bool = False,
    ) -> str:
        # The string depends on the placements, the shard order and each step's kind, mesh dims
        # and placements, not on the mesh itself unless strided shards are normalised with it.
        if use_strided_shard_as_shard_order:
            return stringify(mesh, transform_infos, src_placement, src_shard_order, True)
        try:
            key = (
                mesh.ndim,
                tuple(src_placement),
                src_shard_order,
                tuple(
                    (type(t), t.mesh_dim, t.src_dst_placements, getattr(t, "original_mesh_dims", None))
                    for t in transform_infos
                ),
            )
            hit = plans.get(key)
        except TypeError:  # something unhashable: no memo
            return stringify(mesh, transform_infos, src_placement, src_shard_order)
        if hit is None:
            hit = stringify(mesh, transform_infos, src_placement, src_shard_order)
            if len(plans) > 4096:
                plans.clear()
            plans[key] = hit
        return hit

    _watch_originals.update(
        planner=planner,
        original={
            "to_local": orig_to_local,
            "from_local": orig_from_local,  # a staticmethod, as in the class
            "get_rank": orig_get_rank,
            "stringify": orig_stringify,
        },
        wrapper={
            "to_local": to_local,
            "from_local": staticmethod(from_local),
            "get_rank": get_rank,
            "stringify": staticmethod(stringify_memo),
        },
    )


def wait_collective(out: Any, functional: bool) -> None:
    """Block until a real collective's result is there, so that it can be snapshotted.

    c10d ops hand back a ``Work``; functional collectives return tensors that are only valid after
    ``wait_tensor``. The simulator's collectives finish immediately; real ones (gloo, NCCL) do not.
    """
    stack = [out]
    while stack:
        x = stack.pop()
        if isinstance(x, list | tuple):
            stack.extend(x)
        elif isinstance(x, dist.Work):
            x.wait()
        elif isinstance(x, torch.ScriptObject) and "Work" in str(x._type()):
            dist.Work.unbox(x).wait()  # c10d ops hand back the Work boxed for the dispatcher
        elif functional and isinstance(x, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(x)


def fake_work() -> Any:
    """A finished c10d Work, boxed as c10d ops return it (for collectives shardviz emulates)."""
    from torch._C._distributed_c10d import FakeWork

    return dist.distributed_c10d.Work.boxed(FakeWork())


# --- FSDP2 in the simulation ------------------------------------------------------------------
# FSDP2 (fully_shard) fails under LocalTensorMode for two reasons, the same on torch 2.13 to 2.15:
# 1. It frees and re-allocates the all-gather output behind each unsharded parameter with
#    ``untyped_storage().resize_()``. A LocalTensor is a wrapper whose storage has no data, which
#    torch calls "an invalid python storage" and refuses to resize; each rank's tensor can be.
# 2. It cuts each parameter with ``chunks[shard_process_group.rank()]``: on the fake process group
#    that is 0 for every simulated rank, so every rank would silently hold shard 0. Each rank's
#    shard is rewritten with the chunk at its own coordinate on the shard mesh dim.
_FSDP_PARAM = "torch.distributed.fsdp._fully_shard._fsdp_param"
_FSDP_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
_fsdp_used = False  # set once fully_shard ran in the simulation: only then are frames searched


def _fsdp_owner(frame: Any, depth: int = 40) -> Any:
    """The module whose FSDP parameter group issues what is running (its all-gather, its
    reduce-scatter), found on the stack: FSDP runs them from hooks of other modules (the next
    layer's pre-backward re-gathers this one) and from the autograd engine's callbacks."""
    while frame is not None and depth:
        if frame.f_code.co_filename.endswith("_fsdp_param_group.py"):
            modules = getattr(frame.f_locals.get("self"), "modules", None)
            if modules:
                return modules[0]
        frame, depth = frame.f_back, depth - 1
    return None


def _per_rank_storage(original: Any) -> Any:
    @functools.wraps(original)
    def resize(tensor: torch.Tensor) -> None:
        for t in tensor._local_tensors.values() if isinstance(tensor, LocalTensor) else (tensor,):
            original(t)

    return resize


def _per_rank_shards(original: Any) -> Any:
    @functools.wraps(original)
    def init_sharded_param(self: Any, param: Any, *args: Any, **kwargs: Any) -> None:
        mode = active_local_mode()
        local = param._local_tensor if isinstance(param, DTensor) else param
        if mode is not None and not isinstance(local, LocalTensor) and not local.is_meta:
            # Made outside the simulation: one tensor that every rank starts from.
            data = LocalTensor({r: local.detach() for r in sorted(mode.ranks)})
            if isinstance(param, DTensor):
                data = DTensor.from_local(
                    data, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
            param = torch.nn.Parameter(data, requires_grad=param.requires_grad)
        global _fsdp_used
        _fsdp_used = True
        original(self, param, *args, **kwargs)
        shards = self._sharded_param_data
        info = self.mesh_info
        if mode is None or not isinstance(shards, LocalTensor) or not hasattr(info, "shard_mesh_dim"):
            return  # not simulated, or nothing sharded (replicate-only)
        coord = info.mesh.get_local_rank(info.shard_mesh_dim)  # per rank, as the mode patches it
        full = param._local_tensor if isinstance(param, DTensor) else param
        dim, size = self.fsdp_placement.dim, info.shard_mesh_size
        with mode.disable(), torch.no_grad():
            for r, buf in shards._local_tensors.items():
                src = full._local_tensors[r] if isinstance(full, LocalTensor) else full
                chunks = torch.chunk(src.detach(), size, dim=dim)
                c = symint_at_rank(coord, r)
                # Written at the front of the zero-padded buffer, as FSDP pads a short shard.
                padded = buf.view(self.padded_sharded_param_size)
                padded.zero_()
                if c < len(chunks) and chunks[c].numel():
                    padded.narrow(dim, 0, chunks[c].size(dim)).copy_(chunks[c])

    return init_sharded_param


@contextlib.contextmanager
def fsdp_in_simulation() -> Iterator[None]:
    """FSDP2 made to run per simulated rank while the simulation runs (see above); torch's own
    functions are back in place outside it, so real process groups never see the change."""
    # Checked here rather than at import: a torch that moved FSDP2's internals loses FSDP2 in the
    # simulation (its error is then explained), not shardviz.
    try:
        fp, fpg = importlib.import_module(_FSDP_PARAM), importlib.import_module(_FSDP_GROUP)
        init = fp.FSDPParam.__dict__["_init_sharded_param"]
        saved = (fp.alloc_storage, fp.free_storage, fpg.alloc_storage, init)
    except (ImportError, AttributeError, KeyError):
        yield
        return
    fp.alloc_storage = fpg.alloc_storage = _per_rank_storage(saved[0])
    fp.free_storage = _per_rank_storage(saved[1])
    fp.FSDPParam._init_sharded_param = _per_rank_shards(saved[3])
    try:
        yield
    finally:
        fp.alloc_storage, fp.free_storage, fpg.alloc_storage = saved[:3]
        fp.FSDPParam._init_sharded_param = saved[3]


@contextlib.contextmanager
def tracking_meshes() -> Iterator[None]:
    """Remember every DeviceMesh built while the simulation runs (sub-meshes too), so that its
    cached per-rank coordinates can be kept from cell to cell (see ``reuse_local_mode``)."""
    original = DeviceMesh.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        remember_mesh(self)

    DeviceMesh.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = original  # type: ignore[method-assign]
