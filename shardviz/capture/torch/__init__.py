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
import os
import re
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ...errors import PerRankValueError
from ...geometry.mesh import MeshInfo
from ...geometry.placement import Placement

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
if TYPE_CHECKING:  # the class itself, for type checking: P2PMode and the Recorder derive from it
    from torch.utils._python_dispatch import TorchDispatchMode
else:
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
from torch.fx import GraphModule as _GraphModule  # noqa: E402
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


# The LocalTensorModes shardviz made (its backends' and its threads'): any other active one was
# entered by the user or a test harness, and recording attaches to it instead of making its own.
_own_modes: weakref.WeakSet[Any] = weakref.WeakSet()


def new_local_mode(world_size: int) -> Any:
    mode = LocalTensorMode(world_size)
    _own_modes.add(mode)
    return mode


def is_own_mode(mode: Any) -> bool:
    return mode in _own_modes


@contextlib.contextmanager
def watching_local_modes(
    on_enter: Callable[[Any], None], on_exit: Callable[[Any, tuple[Any, ...]], None]
) -> Iterator[None]:
    """While active, ``on_enter(mode)`` runs just after a LocalTensorMode that shardviz did not make
    is entered with no other one active (a test harness opening its simulation), and
    ``on_exit(mode, exc_info)`` just before that mode is left: the place to push a dispatch mode on
    top of it and pop it again. torch's own nested entries are not reported."""
    cls = LocalTensorMode
    original_enter, original_exit = cls.__enter__, cls.__exit__
    watched: set[int] = set()

    @functools.wraps(original_enter)
    def enter(self: Any) -> Any:
        outermost = active_local_mode() is None
        out = original_enter(self)
        if outermost and not is_own_mode(self):
            watched.add(id(self))
            on_enter(self)
        return out

    @functools.wraps(original_exit)
    def exit_(self: Any, *exc: Any) -> Any:
        if id(self) in watched and active_local_mode() is self:
            watched.discard(id(self))
            try:
                on_exit(self, exc)
            finally:
                left = original_exit(self, *exc)  # the mode is left even if on_exit failed
            return left
        return original_exit(self, *exc)

    cls.__enter__, cls.__exit__ = enter, exit_
    try:
        yield
    finally:
        cls.__enter__, cls.__exit__ = original_enter, original_exit


def drop_stale_local_mode(mode: Any) -> bool:
    """Whether ``mode`` was listed as active by torch without being entered, and is now dropped.

    An error that unwinds through LocalTensorMode's own dispatch without running its ``__exit__``
    (a RecursionError inside torch.compile's tracing) leaves it in torch's list of active local
    modes while off the dispatch stack: every later simulation would then find it "already
    active", enter nothing, and run on plain tensors."""
    listed = getattr(_private["local_tensor_module"], "get_local_tensor_mode_list", None)
    modes = listed() if listed is not None else []
    if mode not in modes or mode in dispatch_mode_stack():
        return False
    modes[:] = [m for m in modes if m is not mode]
    mode.disable_()
    return True


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


def local_of(dt: DTensor) -> torch.Tensor:
    """A DTensor's local tensor as the DTensor holds it (``DTensor._local_tensor``): a LocalTensor
    in the simulator, this rank's shard on a real backend. Unlike ``to_local()`` it makes no
    autograd node and is no user call (``UserCallWatch`` does not see it)."""
    return dt._local_tensor


# --- tensor internals ---------------------------------------------------------------------------


def forget_dtensor_caches() -> None:
    """Forget DTensor's sharding caches when a new world (process group) begins.

    DTensor caches sharding propagation (in C++ and Python) and redistribute planners by specs
    whose DeviceMesh compares by value, and the cached output specs hold the mesh they were made
    on. After ``sv.use`` tears a simulated world down and builds another, an equal mesh of the new
    world hits those entries and gets the old mesh back, whose group names now stand for other
    groups of the new world: collectives then ran over the wrong ranks (a Llama's sequence
    all-gathered over 2 ranks instead of 4, or a failed unpad check).
    """
    from torch.distributed.tensor import _redistribute

    clears = (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),  # the C++ fast path's
        getattr(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear", None),
        getattr(_redistribute, "clear_redistribute_planner_cache", None),
        getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None),
    )
    for clear in clears:
        if clear is not None:
            clear()


def own_copies(dt: DTensor, ranks: Sequence[int]) -> bool:
    """Give each simulated rank its own copy of a DTensor's local tensor when all ranks share one
    plain tensor, before an op writes it; True when it did.

    DTensor keeps the tensor it replicates or wraps (``distribute_tensor``'s Replicate path,
    ``DTensor.from_local``), so under LocalTensorMode a plain tensor made outside the simulation —
    a module's bias, a norm weight — became the local tensor of every rank at once: one storage.
    An in-place update with per-rank values (an optimizer step on a RowwiseParallel bias or a
    SequenceParallel norm weight) then ran once per rank on that storage and applied the update
    world-size times. Real ranks each hold their own copy; after this, so does each simulated rank.
    """
    local = dt._local_tensor
    if type(local) is not torch.Tensor or local.is_meta:
        return False
    with no_dispatch():
        copies = {int(r): local.detach().clone() for r in ranks}
    dt._local_tensor = LocalTensor(copies)
    return True


def parameters_per_rank(module: torch.nn.Module) -> list[str]:
    """In the simulation, give each simulated rank its own copy of every plain parameter and
    buffer of ``module`` (those no parallel style made a DTensor), as each real rank has; returns
    their names. A plain tensor is one storage all simulated ranks share: once the ranks' values
    part (gradients that differ, an update on one rank), it cannot hold what each rank would.
    Tied parameters stay tied."""
    mode = active_local_mode()
    if mode is None:
        return []
    ranks = sorted(mode.ranks)
    done: dict[int, torch.Tensor] = {}
    names = []
    for prefix, mod in module.named_modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in list(table.items()):
                if t is None or type(t) not in (torch.Tensor, torch.nn.Parameter) or t.is_meta:
                    continue
                new = done.get(id(t))
                if new is None:
                    with no_dispatch():
                        local = LocalTensor({r: t.detach().clone() for r in ranks})
                    new = (
                        torch.nn.Parameter(local, requires_grad=t.requires_grad)
                        if table is mod._parameters
                        else local
                    )
                    done[id(t)] = new
                table[name] = new
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def version_counter(t: torch.Tensor) -> int:
    """``t``'s version counter (``Tensor._version``): every in-place write to its storage, through
    ``t`` or a view sharing its counter, bumps it; a write past dispatch (numpy) does too."""
    return t._version


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor ``t`` is a view of (``Tensor._base``), or None when ``t`` is no view."""
    return t._base


# --- torch's own frames: its files, and what its functions hold in their locals ----------------
#
# The recorder finds the user's line by skipping torch's frames, and reads a few things DTensor
# keeps only in its frames' locals (a redistribute's specs, the mesh being dispatched on). Which
# files and names these are is torch's internal layout: it is known here only.

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# DTensor's operator dispatch: a frame of it on the stack means an op is being sharded.
DTENSOR_DISPATCH_FILE = os.path.join(TORCH_DIR, "distributed", "tensor", "_dispatch.py")
# Files a dispatched op passes through between its caller and a dispatch mode.
DISPATCH_PLUMBING = tuple(
    os.path.join(TORCH_DIR, *f.split("/"))
    for f in (
        "_ops.py",
        "_compile.py",
        "overrides.py",
        "_tensor.py",
        "functional.py",
        "utils/_python_dispatch.py",
        "_dynamo/eval_frame.py",
    )
)
# Frames a traceback shown to the user can leave out: layers between a call and its error that
# the user neither wrote nor can act on.
TRACEBACK_PLUMBING = tuple(
    os.path.join(TORCH_DIR, f)
    for f in ("_compile.py", "_dynamo", "distributed/c10d_logger.py", "utils/_python_dispatch.py", "_ops.py")
)


def may_hold_mesh(code: Any) -> bool:
    """Whether a torch function's frame can hold a DeviceMesh (``distribute_tensor``'s
    ``device_mesh``, a redistribute's ``mesh``)."""
    return "device_mesh" in code.co_varnames or "mesh" in code.co_varnames


def frame_mesh(frame: FrameType) -> Any:
    """The DeviceMesh a torch frame holds, or None (``f_locals`` builds a dict: ask sparingly)."""
    f_locals = frame.f_locals
    for key in ("device_mesh", "mesh"):
        m = f_locals.get(key)
        if isinstance(m, DeviceMesh):
            return m
    return None


def redistribute_specs(frame: FrameType) -> tuple[Any, Any]:
    """The (current, target) DTensorSpecs in the frame of DTensor's redistribute, which reports
    only placements to a DebugMode."""
    f_locals = frame.f_locals  # builds a dict: read it once
    return f_locals.get("current_spec"), f_locals.get("target_spec")


def strided_shard_scatter_on_stack(frame: FrameType | None) -> bool:
    """Whether ``distribute_tensor`` is scattering a ``_StridedShard`` placement up the stack."""
    while frame is not None:
        if (
            frame.f_code.co_name == "_shard_tensor"
            and type(frame.f_locals.get("self")).__name__ == "_StridedShard"
        ):
            return True
        frame = frame.f_back
    return False


# --- operator schemas ----------------------------------------------------------------------------


def op_overloads(qualified_name: str) -> list[tuple[str, Any]]:
    """(overload name, OpOverload) of every overload of ``"namespace.op"`` (``"c10d.allreduce_"``,
    ``"_c10d_functional.all_reduce"``); empty when this torch has no such operator. Some namespaces
    (``_c10d_functional``, ``_dtensor``) are private: they are only looked up here. Meant for
    import time: the dispatch path compares the resolved objects."""
    namespace, op = qualified_name.split(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return []
    return [(name, getattr(packet, name)) for name in packet.overloads()]


def op_argument_names(op: Any) -> list[str]:
    """The argument names of an OpOverload, in order, from its schema (``OpOverload._schema``)."""
    return [a.name for a in op._schema.arguments]


def written_arguments(op: Any) -> tuple[tuple[int, str], ...]:
    """(position, name) of each argument an op writes in place, from its schema; none for an op
    without a schema. Callers memoise it per op: it is not for the per-op dispatch path."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    )


def plain_tensors(x: object) -> list[torch.Tensor]:
    """The plain tensors that hold ``x``'s data: a DTensor's local shard(s), a LocalTensor's
    per-rank tensors, or ``x`` itself."""
    return list(rank_tensors(x).values()) if isinstance(x, torch.Tensor) else []


def rank_tensors(t: torch.Tensor) -> Mapping[int | None, torch.Tensor]:
    """The plain tensors behind ``t`` by rank, not copied (read them only): a LocalTensor's, a
    DTensor's local shard's, or ``{None: t}`` for a plain tensor, which every rank holds."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    if isinstance(t, LocalTensor):
        return t._local_tensors
    return {None: t}


def storage_users(t: torch.Tensor) -> int:
    """How many holders share ``t``'s storage (tensors, views, numpy arrays over it)."""
    return int(_private["storage_use_count"](t.untyped_storage()._cdata))


def tensor_users(t: torch.Tensor) -> int:
    """How many C++ owners ``t``'s TensorImpl has (a ``.grad`` slot, autograd's saved tensors)."""
    return int(t._use_count())  # type: ignore[attr-defined]  # TensorBase._use_count: in C, not in the stubs


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
        return Partial(p.reduce_op)
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
    with no_dispatch():
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    info = (tuple(int(s) for s in mesh.mesh.shape), names, ranks)
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


def is_default_group(group: Any) -> bool:
    """Whether ``group`` is the default process group (which a 1-D mesh of the whole world reuses)."""
    try:
        world = dist.group.WORLD
        return world is not None and process_group_key(group) == process_group_key(world)
    except (RuntimeError, ValueError, AttributeError):
        return False


# The c10d Python API between a user's ``dist.*`` call and the op a dispatch mode sees: a call
# that passes only these (and dispatch plumbing) on its way from user code is a raw ``dist.*`` call.
C10D_API_FILES = tuple(
    os.path.join(TORCH_DIR, "distributed", f) for f in ("distributed_c10d.py", "c10d_logger.py")
)


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
    # A boxed ReduceOp's ``op()`` is a TorchScript method, bound at run time: not in the stubs.
    kind = op.op() if isinstance(op, torch.ScriptObject) else getattr(op, "op", op)  # type: ignore[attr-defined]
    if isinstance(kind, int) and not isinstance(kind, dist.ReduceOp.RedOpType):
        kind = dist.ReduceOp.RedOpType(kind)
    return str(getattr(kind, "name", kind)).split(".")[-1]


# The factor of each ReduceOp.PREMUL_SUM collective being called (innermost last). torch 2.13
# cannot read it back from the boxed ReduceOp a c10d op receives (it has no ``ReduceOp.unbox``), so
# ``premul_sum_factors`` keeps it from the Python call while the simulation runs, per thread (in
# the one-thread-per-rank simulator each rank's thread calls, and may wait inside, its own).
_premul_local = threading.local()


def _premul_factors() -> list[Any]:
    stack: list[Any] | None = getattr(_premul_local, "stack", None)
    if stack is None:
        stack = _premul_local.stack = []
    return stack


# dist functions that take a ReduceOp: the position of their ``op`` argument.
_REDUCE_OP_ARG = {"all_reduce": 1, "reduce_scatter_tensor": 2, "reduce_scatter_single": 2}


def _called_factor() -> Any:
    """The factor of the PREMUL_SUM collective this thread is calling (see ``_premul_factors``)."""
    factors = _premul_factors()
    if not factors:
        raise NotImplementedError(
            "a PREMUL_SUM collective reached the simulation through a call shardviz does not "
            f"follow ({', '.join('dist.' + n for n in _REDUCE_OP_ARG)} are followed): on this "
            f"torch ({torch.__version__}) its factor cannot be read back. Use ReduceOp.SUM and "
            "scale the result, or run on real process groups: sv.use('gloo', world_size=N)."
        )
    return factors[-1]


def premul_factor(op: Any) -> Any:
    """The factor of a ReduceOp.PREMUL_SUM, boxed (as c10d ops receive it) or plain: a float, or
    a one-element tensor's value."""
    if isinstance(op, torch.ScriptObject):
        unbox = getattr(dist.ReduceOp, "unbox", None)
        if unbox is None:
            return _plain_factor(_called_factor())
        op = unbox(op)
    return _plain_factor(op.factor)


def _plain_factor(factor: Any) -> Any:
    if isinstance(factor, torch.Tensor) and factor.numel() == 1:
        return factor.item()
    return factor


def symint_at_rank(value: Any, rank: int) -> int:
    """One rank's value of a per-rank SymInt made by LocalTensorMode (a plain int elsewhere). A
    SymInt every rank agrees on (a coordinate on a size-1 mesh dim) holds a ConstantIntNode, which
    ``int()`` cannot read: its value is taken as it is."""
    node = getattr(value, "node", None)
    local = getattr(node, "_local_ints", None)
    if local is not None:
        return int(local[rank])
    constant = node.maybe_as_int() if node is not None and hasattr(node, "maybe_as_int") else None
    if constant is not None:
        return int(constant)
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
        # A named module runs compiled: the walk to the user's line looks for the module being
        # called (see ``current``), as no hook of its runs outside the compiled code.
        self.compiled = False

    def _name(self, mod: Any) -> str:
        name = self._names.get(mod)
        if name is None:
            name = type(mod).__name__
            for path, sub in mod.named_modules():
                self.compiled = self.compiled or is_compiled_module(sub)
                if path and sub not in self._names:
                    self._names[sub] = f"{name}.{path}"
            self._names[mod] = name
        return name

    def _enter_forward(self, mod: Any, inputs: Any) -> None:
        # Traced into a compiled region, a hook registered there would break the graph; the graph
        # torch.compile's backends run (a GraphModule of no model) is torch's, not a module of the user's.
        if torch.compiler.is_compiling() or (mod not in self._names and is_generated_module(mod)):
            return
        if mod not in self._hooked:
            self._hooked.add(mod)
            self._handles.append(mod.register_forward_hook(self._leave_forward, always_call=True))
        self._stack.append((self._name(mod), torch._C._autograd._get_sequence_nr()))

    def _leave_forward(self, mod: Any, inputs: Any, output: Any) -> None:
        if not self._stack or torch.compiler.is_compiling():
            return
        name, start = self._stack.pop()
        end = torch._C._autograd._get_sequence_nr()
        if end > start:
            self._spans.append((start, end, name))

    def current(self, fsdp_owner: Any = None, called: Any = None) -> str | None:
        """``fsdp_owner``: the module whose FSDP2 parameter group is on the stack (``fsdp_owner``
        of its frame, found by the walk to the user's line): what that group communicates
        belongs to it, in the simulator and on real ranks, whichever module's hook ran it.
        ``called``: the innermost module being called (asked for while ``compiled``); a compiled
        one is the module running, its hooks having stayed inside the compiled code. In the
        backward a compiled module's work belongs to the innermost module that ran uncompiled."""
        if fsdp_owner is not None:
            name = self._names.get(fsdp_owner)  # named once its model ran
            if name is not None:
                return name
        if in_backward():
            node = torch._C._current_autograd_node()
            return self._backward_owner(node._sequence_nr()) if node is not None else None
        if called is not None and is_compiled_module(called):
            name = self._names.get(called)
            if name is not None:
                return name
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


# nn.Module.__call__'s code: a frame of it on the stack is a module being called (its ``self``).
MODULE_CALL_CODE = torch.nn.Module._wrapped_call_impl.__code__


def called_module(frame: FrameType) -> Any:
    """The module a frame of ``MODULE_CALL_CODE`` calls."""
    return frame.f_locals.get("self")


def is_compiled_code(code: Any) -> bool:
    """Whether ``code`` is torch.compile's rewrite of a function (Dynamo's bytecode, which keeps
    the function's file name): its lines do not run one by one, so the line to show is its caller's."""
    utils = sys.modules.get("torch._dynamo.utils")
    return utils is not None and code in utils.orig_code_map


def is_generated_module(mod: Any) -> bool:
    """Whether ``mod`` is a torch.fx GraphModule: torch.compile's backends run the code they
    compile as one."""
    return isinstance(mod, _GraphModule)


def is_compiled_module(mod: Any) -> bool:
    """Whether ``mod`` runs compiled (``module.compile()``): its own hooks run inside the compiled
    code, where shardviz's module tracking stays out."""
    return getattr(mod, "_compiled_call_impl", None) is not None


def op_schema_inputs(schema: Any) -> tuple[str, list[dict[str, Any]]]:
    """(operator name, geometry of each DTensor input) of a DTensor OpSchema."""
    op, specs = op_schema_specs(schema)
    return op, [g for g in map(spec_geometry, specs) if g is not None]


def op_schema_specs(schema: Any) -> tuple[str, list[Any]]:
    """(operator name, the spec of each DTensor input, keyword inputs too) of a DTensor OpSchema."""
    op = str(getattr(schema, "op", "?")).removesuffix(".default")
    kwargs = getattr(schema, "kwargs_schema", None) or {}
    args = [*getattr(schema, "args_schema", ()), *kwargs.values()]
    return op, [a for a in args if getattr(a, "tensor_meta", None) is not None and hasattr(a, "placements")]


class UserCallWatch:
    """Call back around ``DTensor.to_local`` and ``DTensor.from_local`` while a simulation is
    recorded: they are Python calls, not dispatched ops, so a dispatch mode cannot see them. Each
    callback gets the calling frame, to tell user code from torch's own calls.

    While any recording runs, DTensor's redistribute plan strings are also memoised: DTensor
    formats one for every redistribute it reports to a DebugMode, and in a loop it is the same
    string every time. The wrappers are made once and installed while a watch is open.
    """

    def __init__(self, on_to_local: Any, on_from_local: Any) -> None:
        self.callbacks = (on_to_local, on_from_local)

    def __enter__(self) -> None:
        if not _watches:
            _swap_watch("wrapper")
        _watches.append(self.callbacks)

    def __exit__(self, *exc: object) -> None:
        _watches.remove(self.callbacks)
        if not _watches:
            _swap_watch("original")


_watches: list[tuple[Any, Any]] = []
_watch_originals: dict[str, Any] = {}


def _swap_watch(which: str) -> None:
    """Put the watch's ``"wrapper"`` or ``"original"`` functions in place."""
    if not _watch_originals:
        from torch.distributed.tensor._redistribute import DTensorRedistributePlanner

        _make_watch_wrappers(DTensorRedistributePlanner)
    w = _watch_originals[which]
    DTensor.to_local = w["to_local"]  # type: ignore[method-assign]
    DTensor.from_local = w["from_local"]  # type: ignore[method-assign]
    _watch_originals["planner"].stringify_transform_infos = w["stringify"]


def _make_watch_wrappers(planner: Any) -> None:
    orig_to_local = DTensor.to_local
    orig_from_local = DTensor.__dict__["from_local"]
    orig_stringify = planner.__dict__["stringify_transform_infos"]
    stringify = orig_stringify.__func__
    plans: dict[Any, str] = {}

    @functools.wraps(orig_to_local)
    def to_local(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_to_local(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            return out  # traced: a compiled region's calls are no user's to watch
        for on_to_local, _ in list(_watches):
            on_to_local(self, out, sys._getframe(1))
        return out

    @functools.wraps(orig_from_local.__func__)
    def from_local(*args: Any, **kwargs: Any) -> Any:
        out = orig_from_local.__func__(*args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        for _, on_from_local in list(_watches):
            on_from_local(out, sys._getframe(1))
        return out

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
            "stringify": orig_stringify,
        },
        wrapper={
            "to_local": to_local,
            "from_local": staticmethod(from_local),
            "stringify": staticmethod(stringify_memo),
        },
    )


# ``_c10d_functional`` is a private op namespace; resolved once, not per collective.
_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor


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
            _WAIT_TENSOR(x)


def settled(t: Any) -> Any:
    """A functional collective's result as a tensor: an ``AsyncCollectiveTensor``'s value (what
    ``to_local()`` of a redistributed DTensor can hand a module); anything else as it is.

    In the simulator the collective has run already and its per-rank value is read as it is; on a
    real rank it is waited for first (a recording waits for every collective anyway).
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):
        if isinstance(t.elem, LocalTensor):
            return t.elem
        return t.trigger_wait()
    return t


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


# The source file of FSDP2's parameter groups: a frame of it on the stack means FSDP itself issues
# what is running (an all-gather, a reduce-scatter), from hooks of other modules (the next layer's
# pre-backward re-gathers this one) or from the autograd engine's callbacks.
FSDP_GROUP_FILE = os.path.join(TORCH_DIR, *_FSDP_GROUP.split(".")[1:]) + ".py"


# The methods of an FSDP2 parameter group that run for the backward: what they issue is backward
# communication even where no autograd engine runs them (a pipeline schedule calls post_backward
# itself after its last microbatch).
FSDP_BACKWARD_METHODS = frozenset(
    {"pre_backward", "post_backward", "finalize_backward", "_backward_prefetch"}
)


def fsdp_owner(frame: FrameType) -> Any:
    """The module whose FSDP parameter group runs ``frame`` (a frame of ``FSDP_GROUP_FILE``), or
    None (a function there that is no method of a group)."""
    modules = getattr(frame.f_locals.get("self"), "modules", None)
    return modules[0] if modules else None


# Called as ``listener(rank, tensor)`` after FSDP2 resizes a storage in place in the simulation
# (``rank`` None for a plain tensor): a resize is no operator, so the recorder cannot see it.
STORAGE_RESIZE_LISTENERS: list[Callable[[int | None, torch.Tensor], None]] = []


def _per_rank_storage(original: Any) -> Any:
    @functools.wraps(original)
    def resize(tensor: torch.Tensor) -> None:
        per_rank = tensor._local_tensors if isinstance(tensor, LocalTensor) else {None: tensor}
        for r, t in per_rank.items():
            original(t)
            for listener in STORAGE_RESIZE_LISTENERS:
                listener(r, t)

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
        # Any: their module globals are patched below, which ModuleType's stubs do not allow.
        fp: Any = importlib.import_module(_FSDP_PARAM)
        fpg: Any = importlib.import_module(_FSDP_GROUP)
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


def _following_premul(name: str, original: Any) -> Any:
    position = _REDUCE_OP_ARG[name]

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        op: Any = kwargs.get("op", args[position] if len(args) > position else None)
        if getattr(op, "op", None) != dist.ReduceOp.PREMUL_SUM:  # a RedOpType has no .op
            return original(*args, **kwargs)
        factors = _premul_factors()
        factors.append(op.factor)
        try:
            return original(*args, **kwargs)
        finally:
            factors.pop()

    return call


@contextlib.contextmanager
def premul_sum_factors() -> Iterator[None]:
    """While the simulation runs, remember the factor of each PREMUL_SUM collective called through
    ``dist`` (FSDP2 with a gradient divide factor: ``reduce_scatter_single``) for the emulation
    that reads it (see ``_premul_factors``), and give LocalTensorMode's own reduction the PREMUL_SUM
    it lacks on torch 2.13 (the simulation runs without a recorder too: ``make bench``'s baseline)."""
    if hasattr(dist.ReduceOp, "unbox"):
        yield
        return
    saved = {name: getattr(dist, name) for name in _REDUCE_OP_ARG if hasattr(dist, name)}
    for name, original in saved.items():
        setattr(dist, name, _following_premul(name, original))
    c10d_module = importlib.import_module("torch.distributed._local_tensor._c10d")
    local_reduce = getattr(c10d_module, "_local_reduce")  # noqa: B009 (private: not in the stubs)

    @functools.wraps(local_reduce)
    def reduce_with_premul(reduce_op: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
        if reduce_op != dist.ReduceOp.PREMUL_SUM and reduce_op != "premul_sum":
            return local_reduce(reduce_op, tensors)
        factor = _plain_factor(_called_factor())
        out = tensors[0] * factor  # each rank's tensor scaled, summed in rank order (as recorded)
        for t in tensors[1:]:
            out = out + t * factor
        return out

    setattr(c10d_module, "_local_reduce", reduce_with_premul)  # noqa: B010
    try:
        yield
    finally:
        setattr(c10d_module, "_local_reduce", local_reduce)  # noqa: B010
        for name, original in saved.items():
            setattr(dist, name, original)


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


# --- per-rank values in the simulation -------------------------------------------------------
# In the lockstep simulation every rank runs each Python line at once, so a value that differs per
# rank can only be a per-rank SymInt (a LocalIntNode). torch 2.14 returns one from dist.get_rank();
# on 2.13 dist.get_rank() is 0 on every rank, and a process group's .rank() is 0 on every torch, so
# code that offsets by the rank (a vocab-parallel embedding) would silently compute rank 0's part
# on every rank. And a comparison the ranks disagree on (``if dist.get_rank() == 0:``) gives one
# answer for all ranks. While the simulation runs, code outside torch (the user's, a library's)
# gets the per-rank value, and a comparison of per-rank ints that the ranks disagree on raises
# PerRankValueError; torch's own code keeps the answers it was written against.

_THIS_FILE = os.path.abspath(__file__)
# SymInt's Python operators, between the code that compares and the node's method.
_SYMINT_PLUMBING = (
    os.path.join(TORCH_DIR, "fx", "experimental", "sym_node.py"),
    os.path.join(TORCH_DIR, "__init__.py"),
)
_COMPARISONS = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}


def _called_from_torch(frame: FrameType | None) -> bool:
    """Whether the code asking is torch's own (past this file and SymInt's operator plumbing)."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if fn != _THIS_FILE and fn not in _SYMINT_PLUMBING:
            return fn.startswith(TORCH_DIR)
        frame = frame.f_back
    return True


def group_rank_map(group: Any, ranks: Sequence[int]) -> dict[int, int]:
    """Each simulated rank's rank in its own copy of ``group`` (every group that runs a collective
    at once with it); -1 for a rank in none, as ``dist.get_rank(group)`` answers a non-member."""
    if group is None or group is dist.GroupMember.WORLD:
        return {r: r for r in ranks}
    mine = {r: i for g in p2p_groups(group) for i, r in enumerate(g)}
    return {r: mine.get(r, -1) for r in ranks}


def per_rank_int(values: Mapping[int, int]) -> Any:
    """A SymInt holding ``values[rank]`` on each simulated rank, as LocalTensorMode makes them."""
    return torch.SymInt(LocalIntNode(dict(values)))


def _rank_per_rank(original: Any) -> Any:
    @functools.wraps(original)
    def rank(*args: Any, **kwargs: Any) -> Any:
        mode = active_local_mode()
        if mode is None or _called_from_torch(sys._getframe(1)):
            return original(*args, **kwargs)
        group = args[0] if args else kwargs.get("group")
        return per_rank_int(group_rank_map(group, sorted(mode.ranks)))

    return rank


def _int_on(value: Any, rank: int) -> int:
    local = getattr(value, "_local_ints", None)
    if local is not None:
        return int(local[rank])
    return int(getattr(value, "val", value))


def _compare_per_rank(name: str, original: Any) -> Any:
    symbol = _COMPARISONS[name]

    @functools.wraps(original)
    def compare(self: Any, other: Any) -> Any:
        if not _called_from_torch(sys._getframe(1)):
            per_rank = {
                r: getattr(v, f"__{name}__")(_int_on(other, r)) for r, v in sorted(self._local_ints.items())
            }
            if len(set(per_rank.values())) > 1:
                rhs = dict(getattr(other, "_local_ints", {})) or _int_on(other, 0)
                raise PerRankValueError(
                    f"a per-rank value is compared here ({dict(self._local_ints)} {symbol} {rhs}, "
                    f"rank: value) and the simulated ranks disagree: {per_rank}. In the simulation "
                    "every rank runs this Python line at once, so it cannot take a different branch "
                    "or pick a different number on each rank; one answer for all of them would be "
                    "silently wrong. Write rank-dependent values as tensors (torch.where on "
                    "sv.per_rank(lambda rank: ...) or on torch.ones(n) * dist.get_rank() works per "
                    "rank), or run this code with one thread per rank, where each rank has plain "
                    "ints: sv.use('threads', world_size=N) (or on real process groups: "
                    "sv.use('gloo', world_size=N))."
                )
        return original(self, other)

    return compare


@contextlib.contextmanager
def per_rank_values() -> Iterator[None]:
    """While the simulation runs (entered inside its LocalTensorMode): ``dist.get_rank(group)`` and
    ``ProcessGroup.rank()`` give code outside torch each rank's own value, and comparisons of
    per-rank ints that the ranks disagree on raise (see above). Put back when it ends."""
    c10d = dist.distributed_c10d
    saved: list[tuple[Any, str, Any]] = [(dist.ProcessGroup, "rank", dist.ProcessGroup.__dict__["rank"])]
    patched: list[tuple[Any, str, Any]] = [
        (dist.ProcessGroup, "rank", _rank_per_rank(dist.ProcessGroup.rank))
    ]
    # On every torch: 2.14's own per-rank get_rank(group) maps a strided group's ranks wrongly (the
    # dp group [1, 5] of a (2, 4) mesh gives rank 1 the dp rank 1). Entered inside the mode, so
    # that torch's own callers keep whatever the mode put in place.
    wrapped = _rank_per_rank(dist.get_rank)
    for owner in (dist, c10d):
        saved.append((owner, "get_rank", owner.get_rank))
        patched.append((owner, "get_rank", wrapped))
    for name in _COMPARISONS:
        original = LocalIntNode.__dict__[name]
        saved.append((LocalIntNode, name, original))
        patched.append((LocalIntNode, name, _compare_per_rank(name, original)))
    for owner, name, value in patched:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def flight_recorder_dump(pickled: bool = False) -> bytes:
    """This process's PyTorch Flight Recorder buffer: JSON (no stacks), or torch's pickle (with
    stacks; only for a reader that opts in). Empty of entries unless ``TORCH_FR_BUFFER_SIZE`` (or
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``) was set before the process group was made. torch 2.13 and
    2.15 name it ``_dump_fr_trace_json`` (every backend, gloo included); NCCL-only builds of older
    torch ``_dump_nccl_trace_json``."""
    import torch._C._distributed_c10d as c10d

    names = (
        ("_dump_fr_trace", "_dump_nccl_trace")
        if pickled
        else ("_dump_fr_trace_json", "_dump_nccl_trace_json")
    )
    for name in names:
        fn = getattr(c10d, name, None)
        if fn is not None:
            out = fn()
            return out if isinstance(out, bytes) else str(out).encode()
    raise RuntimeError(f"this torch ({torch.__version__}) has no Flight Recorder dump function")


# --- point-to-point in the simulator: runner threads -------------------------------------------
# Torch's own send/recv under LocalTensorMode (``local_p2p_op``) maps ranks wrongly on groups other
# than WORLD, replaces buffers instead of writing into them and hangs on a deadlock. Here N threads
# run under torch's LocalRunnerMode (one at a time), each with its own LocalTensorMode over the
# whole world; ``P2PMode`` on top of it moves the messages itself. Plain data out through hooks.

import collections  # noqa: E402
import dataclasses  # noqa: E402


class P2PStuck(RuntimeError):
    """Every thread of a threaded simulation is finished or waiting for a message nobody sends."""


class P2PAborted(RuntimeError):
    """This thread stopped because another thread of the run failed first."""


@dataclasses.dataclass(eq=False)
class P2PMessage:
    """One message of a threaded run: global ranks, the group it went over, a copy of the value."""

    src: int
    dst: int
    group: tuple[int, ...]  # the group's global ranks, by group rank
    tag: int
    value: torch.Tensor  # a plain copy of what the sender's buffer held
    key: int  # id() of the tensor the sender passed (to find who sent it)
    thread: int
    desc: str = ""  # the process group's description ("mesh_pp" for a DeviceMesh's): its mesh dim


def p2p_groups(group: Any) -> list[tuple[int, ...]]:
    """Every group that runs a c10d op at once with ``group`` (rank 0's group in the fake process
    group): their global ranks, each indexed by group rank. torch 2.13 returns a 3-tuple, 2.15 a pair."""
    from torch.distributed._local_tensor import _c10d as lt_c10d

    found = lt_c10d._prepare_collective_groups(group)
    ranks, offsets = found[0], found[1]
    return [tuple(int(o) + int(r) for r in ranks) for o in offsets]


def _patched_globals() -> list[tuple[Any, str, Any]]:
    """Module and class attributes that entering a LocalTensorMode (or a recorder) replaces; a
    threaded run enters one mode per thread, so it saves them all and puts them back at the end."""
    import importlib as _il

    ltm_mod = _private["local_tensor_module"]
    saved: list[tuple[Any, str, Any]] = []
    for name in getattr(ltm_mod, "_PATCHED_DEVICE_MESH_METHODS", ()):
        saved.append((DeviceMesh, name, DeviceMesh.__dict__.get(name)))
    for global_name, _ in getattr(ltm_mod, "_PATCHED_RANDOM_FUNCTIONS", ()):
        mod_name, attr = global_name.rsplit(".", 1)
        mod = _il.import_module(mod_name)
        saved.append((mod, attr, getattr(mod, attr)))
    for name in ("get_rank", *getattr(ltm_mod, "_PATCHED_DIST_FUNCTIONS", ())):
        saved.append((dist, name, getattr(dist, name)))
    saved.append((DTensor, "to_local", DTensor.__dict__.get("to_local")))
    saved.append((DTensor, "from_local", DTensor.__dict__.get("from_local")))
    c10d = dist.distributed_c10d
    saved.append((c10d, "_check_not_self_rank", getattr(c10d, "_check_not_self_rank", None)))
    return saved


def _restore_globals(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, name, value in saved:
        if value is not None:
            setattr(owner, name, value)


class ThreadedP2P:
    """One threaded simulation: ``run(fn)`` calls ``fn(thread)`` in ``threads`` runner threads,
    each inside its own LocalTensorMode over ``world_size`` ranks; ``live[t]`` are the ranks thread
    ``t`` stands for (its other ranks are computed but meaningless). ``on_send(thread, msgs)`` is
    called once per send with its messages (one per group that runs it at once) before they are
    queued; ``on_recv(thread, msgs, key)`` once a receive's messages are in the receiver's buffer
    (``key``: id() of the receiving tensor); ``describe(thread)`` says where a blocked thread is,
    for the deadlock message."""

    def __init__(
        self,
        world_size: int,
        live: list[frozenset[int]],
        on_send: Any,
        on_recv: Any,
        describe: Any = None,
    ) -> None:
        self.world_size = world_size
        self.live = live
        self.threads = len(live)
        self.on_send = on_send
        self.on_recv = on_recv
        self.describe = describe or (lambda t: "")
        self.queues: dict[tuple[tuple[int, ...], int, int], collections.deque[P2PMessage]] = (
            collections.defaultdict(collections.deque)
        )
        self.finished: set[int] = set()
        self.waiting: dict[int, tuple[Any, str]] = {}
        self.error: BaseException | None = None
        self.interrupted: BaseException | None = None  # what stopped the calling thread (Ctrl-C)
        self.turn: int | None = 0  # the thread that runs now (one at a time, in a fixed order)
        self.results: dict[int, Any] = {}
        self._runner: Any = None
        self._local = threading.local()

    @property
    def thread(self) -> int:
        return int(self._local.thread)

    def run(self, fn: Any, setup: Any = None) -> dict[int, Any]:
        """``setup(thread)``, if given, is a context manager entered inside the thread's
        LocalTensorMode and under the P2P mode (a recorder goes there)."""
        from torch.distributed._local_tensor import LocalRunnerMode

        saved = _patched_globals()
        dist.distributed_c10d._check_not_self_rank = lambda *a, **k: None  # the fake PG is rank 0
        cond_box: list[Any] = []

        def main(t: int) -> None:
            try:
                body(t)
            except BaseException as e:
                if self.error is None and not isinstance(e, P2PAborted):
                    self.error = e
                cond_box[0].notify_all()

        def body(t: int) -> None:
            self._local.thread = t
            cond = cond_box[0]
            self._await_turn(t)
            self.check_stop()  # a thread that started late, after Ctrl-C, enters no mode
            try:
                with new_local_mode(self.world_size):
                    try:
                        with setup(t) if setup is not None else contextlib.nullcontext(), P2PMode(self, t):
                            self.results[t] = fn(t)
                    except BaseException as e:
                        if self.error is None and not isinstance(e, P2PAborted):
                            self.error = e
                        raise
                    finally:
                        # Keep this thread's mode (and the globals it patched) until all are done.
                        self.finished.add(t)
                        self.turn = self._next_runnable(t)
                        if (
                            self.turn is None
                            and self.waiting
                            and self.error is None
                            and self.interrupted is None
                        ):
                            # the rest wait for messages that no running thread can send
                            blocked = {u: w[1] for u, w in self.waiting.items()}
                            self.error = P2PStuck(self._deadlock_text(blocked))
                        cond.notify_all()
                        while (
                            len(self.finished) < self.threads
                            and self.error is None
                            and self.interrupted is None
                        ):
                            cond.wait(0.5)
            finally:
                cond.notify_all()

        ltm_mod = _private["local_tensor_module"]
        process_mode = getattr(ltm_mod, "_PROCESS_MODE", True)
        runner = LocalRunnerMode(self.world_size, self.threads, main)
        cond_box.append(runner._run_cond)
        self._runner = runner
        try:
            try:
                runner.__enter__()  # starts the threads
                self._join(runner)
            except BaseException as e:
                # Ctrl-C (a KeyboardInterrupt here, in the calling thread) while the runners run:
                # they stop at their next operator or wait, and are joined before the globals they
                # run under are reset, so that a later run starts clean.
                self.interrupted = e
                self._join(runner)
                raise
        finally:
            # Not LocalRunnerMode.__exit__: it re-raises the first thread's error before resetting
            # its globals and leaves the other threads unjoined.
            if getattr(ltm_mod, "_LOCAL_RUNNER_MODE", None) is runner:
                ltm_mod._LOCAL_RUNNER_MODE = None
            ltm_mod._PROCESS_MODE = process_mode
            _restore_globals(saved)
        if self.error is not None:
            raise self.error
        return self.results

    @staticmethod
    def _join(runner: Any) -> None:
        """Wait for every runner thread that was started (a KeyboardInterrupt can come while
        ``LocalRunnerMode`` starts them)."""
        for thread in runner._runners:
            if thread.ident is not None:
                threading.Thread.join(thread)

    def check_stop(self) -> None:
        """Raise ``P2PAborted`` in a runner thread once another thread failed or the run was
        interrupted."""
        if self.interrupted is not None:
            raise P2PAborted(f"stopped: the run was interrupted ({type(self.interrupted).__name__})")
        if self.error is not None:
            raise P2PAborted(f"stopped: another simulated thread failed ({type(self.error).__name__})")

    def _await_turn(self, t: int) -> None:
        """Wait (releasing the run lock) until it is thread ``t``'s turn, or a thread failed."""
        cond = self._runner._run_cond
        while self.turn != t:
            self.check_stop()
            cond.wait(0.5)

    def _next_runnable(self, t: int) -> int | None:
        """The thread to run after ``t`` stops, round robin from ``t + 1``: one not finished and
        not waiting for a message that is not there. Deterministic, so traces are too."""
        for k in range(1, self.threads + 1):
            u = (t + k) % self.threads
            if u == t or u in self.finished:
                continue
            waiting = self.waiting.get(u)
            if waiting is None or waiting[0]():
                return u
        return None

    def wait_for(self, ready: Any, what: str) -> None:
        """Block this thread (letting others run) until ``ready()``; a deadlock raises P2PStuck."""
        cond = self._runner._run_cond
        t = self.thread
        while not ready():
            self.check_stop()
            self.waiting[t] = (ready, what)
            nxt = self._next_runnable(t)
            if nxt is None:
                others = [u for u in range(self.threads) if u != t]
                blocked = {u: self.waiting[u][1] for u in others if u in self.waiting}
                blocked[t] = what
                del self.waiting[t]
                self.error = P2PStuck(self._deadlock_text(blocked))
                self.turn = None
                cond.notify_all()
                raise self.error
            self.turn = nxt
            cond.notify_all()
            try:
                self._await_turn(t)
            finally:
                del self.waiting[t]

    def _deadlock_text(self, blocked: dict[int, str]) -> str:
        lines = []
        for u in sorted(blocked):
            where = self.describe(u)
            lines.append(f"  ranks {sorted(self.live[u])}: waiting for {blocked[u]}{where}")
        done = sorted(r for u in self.finished for r in self.live[u])
        if done:
            lines.append(f"  ranks {done}: finished")
        return "\n".join(lines)


class P2PMode(TorchDispatchMode):
    """Entered in each runner thread on top of its LocalTensorMode: handles ``c10d.send`` and
    ``c10d.recv_`` between the threads' live ranks; everything else passes on."""

    def __init__(self, sim: ThreadedP2P, thread: int) -> None:
        super().__init__()
        self.sim = sim
        self.thread = thread
        self.live = sim.live[thread]

    def _me(self, group: tuple[int, ...], op: str) -> int:
        mine = [r for r in group if r in self.live]
        if len(mine) != 1:
            raise P2PGroupError(
                f"{op} on the group {list(group)}: it must hold exactly one rank of this thread "
                f"(ranks {sorted(self.live)}), it holds {mine or 'none'}. Send over the pipeline mesh "
                "dim's group (mesh.get_group('pp')), or run one thread per rank (threads=world_size)."
            )
        return mine[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.sim.interrupted is not None:
            self.sim.check_stop()  # Ctrl-C in the calling thread: stop at this operator
        kwargs = kwargs or {}
        if func is torch.ops.c10d.send.default:
            return self._send(*args, **kwargs)
        if func is torch.ops.c10d.recv_.default:
            return self._recv(*args, **kwargs)
        if func is torch.ops.c10d.recv_any_source_.default:
            raise P2PGroupError(
                "recv from any source (dist.recv(t) without src) is not simulated: pass src=<rank>"
            )
        return func(*args, **kwargs)

    def _send(self, tensors: Any, group: Any, dst: int, tag: int) -> Any:
        sim = self.sim
        (tensor,) = tensors
        msgs = []
        desc = process_group_desc(group)
        with no_dispatch(), torch.no_grad():
            for g in p2p_groups(group):
                src = self._me(g, "send")
                plain = tensor._local_tensors[src] if isinstance(tensor, LocalTensor) else tensor
                value = plain.detach().clone()
                msgs.append(P2PMessage(src, g[int(dst)], g, int(tag), value, id(tensor), self.thread, desc))
        sim.on_send(self.thread, msgs)
        for msg in msgs:
            sim.queues[(msg.group, msg.src, msg.dst)].append(msg)
        sim._runner._run_cond.notify_all()
        return fake_work()

    def _recv(self, tensors: Any, group: Any, src: int, tag: int) -> Any:
        from torch._C._distributed_c10d import PythonCallbackWork

        sim = self.sim
        (tensor,) = tensors
        wants = []
        for g in p2p_groups(group):
            wants.append((g, g[int(src)], self._me(g, "recv")))
        done = [False]

        def wait(timeout: Any = None) -> bool:
            if done[0]:
                return True
            got = []
            for g, s, d in wants:
                q = sim.queues[(g, s, d)]
                sim.wait_for(lambda q=q: len(q) > 0, f"a message from rank {s} to rank {d}")
                msg = q.popleft()
                with no_dispatch(), torch.no_grad():
                    buf = tensor._local_tensors[d] if isinstance(tensor, LocalTensor) else tensor
                    if tuple(buf.shape) != tuple(msg.value.shape) or buf.dtype != msg.value.dtype:
                        raise P2PGroupError(
                            f"recv on rank {d} from rank {s}: the receive buffer is "
                            f"{tuple(buf.shape)} {dtype_name(buf.dtype)} but rank {s} sent "
                            f"{tuple(msg.value.shape)} {dtype_name(msg.value.dtype)}; "
                            "they must match, as on real ranks"
                        )
                    buf.copy_(msg.value)
                    if isinstance(tensor, LocalTensor):
                        # The group's other ranks are simulated by other threads; here they mirror
                        # the receiver, so rank-independent code (a received size) stays consistent.
                        for r in g:
                            if r != d and r in tensor._local_tensors:
                                tensor._local_tensors[r].copy_(msg.value)
                got.append(msg)
            sim.on_recv(self.thread, got, id(tensor))
            done[0] = True
            return True

        return dist.distributed_c10d.Work.boxed(PythonCallbackWork(wait))


class P2PGroupError(RuntimeError):
    """A send or recv the threaded simulation cannot map onto its threads."""


_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
_STAGE_OPS = ("get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops")


@contextlib.contextmanager
def pipeline_stage_hooks(group_rank: Any, on_compute: Any, on_ops: Any) -> Iterator[None]:
    """While a threaded run lasts, patch ``torch.distributed.pipelining``'s stage class:
    ``group_rank(group)`` gives a new stage its rank in the pipeline group (``dist.get_rank`` is
    0, or a per-rank value, in the simulator); ``on_compute(stage_index, method, chunk)`` is a
    context manager around each forward / backward chunk; ``on_ops(stage_index, method, chunk,
    ops)`` sees the P2POps a stage is about to send or receive."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        yield
        return
    originals: dict[str, Any] = {}
    init = _PipelineStageBase.__dict__["__init__"]

    @functools.wraps(init)
    def stage_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.group_rank = group_rank(self.group)

    originals["__init__"] = init
    _PipelineStageBase.__init__ = stage_init  # type: ignore[method-assign]

    def compute(name: str, orig: Any) -> Any:
        @functools.wraps(orig)
        def wrapped(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            with on_compute(int(self.stage_index), name, int(chunk)):
                return orig(self, chunk, *args, **kwargs)

        return wrapped

    def ops(name: str, orig: Any) -> Any:
        @functools.wraps(orig)
        def wrapped(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, chunk, *args, **kwargs)
            on_ops(int(self.stage_index), name, int(chunk), [op.tensor for op in out])
            return out

        return wrapped

    for name in (*_STAGE_METHODS, *_STAGE_OPS):
        orig = _PipelineStageBase.__dict__.get(name)
        if orig is None:
            continue
        originals[name] = orig
        setattr(_PipelineStageBase, name, (compute if name in _STAGE_METHODS else ops)(name, orig))
    try:
        yield
    finally:
        for name, orig in originals.items():
            setattr(_PipelineStageBase, name, orig)


# --- one thread per rank (sv.use("threads")): a c10d world per thread ------------------------
# torch.distributed keeps its state (the default group, group names and ranks) in one module-level
# ``_world``, and resolves a functional collective's group name in a process-wide registry. Torch's
# threaded test process group makes both per-thread; shardviz's rank threads use the same two
# switches (torch's ThreadLocalWorld follows ``_World``'s fields from release to release).


@contextlib.contextmanager
def thread_local_c10d() -> Iterator[None]:
    """While it lasts, each thread has its own torch.distributed state: a rank thread's default
    process group, its meshes' groups and their names are its own, kept from one entry to the
    next (they live in the thread). The notebook's own state is put back after."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    c10d = dist.distributed_c10d
    isolate = torch._C._distributed_c10d._set_thread_isolation_mode  # type: ignore[attr-defined]
    saved = c10d._world
    c10d._world = ThreadLocalWorld()  # type: ignore[assignment]
    isolate(True)
    try:
        yield
    finally:
        isolate(False)
        c10d._world = saved


def callback_work(wait: Callable[..., bool]) -> Any:
    """A c10d Work, boxed as c10d ops return it, whose ``wait()`` calls ``wait(timeout)``: a
    receive that blocks only when its result is asked for (``irecv``, ``batch_isend_irecv``)."""
    from torch._C._distributed_c10d import PythonCallbackWork

    return dist.distributed_c10d.Work.boxed(PythonCallbackWork(wait))


def process_state() -> tuple[Any, ...]:
    """What of torch's process-wide state a rank changes for itself: the CPU generator, the
    default dtype, and DTensor's custom op handlers (``loss_parallel()`` adds its own while its
    block lasts). Each rank thread has its own, swapped in when it runs, as if it were a process."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    return (torch.get_rng_state(), torch.get_default_dtype(), handlers, dict(handlers))


def restore_process_state(state: tuple[Any, ...]) -> None:
    rng, dtype, handlers, contents = state
    torch.set_rng_state(rng)
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    dispatcher = DTensor._op_dispatcher
    if dispatcher._custom_op_handlers is not handlers:
        dispatcher._custom_op_handlers = handlers
    if handlers != contents:
        handlers.clear()
        handlers.update(contents)


RANK_BACKEND = "shardviz"


def rank_backend() -> str:
    """The process-group backend of a rank thread: torch's fake process group, whose every
    collective reaches the dispatcher (where shardviz carries it out), under a name of its own.
    Torch code that skips communicating on a group named "fake" (pipelining's shape inference
    and p2p set-up from torch 2.15, DeviceMesh's device set-up) then does what it would on the
    real backend the rank stands for."""
    if RANK_BACKEND.upper() not in dist.Backend._plugins:
        from torch._C._distributed_c10d import FakeProcessGroup

        def create(common: Any, options: Any) -> Any:
            # as torch's own "fake" backend creates it (the stubs lack the options argument)
            return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)  # type: ignore[call-arg]

        dist.Backend.register_backend(RANK_BACKEND, create, extended_api=True, devices=["cpu"])
    return RANK_BACKEND
