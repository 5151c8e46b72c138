"""NVIDIA PhysicsNeMo's ShardTensor (``physicsnemo.domain_parallel``): geometry, events, adoption.

A ShardTensor subclasses ``torch.Tensor`` (not DTensor) and keeps its own spec, a DTensorSpec
subclass whose ``_sharding_shapes`` lists the true local shape of every coordinate along each
Shard mesh dim: 3, 3, 2, 2 where DTensor's chunking would say 3, 3, 3, 1. This module is the one
place that reads PhysicsNeMo's private attributes (``_spec``, ``_sharding_shapes``,
``_local_tensor``, ``DistributedManager._shared_state``), so that a PhysicsNeMo release that
moves one breaks here, with the rest of shardviz speaking in Layouts. It is imported only once
PhysicsNeMo is (``shardviz.adapters``), and never imports PhysicsNeMo itself: what it needs is
read from ``sys.modules``.

- Geometry: ``layout(st)`` is the pure Layout with ``shard_sizes`` from the spec, checked against
  every rank's ``to_local()`` shape: a spec that disagrees with the data is an explained error,
  never a wrong picture.
- Events: while a recording runs, ``ShardTensor.to_local`` / ``from_local`` are op events (as
  DTensor's are) and ``ShardTensor.redistribute`` (``full_tensor``, ``scatter_tensor``'s slicing)
  is a redistribute event with the true layouts before and after. PhysicsNeMo's own frames are
  library frames, so events name the user's line.
- Adoption: ``DistributedManager`` sees the recording's world (rank, world size, device) the first
  time PhysicsNeMo asks inside a recording, so the user's ``DistributedManager.initialize()`` finds
  it initialised rather than starting a second default process group; under
  ``sv.use("threads")`` each rank's thread has a manager state of its own.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ...errors import ShardSpecError
from ...geometry.layout import Layout
from ...geometry.layout import compute as compute_layout
from .. import adapters
from .. import torch as _torch
from ..recorder import frames

NAME = "PhysicsNeMo"
_SHARD_TENSOR = "physicsnemo.domain_parallel.shard_tensor"
_SPEC = "physicsnemo.domain_parallel._shard_tensor_spec"
_MANAGER = "physicsnemo.distributed.manager"

_lock = threading.RLock()


def activate() -> None:
    """PhysicsNeMo's frames are library frames from now on: events name the user's line."""
    package = sys.modules.get("physicsnemo")
    path = getattr(package, "__file__", None)
    if path:
        frames.add_library(os.path.dirname(path))


def module_loaded(name: str) -> None:
    """A watched PhysicsNeMo module finished importing: hook what it defines."""
    if name == _MANAGER:
        _adopt_manager()
    elif name == _SHARD_TENSOR:
        _hook_shard_tensor()


def recording_started(rec: adapters.Recording) -> None:
    """Nothing to do up front: the manager adopts the world when PhysicsNeMo first asks."""


# --- what is a ShardTensor ------------------------------------------------------------------------


def _class(module: str, name: str) -> type | None:
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None)
    return cls if isinstance(cls, type) else None


def handles(obj: object) -> bool:
    cls = _class(_SHARD_TENSOR, "ShardTensor")
    return cls is not None and isinstance(obj, cls)


def handles_spec(spec: object) -> bool:
    cls = _class(_SPEC, "ShardTensorSpec")
    return cls is not None and isinstance(spec, cls)


def local(st: Any) -> torch.Tensor:
    """The local shard, as ``to_local()`` returns it without autograd (every rank's, in lockstep)."""
    return st._local_tensor


# --- geometry ---------------------------------------------------------------------------------------


def spec_shard_sizes(spec: Any) -> dict[int, tuple[int, ...]] | None:
    """Size along the sharded tensor dim of each coordinate, per Shard mesh dim: ``{0: (3, 3, 2, 2)}``;
    None when the spec does not know them (PhysicsNeMo gathers them lazily, on CUDA)."""
    shapes = getattr(spec, "_sharding_shapes", None)
    if shapes is None:
        return None
    out: dict[int, tuple[int, ...]] = {}
    for m, p in enumerate(spec.placements):
        plain = _torch.placement_to_plain(p)
        if plain.kind != "shard":
            continue
        per = shapes.get(m)
        if per is None:
            return None
        out[m] = tuple(int(shape[plain.dim]) for shape in per)
    return out


def layout(st: Any, *, check: bool = True) -> Layout:
    """The ShardTensor's Layout with its true shard sizes, checked against the local shards."""
    spec = st._spec
    geometry = _torch.spec_geometry(spec)
    if geometry is None:
        raise ShardSpecError(f"this ShardTensor's spec has no tensor metadata ({type(spec).__name__})")
    sizes = spec_shard_sizes(spec)
    if sizes is None:
        raise ShardSpecError(
            "shardviz: this ShardTensor's spec does not record its shard sizes (sharding_shapes is "
            "None: PhysicsNeMo would gather them with a CUDA all_gather when first asked, which a CPU "
            "run cannot do). Build it with the sizes each rank holds, ShardTensor.from_local(local, "
            "mesh, placements, sharding_shapes={mesh_dim: [shape of each coordinate, ...]}), or with "
            'sharding_shapes="chunk" and global_shape=... when the shards follow chunking.'
        )
    try:
        lay = compute_layout(**geometry, shard_sizes=sizes or None)
    except ValueError as e:
        raise ShardSpecError(
            f"shardviz: this ShardTensor's spec contradicts itself: global shape "
            f"{tuple(geometry['global_shape'])}, sharding shapes {_shapes_text(spec)}: {e}"
        ) from e
    if check:
        _check(lay, st)
    return lay


def _shapes_text(spec: Any) -> str:
    shapes = getattr(spec, "_sharding_shapes", None)
    if shapes is None:
        return "unknown"
    return "{" + ", ".join(f"{m}: {[tuple(s) for s in v]}" for m, v in sorted(shapes.items())) + "}"


def _check(lay: Layout, st: Any) -> None:
    """Every rank's drawn shard has its local tensor's shape, or an explained error."""
    mine = local(st)
    held = _torch.local_tensors(mine)
    if held is None:
        if not dist.is_initialized() or dist.get_backend() == "fake":
            held = {r: mine for r in lay.ranks}  # the lockstep simulator: one tensor on every rank
        else:  # a real rank, or a rank's thread: its own shard only
            rank = dist.get_rank()
            held = {rank: mine} if rank in lay.ranks else {}
    wrong = []
    for rank, t in sorted(held.items()):
        if rank not in lay.ranks:
            continue
        want = lay.shard(rank).shape
        have = tuple(int(s) for s in t.shape)
        if have != want:
            wrong.append(f"rank {rank} holds a local tensor of shape {have} where the spec says {want}")
    if wrong:
        raise ShardSpecError(
            "shardviz: this ShardTensor's spec and its local shards disagree: "
            + "; ".join(wrong)
            + f" (global shape {lay.global_shape}, placements [{', '.join(lay.placements)}], sharding "
            f"shapes {_shapes_text(st._spec)}). PhysicsNeMo takes sharding_shapes= as given, without "
            "checking it against the data, so its collectives would move the wrong elements; shardviz "
            "draws nothing rather than a wrong picture. Give from_local the shape each rank really "
            "holds (sharding_shapes={mesh_dim: [shape of coordinate 0, 1, ...]}), the same on every rank."
        )


# --- events -----------------------------------------------------------------------------------------

_originals: dict[str, Any] = {}
_hooked = False


def _hook_shard_tensor() -> None:
    """Wrap ShardTensor's to_local, from_local and redistribute once; the wrappers report to the
    recorder of the thread they run in, and do nothing else when none records."""
    global _hooked
    cls = _class(_SHARD_TENSOR, "ShardTensor")
    if cls is None or _hooked:
        return
    with _lock:
        if _hooked:
            return
        _originals.update(
            to_local=cls.__dict__["to_local"],
            from_local=cls.__dict__["from_local"],
            redistribute=cls.__dict__["redistribute"],
        )
        cls.to_local = _to_local(_originals["to_local"])  # type: ignore[attr-defined]
        cls.from_local = staticmethod(_from_local(_originals["from_local"].__func__))  # type: ignore[attr-defined]
        cls.redistribute = _redistribute(_originals["redistribute"])  # type: ignore[attr-defined]
        _hooked = True


def _recorder() -> Any:
    rec = adapters.recording()
    return None if rec is None else rec.recorder


def _to_local(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def to_local(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        rec = _recorder()
        if rec is not None:
            rec.note_to_local(self, out, sys._getframe(1))
        return out

    return to_local


def _from_local(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def from_local(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        rec = _recorder()
        if rec is not None:
            rec.note_from_local(out, sys._getframe(1))
        return out

    return from_local


def _explicit(caller: FrameType) -> bool:
    """Whether the user asked for this redistribute (``redistribute``, ``full_tensor``,
    ``scatter_tensor``), rather than an operator's handler on the way from the user's line (an
    implicit one, as DTensor's for an operator's operands)."""
    frame: FrameType | None = caller
    while frame is not None and frames.is_library(frame):
        if frame.f_code.co_name in ("__torch_function__", "__torch_dispatch__"):
            return False
        frame = frame.f_back
    return True


def _plan(src: tuple[str, ...], dst: tuple[str, ...]) -> str:
    """The plan string of a redistribute that changes one mesh dim ("S(0)->R"), as DTensor writes
    it; "" for one that changes several (PhysicsNeMo orders those steps itself)."""
    changed = [m for m, (a, b) in enumerate(zip(src, dst, strict=True)) if a != b]
    return f"{''.join(src)}->{''.join(dst)}" if len(changed) == 1 else ""


def _redistribute(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def redistribute(self: Any, device_mesh: Any = None, placements: Any = None, **kwargs: Any) -> Any:
        rec = _recorder()
        if rec is None or placements is None:
            return original(self, device_mesh, placements, **kwargs)
        caller = sys._getframe(1)
        mesh = device_mesh or self.device_mesh
        src = _torch.placements_str(self.placements)
        try:
            dst = _torch.placements_str(tuple(placements))
            before: Layout | None = layout(self)
        except (ShardSpecError, TypeError, ValueError):
            return original(self, device_mesh, placements, **kwargs)  # PhysicsNeMo says what is wrong
        opened = rec.open_layout_redistribute(mesh, before, src, dst, _plan(src, dst), _explicit(caller))
        try:
            out = original(self, device_mesh, placements, **kwargs)
            if handles(out):
                opened.after = layout(out, check=False)
            return out
        finally:
            rec.close_redistribute(opened)

    return redistribute


# --- DistributedManager: adopting the recording's world ---------------------------------------------


class _ManagerState:
    """``DistributedManager._shared_state``, a class-level dict in PhysicsNeMo (one Borg state per
    process). Here: that dict, except in a rank's thread under ``sv.use("threads")``, which has one
    of its own (each thread is a process of its own there). Inside a recording it is filled from the
    recording's world the first time PhysicsNeMo reads it (``_adopt``), and again when the world
    changes (``sv.use``, ``sv.restart``), so that a cached mesh never outlives its process group."""

    def __init__(self, shared: dict[str, Any]) -> None:
        self.shared = shared
        self.threads = threading.local()

    def __get__(self, obj: object, cls: type | None = None) -> dict[str, Any]:
        return self.current(adopt=True)

    def current(self, adopt: bool) -> dict[str, Any]:
        rec = adapters.recording()
        own: dict[str, Any] | None = getattr(self.threads, "state", None)
        if rec is None:
            return own if own is not None else self.shared
        if rec.rank is not None and threading.current_thread() is not threading.main_thread():
            if own is None:
                own = self.threads.state = {}
            state = own
        else:
            state = self.shared
        if adopt:
            world = dist.group.WORLD if dist.is_initialized() else None
            mark = state.get("_shardviz")
            if mark is None:
                if not _own_setup_of(state, rec):
                    _adopt(state, rec, world)
            elif mark[0] is not world or mark[1:] != (rec.world_size, rec.rank):
                _adopt(state, rec, world)
        return state


def _own_setup_of(state: dict[str, Any], rec: adapters.Recording) -> bool:
    """Whether PhysicsNeMo set up this very world itself (a torchrun job recorded with
    ``sv.record_job``): then its state, meshes and clean-up are its own and are left alone."""
    return (
        rec.rank is not None
        and bool(state.get("_distributed"))
        and state.get("_world_size") == rec.world_size
        and state.get("_rank") == rec.rank
    )


def _adopt(state: dict[str, Any], rec: adapters.Recording, world: Any) -> None:
    """What ``DistributedManager.initialize()`` would have found out, from the recording's world."""
    n = rec.world_size
    if rec.rank is None:  # lockstep: every rank at once, as per-rank ints
        rank: Any = _torch.per_rank_int({r: r for r in range(n)})
        local_rank: Any = rank
    else:
        rank = rec.rank
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    device = torch.device("cuda", int(local_rank)) if cuda else torch.device("cpu")
    state.clear()  # a mesh or group cached by an earlier world is gone with it
    state.update(
        _is_initialized=True,
        _distributed=True,
        _rank=rank,
        _world_size=n,
        _local_rank=local_rank,
        _device=device,
        _cuda=cuda,
        _initialization_method="shardviz",
        _shardviz=(world, n, rec.rank),
    )


def _adopt_manager() -> None:
    cls = _class(_MANAGER, "DistributedManager")
    if cls is None or isinstance(cls.__dict__.get("_shared_state"), _ManagerState):
        return
    with _lock:
        if isinstance(cls.__dict__.get("_shared_state"), _ManagerState):
            return
        state = _ManagerState(cls.__dict__["_shared_state"])
        cls._shared_state = state  # type: ignore[attr-defined]
        initialize = cls.__dict__["initialize"]
        cleanup = cls.__dict__["cleanup"]

        @functools.wraps(initialize.__func__)
        def adopted_initialize(*args: Any, **kwargs: Any) -> Any:
            if "_shardviz" in state.current(adopt=True):
                return None  # the process group is shardviz's: nothing to set up
            return initialize.__func__(*args, **kwargs)

        @functools.wraps(cleanup.__func__)
        def adopted_cleanup(*args: Any, **kwargs: Any) -> Any:
            current = state.current(adopt=False)
            if "_shardviz" in current:
                current.clear()  # forget the adopted world; its process group is shardviz's
                return None
            try:
                return cleanup.__func__(*args, **kwargs)
            finally:  # PhysicsNeMo's cleanup replaces the state with a new dict: keep it per thread
                fresh = cls.__dict__.get("_shared_state")
                if isinstance(fresh, dict):
                    state.shared = fresh
                    cls._shared_state = state  # type: ignore[attr-defined]

        cls.initialize = staticmethod(adopted_initialize)  # type: ignore[attr-defined]
        cls.cleanup = staticmethod(adopted_cleanup)  # type: ignore[attr-defined]
        # PhysicsNeMo registers cleanup to run at exit, where it would destroy a process group
        # that is not its own: the wrapper runs instead.
        atexit.unregister(cleanup)
        atexit.register(adopted_cleanup)


# --- errors -----------------------------------------------------------------------------------------


def ways_out(op: str) -> str:
    """The ways out of a missing sharding strategy, for an operator on ShardTensors."""
    parts = op.split(".")
    name = parts[1] if len(parts) > 1 and parts[0] == "aten" else None
    fn = f"torch.{name}" if name else "the torch function"
    method = f"x.{name}(...) is torch.Tensor.{name}" if name else "a method form is another function"
    return (
        "PhysicsNeMo's ShardTensor hands an operator with no handler of its own to DTensor, so "
        "DTensor's missing strategy is the error. Ways out:\n"
        f"  1. register a handler: ShardTensor.register_function_handler({fn}, handler), where "
        "handler(func, types, args, kwargs) computes on each rank's x.to_local(), combines the "
        "results with a collective (dist.all_reduce(result, group=x._spec.mesh.get_group())) and "
        "returns ShardTensor.from_local(result, x._spec.mesh, (Replicate(),)); it catches "
        f"{fn}(x, ...) only ({method}, registered on its own);\n"
        f"  2. ShardTensor.register_dispatch_handler(torch.ops.{op}, handler) takes handler(*args, "
        "**kwargs) at the aten level, but in eager code ShardTensor turns its inputs into DTensors "
        "before dispatch, so such a handler is reached only under torch.compile: use 1 in eager code;\n"
        "  3. gather first: x.full_tensor() on each input (every rank then holds the whole tensor; "
        f"the all-gather is the price), run {fn} on plain tensors, and ShardTensor.from_local the "
        "result if it should stay distributed.\n"
        "notebooks/10_physicsnemo_shardtensor.ipynb walks through 1."
    )


# Frames between a trap and the code that fell into it: torch's and shardviz's own.
_NOT_CULPRITS = (
    os.path.join(os.path.dirname(torch.__file__), ""),
    frames.OWN_DIR,
)


def _package_dir() -> str | None:
    path = getattr(sys.modules.get("physicsnemo"), "__file__", None)
    return os.path.join(os.path.dirname(path), "") if path else None


def explain_error(error: BaseException, where: list[tuple[str, str]], lockstep: bool) -> str | None:
    """What went wrong inside PhysicsNeMo's own code, and what to do; None when it is not a trap
    this adapter knows. ``where`` is the traceback as (file, function) pairs, outermost first."""
    from ...errors import PerRankValueError

    package = _package_dir()
    # The innermost frame past torch and shardviz must be PhysicsNeMo's: a user's handler called
    # from inside PhysicsNeMo is the user's code, not a PhysicsNeMo trap.
    culprits = [f for f, _ in where if not f.startswith(_NOT_CULPRITS)]
    if not package or not culprits or not culprits[-1].startswith(package):
        return None
    named = [(f, fn) for f, fn in where if f.startswith(package) and not fn.startswith("<")]
    file, func = named[-1] if named else (culprits[-1], "code")
    site = f"{func} in physicsnemo/{os.path.relpath(file, package)}"
    msg = str(error.args[0]) if error.args else ""
    if func in ("_gather_shard_shapes_for_dim", "_all_gather_shard_shapes") or "pin_memory" in msg:
        return (
            f"shardviz: PhysicsNeMo works out shard sizes here ({site}) by gathering them on CUDA: "
            'sharding_shapes="infer" (the default of ShardTensor.from_local) does, and so does '
            "sharding_shapes() of a spec that does not know them. Without a GPU that fails. Give the "
            "sizes: ShardTensor.from_local(local, mesh, placements, sharding_shapes={mesh_dim: [shape "
            'of coordinate 0, 1, ...]}), or sharding_shapes="chunk" with global_shape=... when the '
            "shards follow chunking."
        )
    per_rank = isinstance(error, PerRankValueError) or (
        isinstance(error, AttributeError) and "'LocalIntNode' object has no attribute" in msg
    )
    if lockstep and per_rank:
        return (
            f"shardviz: PhysicsNeMo's {site} needs this rank's own number as a plain Python int (a "
            "list indexed by the mesh coordinate, a branch on the rank or on a shard's size). The "
            "lockstep simulator runs every rank's Python line at once, so it cannot give one. Run "
            "PhysicsNeMo code with one thread per rank, where every rank has plain ints and the code "
            'runs as written: sv.use("threads", world_size=N), then sv.run(fn) or a %%spmd cell (or '
            'on real ranks: sv.use("gloo", world_size=N)). In the lockstep simulator, ShardTensor.'
            "from_local with explicit sharding_shapes and per-rank locals (sv.per_rank), to_local, "
            'operators and handlers work; scatter_tensor, from_local(..., sharding_shapes="chunk"), '
            "from_dtensor, offsets() and redistributes of uneven shards need the threads."
        )
    return None
