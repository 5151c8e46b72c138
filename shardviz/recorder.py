"""The Recorder: a dispatch mode on top of LocalTensorMode that turns collectives into events.

It sees every aten op the simulation runs, so the common path (a local, non-collective op)
is one dict lookup and one tuple membership test before handing the op on. Collectives are
snapshotted per rank before and after; DTensor operators and redistributes become enclosing
events. It derives from DebugMode only so that DTensor reports redistributes to it (source and
target placements, the plan string); none of DebugMode's own logging runs.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import linecache
import math
import os
import re
import sys
import tokenize
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np
import torch

from . import _torch
from . import mesh as _mesh
from .errors import ShardvizError, SimulationWarning
from .layout import Layout
from .layout import compute as compute_layout
from .trace import (
    CollectiveEvent,
    Event,
    LocalEvent,
    OpEvent,
    RedistributeEvent,
    Source,
    TensorSnapshot,
    Trace,
)


class PlainTensorCollectiveError(ShardvizError, RuntimeError):
    """A collective under the simulation got only plain tensors: the fake group would skip it."""


@dataclass(frozen=True, slots=True)
class _Spec:
    """How to read one collective op's arguments."""

    op: str
    inputs: str | None
    outputs: str | None  # an argument name, or "return"
    root: str | None = None
    reduce: bool = False
    group: str = "process_group"


def _c10d(op: str, inputs: str | None, outputs: str | None, **kw: Any) -> _Spec:
    return _Spec(op, inputs, outputs, **kw)


def _func(op: str, inputs: str, outputs: str = "return", **kw: Any) -> _Spec:
    return _Spec(op, inputs, outputs, group="group_name", **kw)


_SPECS: dict[str, _Spec] = {
    "c10d.allreduce_": _c10d("all_reduce", "tensors", "tensors", reduce=True),
    "c10d.allreduce_coalesced_": _c10d("all_reduce", "tensors", "tensors", reduce=True),
    "c10d.allgather_": _c10d("all_gather", "input_tensors", "output_tensors"),
    "c10d._allgather_base_": _c10d("all_gather", "input_tensor", "output_tensor"),
    "c10d.allgather_into_tensor_coalesced_": _c10d("all_gather", "inputs", "outputs"),
    "c10d.allgather_coalesced_": _c10d("all_gather", "input_list", "output_lists"),
    "c10d.reduce_scatter_": _c10d("reduce_scatter", "input_tensors", "output_tensors", reduce=True),
    "c10d._reduce_scatter_base_": _c10d("reduce_scatter", "input_tensor", "output_tensor", reduce=True),
    "c10d.reduce_scatter_tensor_coalesced_": _c10d("reduce_scatter", "inputs", "outputs", reduce=True),
    "c10d.broadcast_": _c10d("broadcast", "tensors", "tensors", root="root_rank"),
    "c10d.scatter_": _c10d("scatter", "input_tensors", "output_tensors", root="root_rank"),
    "c10d.gather_": _c10d("gather", "input_tensors", "output_tensors", root="root_rank"),
    "c10d.reduce_": _c10d("reduce", "tensors", "tensors", root="root_rank", reduce=True),
    "c10d.alltoall_": _c10d("all_to_all", "input_tensors", "output_tensors"),
    "c10d.alltoall_base_": _c10d("all_to_all", "input", "output"),
    "c10d.barrier": _c10d("barrier", None, None),
    "c10d.monitored_barrier_": _c10d("barrier", None, None),
    "c10d.send": _c10d("send", "tensors", None, root="dst"),
    "c10d.recv_": _c10d("recv", None, "tensors", root="src"),
    "c10d.recv_any_source_": _c10d("recv", None, "tensors"),
    "_c10d_functional.all_reduce": _func("all_reduce", "input", reduce=True),
    "_c10d_functional.all_reduce_": _func("all_reduce", "input", "input", reduce=True),
    "_c10d_functional.all_reduce_coalesced": _func("all_reduce", "inputs", reduce=True),
    "_c10d_functional.all_reduce_coalesced_": _func("all_reduce", "inputs", "inputs", reduce=True),
    "_c10d_functional.all_gather_into_tensor": _func("all_gather", "input"),
    "_c10d_functional.all_gather_into_tensor_out": _func("all_gather", "input", "out"),
    "_c10d_functional.all_gather_into_tensor_coalesced": _func("all_gather", "inputs"),
    "_c10d_functional.reduce_scatter_tensor": _func("reduce_scatter", "input", reduce=True),
    "_c10d_functional.reduce_scatter_tensor_out": _func("reduce_scatter", "input", "out", reduce=True),
    "_c10d_functional.reduce_scatter_tensor_coalesced": _func("reduce_scatter", "inputs", reduce=True),
    "_c10d_functional.all_to_all_single": _func("all_to_all", "input"),
    "_c10d_functional.broadcast": _func("broadcast", "input", root="src"),
    "_c10d_functional.broadcast_": _func("broadcast", "input", "input", root="src"),
    "_dtensor.shard_dim_alltoall": _func("all_to_all", "input"),
}


def _resolve_specs() -> dict[Any, tuple[_Spec, str, list[str]]]:
    """Map each collective OpOverload to (spec, impl name, argument names)."""
    out: dict[Any, tuple[_Spec, str, list[str]]] = {}
    for name, spec in _SPECS.items():
        for overload, ov in _torch.op_overloads(name):
            impl = name if overload == "default" else f"{name}.{overload}"
            out[ov] = (spec, impl, _torch.op_argument_names(ov))
    return out


_COLLECTIVES = _resolve_specs()

_REDUCE_NAMES = {
    "SUM": "sum",
    "AVG": "avg",
    "PRODUCT": "product",
    "MIN": "min",
    "MAX": "max",
    "BAND": "band",
    "BOR": "bor",
    "BXOR": "bxor",
    "PREMUL_SUM": "premul_sum",
}

# Frames from these places are library code, not the user's line.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
# Library wrappers between a user's call and torch (typing_extensions' @deprecated wraps
# dist.all_gather_into_tensor and dist.reduce_scatter_tensor).
_SKIP_FILES = ("contextlib.py", "functools.py", "threading.py", "typing_extensions.py", "warnings.py")
_DTENSOR_DISPATCH = os.path.join(_TORCH_DIR, "distributed", "tensor", "_dispatch.py")
_IPYKERNEL_CELL = re.compile(r"ipykernel_\d+[/\\]\d+\.py$")


def _user_frame(frame: FrameType | None, meshes: list[Any] | None = None) -> tuple[FrameType | None, bool]:
    """The innermost frame outside torch and shardviz, and whether DTensor dispatch is on the way.

    With ``meshes``, DeviceMeshes held by torch's frames on the way (``distribute_tensor``'s
    ``device_mesh``, a redistribute's ``mesh``) are collected: they name the mesh dims.
    """
    in_dispatch = False
    while frame is not None:
        kind = _code_kind(frame.f_code)
        if kind == _USER:
            return frame, in_dispatch
        if kind & _DISPATCH:
            in_dispatch = True
        if kind & _MESH and meshes is not None and not meshes:
            f_locals = frame.f_locals  # builds a dict: only for the innermost frame with a mesh
            for key in ("device_mesh", "mesh"):
                m = f_locals.get(key)
                if isinstance(m, _torch.DeviceMesh):
                    meshes.append(m)
                    break
        frame = frame.f_back
    return None, in_dispatch


# What a frame's code is, memoised per code object: a frame walk runs for every event.
_USER, _LIBRARY, _DISPATCH, _MESH = 0, 1, 2, 4


@functools.lru_cache(maxsize=65536)
def _code_kind(code: Any) -> int:
    fn = code.co_filename
    if fn.startswith(_TORCH_DIR):
        kind = _LIBRARY
        if fn == _DTENSOR_DISPATCH:
            kind |= _DISPATCH
        if "device_mesh" in code.co_varnames or "mesh" in code.co_varnames:
            kind |= _MESH
    elif fn.startswith(_OWN_DIR) or fn.endswith(_SKIP_FILES) or fn.startswith("<frozen"):
        kind = _LIBRARY
    else:
        kind = _USER
    return kind


_sources: dict[tuple[Any, int], Source] = {}


def _source(frame: FrameType | None) -> Source | None:
    """The user's source line; memoised per code position (loops record the same line again)."""
    if frame is None:
        return None
    key = (frame.f_code, frame.f_lasti)
    hit = _sources.get(key)
    if hit is None:
        hit = _read_source(frame)
        if len(_sources) > 4096:
            _sources.clear()
        _sources[key] = hit
    return hit


def _read_source(frame: FrameType) -> Source:
    fn = frame.f_code.co_filename
    line = frame.f_lineno
    text = linecache.getline(fn, line).strip()
    end = _end_line(frame) if text.count("(") > text.count(")") else None
    if end is not None and end > line:  # a call spread over several lines: the whole call
        rest = (linecache.getline(fn, i).strip() for i in range(line + 1, min(end, line + 8) + 1))
        text = " ".join([text, *rest])
    if "#" in text:
        text = _without_comment(text)
    if _IPYKERNEL_CELL.search(fn):
        fn = "<cell>"
    return Source(fn, line, text)


def _without_comment(text: str) -> str:
    """The line without its trailing comment (tokenized, so a '#' inside a string stays)."""
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return text
    for tok in tokens:
        if tok.type == tokenize.COMMENT and tok.start[0] == 1:
            return text[: tok.start[1]].rstrip() or text
    return text


def _end_line(frame: FrameType) -> int | None:
    """Last source line of the instruction running in ``frame`` (positions of Python 3.11+)."""
    try:
        positions = iter(frame.f_code.co_positions())
        for _ in range(frame.f_lasti // 2):
            next(positions)
        return next(positions)[1]
    except (StopIteration, AttributeError, ValueError):
        return None


class ValueBudget:
    """The value policy: keep snapshot values until a per-trace byte budget is spent."""

    def __init__(self, policy: str | int) -> None:
        if policy == "all":
            self.left: float = float("inf")
        elif policy == "none":
            self.left = 0
        elif isinstance(policy, int) and not isinstance(policy, bool) and policy >= 0:
            self.left = policy
        else:
            raise ValueError(f'values must be "all", "none" or a byte budget (an int >= 0), not {policy!r}')
        self.exhausted_at: int | None = None

        self.keeps_any = self.left > 0

    def take(self, nbytes: int, event_id: int) -> bool:
        if nbytes <= self.left:
            self.left -= nbytes
            return True
        if self.exhausted_at is None and self.keeps_any:
            self.exhausted_at = event_id
        return False


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A private copy of ``t``'s values as numpy (widened where numpy lacks the dtype).

    A small buffer is copied by numpy, with no torch op to dispatch. A large one is copied by
    torch: its allocator hands back freed pages, where a fresh numpy buffer of a large snapshot is
    faulted in page by page on first write (six times slower here at 1 MiB).
    """
    with _quiet((t,)):
        if _readable(t) and t.numel() * t.element_size() <= _SMALL:
            return t.numpy().copy()
        t = t.detach().resolve_conj().resolve_neg()
        widened = _NUMPY_WIDER.get(t.dtype)
        if widened is None and t.dtype.is_floating_point and t.element_size() == 1:
            widened = torch.float32  # the float8 variants
        if t.device.type != "cpu" or widened is not None:
            return t.to("cpu", widened or t.dtype).contiguous().numpy()  # already a new tensor
        return t.clone(memory_format=torch.contiguous_format).numpy()


def _numpy_native(t: torch.Tensor) -> bool:
    """A plain CPU tensor whose bytes numpy reads as they are (dtype, no conj or neg bit)."""
    return (
        type(t) in _PLAIN
        and t.device.type == "cpu"
        and t.dtype not in _NUMPY_WIDER
        and not (t.dtype.is_floating_point and t.element_size() == 1)
        and not (t.is_conj() or t.is_neg())
    )


def _readable(t: torch.Tensor) -> bool:
    """Whether numpy can view ``t`` as it is: no torch op (and no dispatch) needed to read it."""
    return _numpy_native(t) and not t.requires_grad


def _view(t: torch.Tensor) -> np.ndarray:
    """``t``'s values as numpy, sharing its memory."""
    with _torch.plain_ops():
        return t.detach().numpy() if t.requires_grad else t.numpy()


def _quiet(tensors: Iterable[Any]) -> Any:
    """Where ops on these tensors run to their kernels, unseen by any dispatch mode: a cheap C++
    guard for plain tensors; for a subclass (a FakeTensor), modes off and its own handler kept."""
    return _torch.plain_ops() if all(type(t) in _PLAIN for t in tensors) else _torch.no_dispatch()


_SMALL = 64 * 1024
_PLAIN = (torch.Tensor, torch.nn.Parameter)


_NUMPY_WIDER = {
    torch.bfloat16: torch.float32,
    torch.float16: torch.float32,
    torch.complex32: torch.complex64,
    torch.uint16: torch.int64,
    torch.uint32: torch.int64,
    torch.uint64: torch.int64,
}


@dataclass
class _Alias:
    """A buffer that snapshots alias: the tensor itself (its version counter tells of writes), its
    version when aliased, and the one numpy view every snapshot of it shares."""

    tensor: torch.Tensor
    version: int
    values: np.ndarray
    snapshots: list[TensorSnapshot] = dataclasses.field(default_factory=list)

    def settle(self, keep_alias: bool) -> int:
        """Copy (or, if nobody else holds the buffer, keep) the values; returns how many snapshots
        lost theirs to a write that bypassed dispatch."""
        if _torch.version_counter(self.tensor) != self.version:
            for snap in self.snapshots:
                object.__setattr__(snap, "values", None)
            return len(self.snapshots)
        if not keep_alias:
            values = _numpy(self.tensor)
            for snap in self.snapshots:
                object.__setattr__(snap, "values", _shaped(values, snap.shape))
        return 0


def _shaped(values: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``values`` seen in a view's shape; the same array when it already has it, so that the
    snapshots of one buffer share one array (a trace file stores it once)."""
    return values if values.shape == shape else values.reshape(shape)


def _aliasable(t: torch.Tensor) -> bool:
    """A tensor numpy reads as it is that is its whole buffer."""
    return (
        _numpy_native(t)
        and t.numel() > 0
        and t.storage_offset() == 0
        and t.is_contiguous()
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _holders(held: _Alias) -> tuple[int, int, int]:
    """Python references to the tensor, C++ references to its TensorImpl (a ``.grad`` slot, a
    saved-for-backward), and holders of its storage (views, numpy arrays)."""
    t = held.tensor
    return sys.getrefcount(t), _torch.tensor_users(t), _torch.storage_users(t)


@functools.cache
def _alone() -> tuple[int, int, int]:
    """``_holders`` of a buffer that nothing but its _Alias holds."""
    with _torch.no_dispatch():
        t = torch.empty(1)
        held = _Alias(t, _torch.version_counter(t), _view(t))
        del t
        return _holders(held)


def _written(func: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument an op writes, from its schema; memoised per op."""
    hit = _WRITTEN.get(func)
    if hit is None:
        hit = _WRITTEN[func] = _torch.written_arguments(func)
    return hit


def _pick(written: tuple[tuple[int, str], ...], args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
    picked = [args[i] if i < len(args) else kwargs.get(name) for i, name in written]
    return _flatten(picked)


_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


class Recorder(_torch.DebugMode):
    """Records collectives, redistributes and DTensor ops of one simulated SPMD run into a Trace."""

    def __init__(
        self,
        trace: Trace,
        world_size: int,
        values: str | int,
        rank: int | None = None,
        on_collective: Callable[[str, str, tuple[tuple[int, ...], ...], Source | None], None] | None = None,
    ) -> None:
        """``rank=None`` records a simulation (every rank's buffers, from LocalTensors); a rank
        number records one real process's own buffers and group, for the client to merge.
        ``on_collective(stage, op, groups, source)`` is called with stage ``"enter"`` just before a
        collective runs and ``"leave"`` after: a real rank publishes it so that the client can
        tell where a rank blocked inside the collective is."""
        _torch.TorchDispatchMode.__init__(self)
        self.trace = trace
        self.world_size = world_size
        self.rank = rank
        self.on_collective = on_collective
        self.budget = ValueBudget(values)
        self._slots: list[Event | None] = []
        self._stack: list[int] = []  # open redistribute / op events (provisional ids)
        self._open: dict[int, dict[str, Any]] = {}
        self._has_children: set[int] = set()
        self._current_op: int | None = None
        self._in_dtensor_op = False
        self._meshes: dict[int, tuple[tuple[int, ...], tuple[str, ...] | None, tuple[int, ...]]] = {}
        self._group_desc: dict[int, str] = {}  # by id() of the event
        self.modules = _torch.ModuleStack()
        self._tracked: dict[int, weakref.ReferenceType[Any]] = {}
        # Snapshots that alias a live buffer, by the buffer's storage address: see _alias.
        self._aliases: dict[int, _Alias] = {}

    # --- DebugMode's interface, as DTensor calls it ------------------------------------------

    def __enter__(self) -> Recorder:
        self._calls = _torch.UserCallWatch(self._on_to_local, self._on_from_local, self._on_get_rank)
        self._calls.__enter__()
        _torch.TorchDispatchMode.__enter__(self)
        _torch.debug_mode_counter(+1)
        self.modules.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.modules.__exit__(*exc)
        finally:
            _torch.debug_mode_counter(-1)
            _torch.TorchDispatchMode.__exit__(self, *exc)
            self._calls.__exit__(*exc)
            self._tracked.clear()
            self._settle_aliases()

    # --- user calls a dispatch mode cannot see -------------------------------------------------

    def _on_to_local(self, dt: Any, out: Any, caller: FrameType) -> None:
        """A user's ``to_local()``: an op event, and its result is followed for local compute."""
        if _is_library(caller):
            return
        self._user_call("DTensor.to_local", dt, inputs=(_torch.placements_str(dt.placements),))
        self._track(out)

    def _on_from_local(self, out: Any, caller: FrameType) -> None:
        if _is_library(caller) or not _torch.is_dtensor(out):
            return
        self._user_call("DTensor.from_local", out, outputs=(_torch.placements_str(out.placements),))

    def _user_call(
        self,
        name: str,
        dt: Any,
        inputs: tuple[tuple[str, ...], ...] = (),
        outputs: tuple[tuple[str, ...], ...] = (),
    ) -> None:
        eid = self._reserve()
        source, module, phase, _ = self._context()
        self._note_mesh(dt.device_mesh)
        self._slots[eid] = OpEvent(
            id=eid,
            source=source,
            module=module,
            phase=phase,
            name=name,
            input_placements=inputs,
            output_placements=outputs,
        )

    def _on_get_rank(self, caller: FrameType) -> None:
        global _warned_get_rank
        if self.rank is not None or _warned_get_rank or _is_library(caller):
            return
        _warned_get_rank = True
        warnings.warn(GET_RANK_WARNING, SimulationWarning, stacklevel=3)

    def _track(self, t: Any) -> None:
        for x in _flatten(t):
            if isinstance(x, torch.Tensor):
                self._tracked[id(x)] = weakref.ref(x)

    def _is_tracked(self, x: Any) -> bool:
        ref = self._tracked.get(id(x))
        return ref is not None and ref() is x

    def _local_op(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """An op on the local shards a user took with ``to_local()``: recorded with per-rank values."""
        inputs = [a for a in _flatten(args) if isinstance(a, torch.Tensor)]
        if (
            not any(self._is_tracked(a) for a in inputs)
            or func in _METADATA_OPS
            or not _called_by_user(sys._getframe(1))
        ):
            return func(*args, **kwargs)
        eid = self._reserve()
        source, module, phase, _ = self._context()
        ranks = [self.rank] if self.rank is not None else _present_ranks(inputs, self.world_size)
        # An input the op writes is copied now: an alias would show it after the write.
        snaps_in = self._snap(inputs, ranks, eid, alias=not _written(func)) if inputs else {}
        out = func(*args, **kwargs)
        self._track(out)
        self._slots[eid] = LocalEvent(
            id=eid,
            source=source,
            module=module,
            phase=phase,
            name=_op_name(func),
            inputs=snaps_in,
            outputs=self._snap(out, ranks, eid),
        )
        return out

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Not wrapping __torch_dispatch__ in torch._disable_dynamo saves a frame-evaluation
        # switch on every op the simulation runs; compiled regions ignore this mode anyway
        # (ignore_compile_internals, inherited from DebugMode).
        return False

    # Attributes and hooks other parts of torch read from an active DebugMode (compiled regions,
    # higher-order ops): present, and doing nothing.
    run_compile_with_interpreter = False
    record_stack_trace = False
    call_depth = 0

    def _record_call(self, call: Any) -> None:
        pass

    def _record_call_output(self, call: Any, output: Any) -> None:
        pass

    def _handle_annotate(self, tag: Any) -> None:
        pass

    def record_output_placements(self, output_spec: Any) -> None:
        pass

    def record_triton_kernel(self, kernel_name: str, kwargs: dict[str, Any]) -> None:
        return None

    def record_redistribute_calls(
        self,
        arg: Any,
        src_placement: Any,
        dst_placement: Any,
        transform_info_str: str | None = None,
        is_explicit: bool = False,
    ) -> _RedistributeScope:
        return _RedistributeScope(
            self, sys._getframe(1), arg, src_placement, dst_placement, transform_info_str, is_explicit
        )

    # --- dispatch ----------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self._aliases:
            written = _written(func)
            if written:
                self._unalias(_pick(written, args, kwargs or {}))
        entry = _COLLECTIVES.get(func)
        if entry is None:
            if _torch.DTensor in types:
                if self._in_dtensor_op:
                    return NotImplemented
                return self._dtensor_op(func, args, kwargs or {})
            if self._tracked and not self._in_dtensor_op:
                return self._local_op(func, args, kwargs or {})
            return func(*args, **(kwargs or {}))
        return self._collective(entry, func, args, kwargs or {})

    def _reserve(self) -> int:
        self._slots.append(None)
        return len(self._slots) - 1

    def _parent(self, in_dispatch: bool) -> int | None:
        if self._stack:
            return self._stack[-1]
        if in_dispatch and self._current_op is not None:
            return self._current_op
        return None

    def _context(self, meshes: list[Any] | None = None) -> tuple[Source | None, str | None, str | None, bool]:
        frame, in_dispatch = _user_frame(sys._getframe(2), meshes)
        module = self.modules.current()
        backward = _torch.in_backward()
        phase = "backward" if backward else ("forward" if module is not None else None)
        return _source(frame), module, phase, in_dispatch

    def _dtensor_op(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        eid = self._reserve()
        source, module, phase, _ = self._context()
        flat = [a for a in _flatten((args, kwargs)) if _torch.is_dtensor(a)]
        for a in flat:
            self._note_mesh(a.device_mesh)
        inputs = tuple(_torch.placements_str(a.placements) for a in flat)
        self._current_op = eid
        self._in_dtensor_op = True
        _torch.TorchDispatchMode.__enter__(self)
        try:
            out = func(*args, **kwargs)
        finally:
            _torch.TorchDispatchMode.__exit__(self, None, None, None)
            self._in_dtensor_op = False
        outputs = tuple(_torch.placements_str(o.placements) for o in _flatten(out) if _torch.is_dtensor(o))
        self._slots[eid] = OpEvent(
            id=eid,
            parent=None,
            source=source,
            module=module,
            phase=phase,
            name=_op_name(func),
            input_placements=inputs,
            output_placements=outputs,
        )
        return out

    def _collective(
        self, entry: tuple[_Spec, str, list[str]], func: Any, args: Any, kwargs: dict[str, Any]
    ) -> Any:
        spec, impl, names = entry
        if self.rank is None and spec.op in ("send", "recv"):
            from .p2p import P2P_HELP, P2PError

            raise P2PError(
                f"{impl} cannot run in a plain simulation: every rank runs in one thread here.\n{P2P_HELP}"
            )
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        eid = self._reserve()
        # The mesh a collective runs on, from torch's frames (distribute_tensor's device_mesh, a
        # redistribute's mesh): several live meshes can have the same groups, and it names them.
        parent: int | None
        if self._stack:
            # Inside a redistribute, which has already found the user's line and noted the mesh.
            parent = self._stack[-1]
            base = self._open[parent]["base"]
            source, module, phase = base["source"], base["module"], base["phase"]
        else:
            meshes: list[Any] = []
            source, module, phase, in_dispatch = self._context(meshes)
            for m in meshes:
                self._note_mesh(m)
            parent = self._parent(in_dispatch)

        in_arg = bound.get(spec.inputs) if spec.inputs else None
        out_arg = bound.get(spec.outputs) if spec.outputs and spec.outputs != "return" else None
        in_flat = _tensors(in_arg)
        tensors = in_flat + _tensors(out_arg) if out_arg is not None else in_flat
        group = bound.get(spec.group)
        gkey = _torch.process_group_key(group) if group is not None else "WORLD"
        if self.rank is None:
            local = [t for t in tensors if _torch.is_local_tensor(t)]
            if tensors and not local and not _plain_is_fine(spec, bound):
                self._slots.pop()
                raise _plain_tensor_error(spec.op, impl)
            ranks = _present_ranks(local, self.world_size)
            if (
                spec.inputs
                and spec.inputs != spec.outputs
                and len(local) < len(tensors)
                and _has_plain(in_arg)
            ):
                # Read-only inputs made outside the simulation (a scatter list built from a plain
                # tensor, say) hold the same value on every rank: give the collective that.
                in_arg = bound[spec.inputs] = _lift(in_arg, ranks)
                args, kwargs = (), bound
            groups = self._groups(gkey, group, ranks)
        else:
            ranks = [self.rank]
            groups = (
                tuple(_torch.process_group_ranks(group) if group is not None else range(self.world_size)),
            )
        nbytes = _nbytes(in_flat, ranks)
        if self._aliases and out_arg is not None:
            self._unalias(_flatten(out_arg))  # a c10d collective writes its outputs in place
        in_place = spec.inputs == spec.outputs
        inputs = self._snap(in_arg, ranks, eid, alias=not in_place) if in_arg is not None else {}

        if self.on_collective is not None:
            self.on_collective("enter", spec.op, groups, source)
        per_group = _PER_GROUP.get(impl) if self.rank is None else None
        done = per_group(bound, groups) if per_group is not None else None
        if done is not None:
            out, group_values = done
        else:
            group_values = None
            emulate = _EMULATED.get(impl) if self.rank is None else None
            out = emulate(bound, groups) if emulate is not None else func(*args, **kwargs)
        if self.rank is not None:  # a real process: the result is only there once the work is done
            _torch.wait_collective(out, functional=spec.group == "group_name")
        if self.on_collective is not None:
            self.on_collective("leave", spec.op, groups, source)

        if spec.outputs == "return":
            out_arg = out
        if group_values is not None:
            outputs = self._snap_groups(group_values, out, groups, ranks, eid)
        else:
            shared = groups if spec.op in ("all_reduce", "all_gather", "broadcast") else ()
            outputs = self._snap(out_arg, ranks, eid, shared) if out_arg is not None else {}
        root = bound.get(spec.root) if spec.root else None
        desc = self._desc(gkey, group)
        if parent is not None:
            self._has_children.add(parent)
        event = self._slots[eid] = CollectiveEvent(
            id=eid,
            parent=parent,
            source=source,
            module=module,
            phase=phase,
            op=spec.op,
            impl=impl,
            reduce_op=_reduce_name(bound.get("reduce_op")) if spec.reduce else None,
            groups=groups,
            root=None if root is None else int(root),  # c10d and functional ops pass a group rank
            inputs=inputs,
            outputs=outputs,
            nbytes=nbytes,
            params=_params(bound, spec),
        )
        self._group_desc[id(event)] = desc
        return out

    # --- pieces ------------------------------------------------------------------------------

    def _snap(
        self,
        arg: Any,
        ranks: Sequence[int],
        eid: int,
        groups: tuple[tuple[int, ...], ...] = (),
        alias: bool = True,
    ) -> dict[int, Any]:
        """Per-rank snapshots of a tensor, a one-element list (unwrapped) or a list of tensors.

        With ``groups``, a rank whose buffer equals its group's first rank's shares that snapshot
        (after an all-reduce, all-gather or broadcast): one copy per group, not one per rank.
        """
        items = arg
        while isinstance(items, (list, tuple)) and len(items) == 1:
            items = items[0]
        listed = isinstance(items, (list, tuple))
        tensors = list(items) if listed else [items]
        per_tensor = [_per_rank(t, ranks) for t in tensors]
        if self.budget.left <= 0:  # metadata only: no tensor work, no need to leave the modes
            if self.budget.keeps_any and self.budget.exhausted_at is None:
                self.budget.exhausted_at = eid
            return {r: self._metadata(per_tensor, r, listed) for r in ranks}
        leader = {r: g[0] for g in groups for r in g}
        with _quiet(t for pt in per_tensor for t in pt.values()):
            return self._snap_values(per_tensor, ranks, eid, leader, listed, alias)

    def _snap_values(
        self,
        per_tensor: list[dict[int, torch.Tensor]],
        ranks: Sequence[int],
        eid: int,
        leader: dict[int, int],
        listed: bool,
        alias: bool,
    ) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for r in ranks:
            first = leader.get(r, r)
            if (
                first != r
                and first in out
                and _same_buffers([pt.get(r) for pt in per_tensor], [pt.get(first) for pt in per_tensor])
            ):
                out[r] = out[first]
                continue
            snaps = [self._snapshot(pt.get(r), eid, alias) for pt in per_tensor]
            out[r] = snaps if listed else snaps[0]
        return out

    def _snap_groups(
        self,
        group_values: dict[int, torch.Tensor],
        out: Any,
        groups: tuple[tuple[int, ...], ...],
        ranks: Sequence[int],
        eid: int,
    ) -> dict[int, Any]:
        """Snapshots of a collective's outputs that shardviz made itself, one per group: every
        member got a clone of its group's value, which nothing else holds, so the snapshot keeps
        that tensor's buffer as it is, with no compare and no copy."""
        per_rank = _per_rank(out, ranks)
        by_rank: dict[int, Any] = {}
        for g in groups:
            value = group_values.get(g[0])
            if value is None:
                continue
            snap = self._snapshot(value, eid, owned=True)
            for r in g:
                by_rank[r] = snap
        # A rank of an incomplete group gets no output, as in LocalTensorMode.
        return {r: by_rank[r] if r in by_rank else _meta_snapshot(per_rank.get(r)) for r in ranks}

    def _metadata(self, per_tensor: list[dict[int, torch.Tensor]], r: int, listed: bool) -> Any:
        snaps = [_meta_snapshot(pt.get(r)) for pt in per_tensor]
        return snaps if listed else snaps[0]

    def _snapshot(
        self, t: torch.Tensor | None, eid: int, alias: bool = False, owned: bool = False
    ) -> TensorSnapshot:
        """``alias``: the buffer may be aliased until it may change (see _alias); ``owned``: the
        buffer is the recorder's own, which nothing else holds or writes, so it is kept as it is."""
        if t is None:
            return TensorSnapshot((), "unknown")
        shape, dtype, nbytes = _describe(t.shape, t.dtype)
        if t.device.type == "meta":
            return TensorSnapshot(shape, dtype)
        if not self.budget.take(nbytes, eid):
            return TensorSnapshot(shape, dtype)
        if owned and _readable(t):
            return TensorSnapshot(shape, dtype, _view(t))
        # A small buffer costs less to copy than to keep track of.
        if alias and nbytes > _SMALL and _aliasable(t):
            return self._alias(t, shape, dtype)
        return TensorSnapshot(shape, dtype, _numpy(t))

    # --- snapshots that alias a buffer until it may change -------------------------------------
    #
    # Most buffers a collective reads or writes are intermediates that die inside the redistribute
    # that made them; copying each cost as much memory traffic as the collective itself. So a
    # snapshot first aliases the buffer. It is copied just before an op writes that buffer (every
    # write passes through this dispatch mode while recording), and when the recording ends if
    # anything but the snapshot still holds the buffer. A write that bypassed dispatch (numpy,
    # per-rank code) shows in the version counter: those values are dropped, never shown wrong.

    def _alias(self, t: torch.Tensor, shape: tuple[int, ...], dtype: str) -> TensorSnapshot:
        owner = t
        base = _torch.view_base(t)
        if base is not None:
            # A view of a whole buffer (a reshape): alias the tensor it views, which shares its
            # version counter, so that the buffer counts as free once the view is gone.
            if not (_aliasable(base) and base.dtype == t.dtype):
                return TensorSnapshot(shape, dtype, _numpy(t))
            owner = base
        key = owner.untyped_storage().data_ptr()
        held = self._aliases.get(key)
        if held is None:
            # The tensor itself, not a detached alias: inside dispatch (below autograd) detach()
            # would not share the version counter that tells of writes.
            held = self._aliases[key] = _Alias(owner, _torch.version_counter(owner), _view(owner))
        elif held.tensor is not owner or _torch.version_counter(held.tensor) != held.version:
            return TensorSnapshot(shape, dtype, _numpy(t))  # another tensor over the same buffer
        snap = TensorSnapshot(shape, dtype, _shaped(held.values, shape))
        held.snapshots.append(snap)
        return snap

    def _unalias(self, tensors: Sequence[Any]) -> None:
        """Copy the snapshots aliasing these tensors' buffers, which are about to be written."""
        for x in tensors:
            for t in _torch.plain_tensors(x):
                if type(t) not in _PLAIN or not t.numel():
                    continue  # only plain tensors are aliased (a FakeTensor has no data)
                held = self._aliases.pop(t.untyped_storage().data_ptr(), None)
                if held is not None:
                    held.settle(keep_alias=False)

    def _settle_aliases(self) -> None:
        if not self._aliases:
            return
        lost = 0
        with _torch.plain_ops():
            for held in self._aliases.values():
                lost += held.settle(keep_alias=_holders(held) == _alone())
        self._aliases.clear()
        if lost:
            warnings.warn(
                f"shardviz: the values of {lost} snapshot(s) were dropped: their buffer was changed "
                "in place where shardviz could not see it (through numpy, in a compiled region, or with "
                "dispatch modes disabled) before the recording ended. Their shapes and dtypes are kept.",
                SimulationWarning,
                stacklevel=3,
            )

    def _groups(self, key: str, group: Any, ranks: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        def tile() -> tuple[tuple[int, ...], ...]:
            try:
                first = (
                    _torch.process_group_ranks(group) if group is not None else list(range(self.world_size))
                )
            except Exception:
                first = list(range(self.world_size))
            return tuple(tuple(g) for g in _mesh.tile_groups(first, self.world_size))

        cached = _per_world(("groups", key, self.world_size), tile)
        if len(ranks) == self.world_size:
            return cached
        present = set(ranks)
        return tuple(g for g in cached if all(r in present for r in g))

    def _note_mesh(self, device_mesh: Any) -> None:
        key = id(device_mesh)
        if key not in self._meshes:
            info = _torch.mesh_info(device_mesh)
            self._meshes[key] = info
            _torch.remember_mesh(device_mesh)
            self.trace.meshes.append(
                {
                    "mesh_shape": list(info[0]),
                    "mesh_dim_names": list(info[1]) if info[1] else None,
                    "ranks": list(info[2]),
                }
            )

    def _desc(self, key: str, group: Any) -> str:
        def describe() -> str:
            try:
                return _torch.process_group_desc(group) if group is not None else ""
            except Exception:
                return ""

        return _per_world(("desc", key), describe)

    def finish(self) -> None:
        """Compact the event slots into the trace: ids in execution order, no-op backward hops dropped."""
        renumber: dict[int, int] = {}
        kept: list[Event] = []
        for slot in self._slots:
            if slot is None:
                continue
            if (
                isinstance(slot, RedistributeEvent)
                and slot.src == slot.dst
                and slot.id not in self._has_children
            ):
                continue
            renumber[slot.id] = len(kept)
            kept.append(slot)
        # Only childless redistributes are dropped, so every parent survives.
        # The events were made by this recorder and nothing else holds them yet: fill in their
        # final ids and mesh dims in place (dataclasses.replace would rebuild each one).
        own = tuple(self._meshes.values())
        generation = _torch.mesh_generation()
        dims: dict[tuple[int, str], tuple[int | None, str | None]] = {}  # the groups tuples are shared
        for e in kept:
            object.__setattr__(e, "id", renumber[e.id])
            if e.parent is not None:
                object.__setattr__(e, "parent", renumber[e.parent])
            if isinstance(e, CollectiveEvent):
                desc = self._group_desc.get(id(e), "")
                key = (id(e.groups), desc)
                hit = dims.get(key)
                if hit is None:
                    hit = dims[key] = _mesh_dim(e.groups, desc, own, generation)
                dim, name = hit
                object.__setattr__(e, "mesh_dim", dim)
                object.__setattr__(e, "mesh_dim_name", name)
        self.trace.events = kept
        dropped_at = self.budget.exhausted_at
        if dropped_at is not None:
            later = [renumber[i] for i in renumber if i >= dropped_at]
            self.trace.values_dropped_from = min(later) if later else None


@functools.lru_cache(maxsize=1024)
def _mesh_dim(
    groups: tuple[tuple[int, ...], ...],
    desc: str,
    own: tuple[_torch.MeshInfo, ...],
    generation: tuple[int, int],
) -> tuple[int | None, str | None]:
    """The mesh dim whose groups these are: meshes of this trace (``own``) first, then any seen
    before. ``generation`` changes when a mesh is built or freed, so the memo follows them.

    A DeviceMesh names its groups ``mesh_<dim name>``; that name breaks ties between meshes, and
    the newest mesh breaks the rest (a 1-D mesh of the whole world runs on the default group).
    """
    name = desc[len("mesh_") :] if desc.startswith("mesh_") and desc != "mesh_default" else None
    for shape, names, ranks in [*own, *reversed(_torch.known_mesh_infos())]:
        if len(ranks) != sum(len(g) for g in groups):
            continue
        d = _mesh.match_dim(groups, shape, ranks)
        if d is not None and (name is None or (names and names[d] == name) or name == f"dim_{d}"):
            return d, names[d] if names else None
    if name and not name.startswith("dim_"):
        return None, name
    return None, None


_warned_get_rank = False

# What dist.get_rank() gives in the simulation depends on the torch release (see _torch).
GET_RANK_WARNING = (
    (
        "dist.get_rank() is a per-rank value in the simulation: tensor arithmetic with it runs per "
        "rank (torch.ones(2) * dist.get_rank() holds each rank's own number), but Python cannot "
        "branch, index or convert on it: `if dist.get_rank() == 0:` is False on every rank unless all "
        "ranks agree, and x.chunk(n)[dist.get_rank()], int(...) and float(...) fail. Write "
        "rank-dependent Python with sv.per_rank(lambda rank: x.chunk(n)[rank])."
    )
    if _torch.GET_RANK_PER_RANK
    else (
        "dist.get_rank() is 0 on every simulated rank, so rank-dependent code (like "
        "x.chunk(n)[dist.get_rank()]) gives every rank rank 0's part. Write it with "
        "sv.per_rank(lambda rank: x.chunk(n)[rank])."
    )
) + " (shardviz warns about this once.)"
_PER_WORLD: dict[tuple[Any, ...], Any] = {}
_PER_WORLD_OWNER: list[Any] = [None]  # the world group _PER_WORLD belongs to (held: its id stays its own)


def _per_world(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """What a group name stands for (its rank tiling, its description), kept across recordings
    for as long as the world group lives. A new world (sv.use, sv.restart) can reuse the old
    names for other groups, so the cache starts afresh with it."""
    world = _torch.dist.group.WORLD
    if _PER_WORLD_OWNER[0] is not world:
        _PER_WORLD.clear()
        _PER_WORLD_OWNER[0] = world
    hit = _PER_WORLD.get(key)
    if hit is None:
        if len(_PER_WORLD) > 2048:
            _PER_WORLD.clear()
        hit = _PER_WORLD[key] = make()
    return hit


_METADATA_OPS = {
    getattr(packet, o)
    for packet in (torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_storage_offset)
    for o in packet.overloads()
}
# torch files a dispatched op passes through on its way from the caller to a dispatch mode.
_PLUMBING = tuple(
    os.path.join(_TORCH_DIR, *f.split("/"))
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


def _called_by_user(frame: FrameType | None) -> bool:
    """Whether the op being dispatched was called by user code rather than inside torch."""
    while frame is not None:
        fn = frame.f_code.co_filename
        if not (fn.startswith(_OWN_DIR) or fn.startswith(_PLUMBING)):
            return not fn.startswith(_TORCH_DIR)
        frame = frame.f_back
    return False


def _is_library(frame: FrameType) -> bool:
    fn = frame.f_code.co_filename
    return fn.startswith(_TORCH_DIR) or fn.startswith(_OWN_DIR)


class _RedistributeScope:
    """The context DTensor enters around a redistribute; nests the implicit path's double report."""

    def __init__(
        self,
        rec: Recorder,
        caller: FrameType,
        arg: Any,
        src: Any,
        dst: Any,
        plan: str | None,
        explicit: bool,
    ) -> None:
        self.rec = rec
        self.caller: FrameType | None = caller
        self.arg: Any = arg
        self.src = src
        self.dst = dst
        self.plan = plan
        self.explicit = explicit
        self.eid: int | None = None
        self.merged = False

    def __enter__(self) -> None:
        rec = self.rec
        top = rec._stack[-1] if rec._stack else None
        info = rec._open.get(top) if top is not None else None
        if info is not None and info.get("implicit_outer") and not info.get("inner_seen"):
            # The implicit path reports the same redistribute twice: fill in the outer one.
            info["inner_seen"] = True
            info["plan"] = self.plan or info.get("plan", "")
            self.merged = True
            return None
        eid = rec._reserve()
        source, module, phase, in_dispatch = rec._context()
        implicit_outer = isinstance(self.arg, int)
        parent = rec._parent(in_dispatch or implicit_outer)
        if parent is not None:
            rec._has_children.add(parent)
        assert self.caller is not None  # dropped only on leaving
        before, after, src, dst = _redistribute_layouts(self.caller, self.src, self.dst, rec)
        rec._open[eid] = {
            "implicit_outer": implicit_outer,
            "inner_seen": False,
            "plan": self.plan or "",
            "base": dict(
                id=eid,
                parent=parent,
                source=source,
                module=module,
                phase=phase,
                src=src,
                dst=dst,
                explicit=bool(self.explicit) and not implicit_outer,
                before=before,
                after=after,
            ),
        }
        rec._stack.append(eid)
        self.eid = eid
        return None

    def __exit__(self, *exc: object) -> None:
        # The caller's frame holds this scope while it runs and the redistribute's buffers in its
        # locals: keeping the frame would make a cycle that holds those buffers until the next
        # garbage collection instead of freeing them when the program drops them.
        self.caller = self.arg = None
        if self.merged or self.eid is None:
            return
        rec = self.rec
        rec._stack.pop()
        info = rec._open.pop(self.eid)
        rec._slots[self.eid] = RedistributeEvent(plan=info["plan"], **info["base"])


def _redistribute_layouts(
    caller: FrameType, src: Any, dst: Any, rec: Recorder
) -> tuple[Layout | None, Layout | None, tuple[str, ...], tuple[str, ...]]:
    """Layouts before and after, from the DTensor specs in DTensor's own frame or arguments."""
    src_spec = src if hasattr(src, "placements") else None
    dst_spec = dst if hasattr(dst, "placements") else None
    if src_spec is None or dst_spec is None:
        # DTensor passes placements; its frame holds the specs. f_locals builds a dict: read it once.
        frame_locals = caller.f_locals
        src_spec = frame_locals.get("current_spec") if src_spec is None else src_spec
        dst_spec = frame_locals.get("target_spec") if dst_spec is None else dst_spec
    if src_spec is not None:
        rec._note_mesh(src_spec.mesh)
    # A spec is immutable: the same DTensor redistributed again (a loop, a training step) gives
    # the same layouts.
    key = (
        id(src_spec),
        id(dst_spec.mesh) if dst_spec is not None else None,
        tuple(dst_spec.placements if dst_spec is not None else dst),
    )
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is src_spec and src_spec is not None:
        return hit[1]
    src_pl = _torch.placements_str(src_spec.placements if src_spec is not None else src)
    dst_pl = _torch.placements_str(dst_spec.placements if dst_spec is not None else dst)
    before = after = None
    try:
        if src_spec is not None and src_spec.tensor_meta is not None:
            shape, names, ranks = _torch.mesh_info(src_spec.mesh)
            gshape = tuple(int(s) for s in src_spec.tensor_meta.shape)
            dtype = _torch.dtype_name(src_spec.tensor_meta.dtype)
            before = compute_layout(gshape, shape, src_pl, names, dtype=dtype, mesh_ranks=ranks)
            after = compute_layout(gshape, shape, dst_pl, names, dtype=dtype, mesh_ranks=ranks)
    except Exception:
        before = after = None
    result = (before, after, src_pl, dst_pl)
    if src_spec is not None:
        if len(_LAYOUTS) > 256:
            _LAYOUTS.clear()
        _LAYOUTS[key] = (src_spec, result)  # holds the spec, so that its id is not reused
    return result


_LAYOUTS: dict[
    tuple[Any, ...], tuple[Any, tuple[Layout | None, Layout | None, tuple[str, ...], tuple[str, ...]]]
] = {}


def _emulate_gather(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d gather, which LocalTensorMode refuses as MPMD: the root's list receives each member's
    tensor. (In the simulator every rank passes the list: Python cannot branch on the rank.)"""
    outs = bound["output_tensors"][0] if bound["output_tensors"] else []
    inp = bound["input_tensors"][0]
    root = int(bound["root_rank"])
    src = _torch.local_tensors(inp)
    if outs and src is not None:
        with _torch.no_dispatch():
            for g in groups:
                for i, r in enumerate(g):
                    dst = _torch.local_tensors(outs[i])
                    if dst is not None and root < len(g):
                        dst[g[root]].copy_(src[r])
    return _torch.fake_work()


def _emulate_reduce(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d reduce (not in LocalTensorMode): the root's tensor becomes the group's reduction;
    the other ranks' tensors keep their values, as gloo leaves them."""
    t = bound["tensors"][0]
    local = _torch.local_tensors(t)
    root = int(bound["root_rank"])
    name = _reduce_name(bound.get("reduce_op")) or "sum"
    if local is not None:
        with _torch.no_dispatch():
            for g in groups:
                if root < len(g):
                    local[g[root]].copy_(_reduce_tensors(name, [local[r] for r in g]))
    return _torch.fake_work()


def _emulate_reduce_scatter(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d reduce_scatter of tensor lists (not in LocalTensorMode): member j receives the
    reduction of every member's j-th input tensor."""
    out = bound["output_tensors"][0]
    ins = bound["input_tensors"][0]
    name = _reduce_name(bound.get("reduce_op")) or "sum"
    dst = _torch.local_tensors(out)
    srcs = [_torch.local_tensors(t) for t in ins]
    if dst is not None and all(s is not None for s in srcs):
        with _torch.no_dispatch():
            for g in groups:
                for j, r in enumerate(g):
                    dst[r].copy_(_reduce_tensors(name, [srcs[j][q] for q in g]))  # type: ignore[index]
    return ([out], _torch.fake_work())


def _reduce_tensors(name: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    stack = torch.stack(tensors)
    if name in ("sum", "avg"):
        r = stack.sum(0)
        return r / len(tensors) if name == "avg" else r
    if name == "product":
        return stack.prod(0)
    if name == "max":
        return stack.amax(0)
    if name == "min":
        return stack.amin(0)
    raise NotImplementedError(f"shardviz cannot simulate reduce op {name!r} for this collective")


def _emulate_broadcast(bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]) -> Any:
    """c10d broadcast. LocalTensorMode takes the root for a global offset, so on a strided group
    (a dp group [0, 2] of a (2, 2) mesh) with a root other than 0 it copies the wrong rank; here
    each group copies its own root (``root_rank`` is an index within the group)."""
    tensors = bound["tensors"]
    local = _torch.local_tensors(tensors[0])
    root = int(bound["root_rank"])
    if local is None:  # a plain tensor: the same on every rank, nothing to move
        return (tensors, _torch.fake_work())
    with _torch.no_dispatch():
        for g in groups:
            if root < len(g):
                src = local[g[root]]
                for r in g:
                    if r != g[root]:
                        local[r].copy_(src)
    return (tensors, _torch.fake_work())


# DTensor's functional collectives whose members all end with one value per group, done here
# once per group, as LocalTensorMode does them (same ops, same order, so the same bits): each group's
# value is computed once and each member gets a clone. The value itself is kept for the snapshot,
# which then needs neither a copy nor a compare of the members' outputs; nothing else holds it.
# Each returns None where the case is not a simple one, and LocalTensorMode runs it.


def _plain_local(x: Any) -> dict[int, torch.Tensor] | None:
    local = _torch.local_tensors(x)
    if local is None or not all(type(t) in _PLAIN and not t.requires_grad for t in local.values()):
        return None
    return local


def _gather_per_group(
    bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]
) -> tuple[Any, dict[int, torch.Tensor]] | None:
    """all_gather_into_tensor (Shard -> Replicate): the group's shards concatenated along dim 0.
    A rank of an incomplete group gets no output, as in LocalTensorMode."""
    local = _plain_local(bound.get("input"))
    size = bound.get("group_size")
    complete = [g for g in groups if len(g) == size and all(r in local for r in g)] if local else []
    if not complete:
        return None
    return _clone_per_member(complete, lambda g: torch.cat([local[r] for r in g]))  # type: ignore[index]


def _reduce_per_group(
    bound: dict[str, Any], groups: tuple[tuple[int, ...], ...]
) -> tuple[Any, dict[int, torch.Tensor]] | None:
    """all_reduce (Partial -> Replicate): LocalTensorMode's reduction of the group's inputs, in the
    input's dtype, contiguous (the functional op clones its input and reduces into the clone)."""
    local = _plain_local(bound.get("input"))
    op = bound.get("reduce_op")
    if local is None or op not in _LOCAL_REDUCE_OPS:
        return None
    covered = sorted(r for g in groups for r in g)
    if covered != sorted(local) or not all(len(g) == len(groups[0]) for g in groups):
        return None
    first = next(iter(local.values()))
    if not all(t.shape == first.shape and t.dtype == first.dtype for t in local.values()):
        return None  # ranks of different shapes: LocalTensorMode broadcasts into each

    def reduced(g: tuple[int, ...]) -> torch.Tensor:
        value = torch.empty_like(local[g[0]], memory_format=torch.contiguous_format)
        return value.copy_(_torch.local_reduce(op, [local[r] for r in g]))

    return _clone_per_member(groups, reduced)


def _clone_per_member(
    groups: Sequence[tuple[int, ...]], value_of: Callable[[tuple[int, ...]], torch.Tensor]
) -> tuple[Any, dict[int, torch.Tensor]]:
    """Each group's value computed once, a clone for each member: the members' LocalTensor, and
    the values by the group's first rank (for the snapshot)."""
    out: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}
    with _torch.plain_ops():
        for g in groups:
            value = values[g[0]] = value_of(g)
            for r in g:
                out[r] = value.clone()
    return _torch.new_local_tensor(out), values


_LOCAL_REDUCE_OPS = {"sum", "avg", "product", "min", "max", "band", "bor", "bxor"}
_PER_GROUP = {
    "_c10d_functional.all_gather_into_tensor": _gather_per_group,
    "_c10d_functional.all_reduce": _reduce_per_group,
}


_EMULATED = {
    "c10d.broadcast_": _emulate_broadcast,
    "c10d.gather_": _emulate_gather,
    "c10d.reduce_": _emulate_reduce,
    "c10d.reduce_scatter_": _emulate_reduce_scatter,
}

_NOT_PARAMS = {"async_op", "timeout", "tag", "group_size", "root_tensor", "sparse_indices", "device_ids"}


def _params(bound: dict[str, Any], spec: _Spec) -> dict[str, Any]:
    """Scalar arguments of a collective that shape its data flow, as JSON values."""
    skip = _not_params(spec)
    out: dict[str, Any] = {}
    for k, v in bound.items():
        if k in skip:
            continue
        if isinstance(v, bool | int | float | str):
            out[k] = v
        elif isinstance(v, list | tuple) and all(isinstance(x, int) for x in v):
            out[k] = [int(x) for x in v]
    return out


@functools.cache
def _not_params(spec: _Spec) -> frozenset[str | None]:
    return frozenset({spec.inputs, spec.outputs, spec.group, spec.root, "reduce_op", *_NOT_PARAMS})


@functools.lru_cache(maxsize=4096)
def _describe(shape: torch.Size, dtype: torch.dtype) -> tuple[tuple[int, ...], str, int]:
    """(shape, dtype name, bytes) of a tensor: the same few recur in every recording."""
    dims = tuple(int(s) for s in shape)
    return dims, _torch.dtype_name(dtype), math.prod(dims) * dtype.itemsize


def _meta_snapshot(t: torch.Tensor | None) -> TensorSnapshot:
    if t is None:
        return _shared_snapshot((), "unknown")
    shape, dtype, _ = _describe(t.shape, t.dtype)
    return _shared_snapshot(shape, dtype)


@functools.lru_cache(maxsize=4096)
def _shared_snapshot(shape: tuple[int, ...], dtype: str) -> TensorSnapshot:
    """Metadata-only snapshots are immutable: one object per (shape, dtype) serves every rank."""
    return TensorSnapshot(shape, dtype)


def _has_plain(x: Any) -> bool:
    return any(isinstance(t, torch.Tensor) and not _torch.is_local_tensor(t) for t in _flatten(x))


def _lift(x: Any, ranks: Sequence[int]) -> Any:
    """Plain tensors in (nested lists of) inputs, as LocalTensors holding them on every rank."""
    if isinstance(x, list | tuple):
        return type(x)(_lift(v, ranks) for v in x)
    if isinstance(x, torch.Tensor) and not _torch.is_local_tensor(x):
        with _torch.no_dispatch():
            return _torch.new_local_tensor({r: x.detach().clone() for r in ranks})
    return x


def _same_buffers(a: list[Any], b: list[Any]) -> bool:
    return all(_same_bits(x, y) for x, y in zip(a, b, strict=True))


def _same_bits(x: Any, y: Any) -> bool:
    """Whether two tensors hold the same bytes: a snapshot of one stands for the other.

    Compared as integer words, so NaNs match themselves and -0.0 is told apart from 0.0, as a
    snapshot should; large CPU buffers in numpy, three times faster than ``torch.equal``.
    """
    if not (
        isinstance(x, torch.Tensor)
        and isinstance(y, torch.Tensor)
        and x.shape == y.shape
        and x.dtype == y.dtype
        and x.device.type == y.device.type != "meta"
    ):
        return False
    word = _WORDS.get(x.element_size())
    with _quiet((x, y)):
        if word is None or x.is_conj() or y.is_conj() or x.is_neg() or y.is_neg():
            return bool(torch.equal(x, y))
        if x.numel() * x.element_size() >= _NUMPY_COMPARE and _readable(x) and _readable(y):
            return bool(np.array_equal(x.numpy().view(word), y.numpy().view(word)))
        tw = _TORCH_WORDS[word]  # small (torch's fixed cost is lower), on a GPU, or not numpy's
        return bool(torch.equal(x.detach().view(tw), y.detach().view(tw)))


_WORDS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
_NUMPY_COMPARE = 32 * 1024
_TORCH_WORDS = {np.uint8: torch.uint8, np.int16: torch.int16, np.int32: torch.int32, np.int64: torch.int64}


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in a collective's argument: one tensor, or (nested) lists of them."""
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in _flatten(x) if isinstance(t, torch.Tensor)]


def _flatten(x: Any) -> list[Any]:
    out: list[Any] = []
    stack = [x]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        else:
            out.append(item)
    return out


def _per_rank(t: Any, ranks: Sequence[int]) -> dict[int, torch.Tensor]:
    if not isinstance(t, torch.Tensor):
        return {}
    local = _torch.local_tensors(t)
    if local is not None:
        return local
    return {r: t for r in ranks}


def _present_ranks(tensors: Sequence[torch.Tensor], world_size: int) -> list[int]:
    for t in tensors:
        local = _torch.local_tensors(t)
        if local is not None:
            return sorted(local)
    return list(range(world_size))


def _nbytes(tensors: Sequence[torch.Tensor], ranks: Sequence[int]) -> dict[int, int]:
    out = dict.fromkeys(ranks, 0)
    for t in tensors:
        for r, lt in _per_rank(t, ranks).items():
            out[r] = out.get(r, 0) + _describe(lt.shape, lt.dtype)[2]
    return out


def _reduce_name(op: Any) -> str | None:
    if op is None:
        return None
    if isinstance(op, str):
        return op.lower()
    name = _torch.reduce_op_name(op)
    return _REDUCE_NAMES.get(name, name.lower())


def _op_name(func: Any) -> str:
    name = str(func)
    return name.removesuffix(".default")


def _plain_is_fine(spec: _Spec, bound: dict[str, Any]) -> bool:
    """Collectives whose result on identical plain tensors is the input itself: the fake group's
    no-op is then right (DTensor's Replicate path broadcasts a plain tensor, for instance)."""
    if spec.op in ("broadcast", "barrier"):
        return True
    if spec.op == "all_reduce":
        return _reduce_name(bound.get("reduce_op")) in ("max", "min", "avg", "band", "bor")
    return False


def _plain_tensor_error(op: str, impl: str) -> PlainTensorCollectiveError:
    frames = []
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        frames.append((f.f_code.co_name, f.f_code.co_filename, f.f_locals.get("self")))
        f = f.f_back
    strided = any(
        name == "_shard_tensor" and type(obj).__name__ == "_StridedShard" for name, _, obj in frames
    )
    msg = (
        f"{op} ({impl}) got only plain tensors under the simulation. LocalTensorMode hands such a "
        "collective to the fake process group, which does nothing, so its result would silently be "
        "wrong. Make the tensors inside sv.record() / %%spmd (tensors made there hold one value per "
        "rank), or give each rank its own: sv.per_rank(lambda rank: tensor.clone())."
    )
    if strided:
        msg = (
            "distribute_tensor with a _StridedShard placement scatters a replicated plain tensor "
            "under the simulation; LocalTensorMode (torch 2.13 to 2.15) then skips the scatter and "
            "every rank would get the wrong chunk. Pass src_data_rank=None to distribute_tensor (each "
            "rank slices the global tensor itself). Details: " + msg
        )
    return PlainTensorCollectiveError(msg)


def split_per_rank(value: Any, ranks: Sequence[int]) -> dict[int, Any]:
    """A value returned by SPMD code, as each rank would see it."""
    return {r: _at_rank(value, r) for r in ranks}


def _at_rank(value: Any, rank: int) -> Any:
    if _torch.is_dtensor(value):
        value = _torch.local_of(value)
    if isinstance(value, torch.Tensor):
        local = _torch.local_tensors(value)
        t = local[rank] if local is not None else value
        with _torch.no_dispatch():
            return t.detach().clone()
    if isinstance(value, torch.SymInt):
        return _torch.symint_at_rank(value, rank)
    if isinstance(value, tuple):
        return tuple(_at_rank(v, rank) for v in value)
    if isinstance(value, list):
        return [_at_rank(v, rank) for v in value]
    if isinstance(value, dict):
        return {k: _at_rank(v, rank) for k, v in value.items()}
    return value
