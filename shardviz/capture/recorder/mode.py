"""The Recorder: a dispatch mode on top of LocalTensorMode that turns collectives into events.

It sees every aten op the simulation runs, so the common path (a local, non-collective op)
is one dict lookup and one tuple membership test before handing the op on. Collectives are
snapshotted per rank before and after; DTensor operators and redistributes become enclosing
events. It derives from DebugMode only so that DTensor reports redistributes to it (source and
target placements, the plan string); none of DebugMode's own logging runs.
"""

from __future__ import annotations

import dataclasses
import sys
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from ...data.events import CollectiveEvent, Event, LocalEvent, OpEvent, RedistributeEvent, Source
from ...data.trace import Trace
from ...errors import P2P_HELP, P2PError, PerRankValueError, ShardvizError
from ...geometry import mesh as _mesh
from .. import adapters
from .. import torch as _torch
from ..meetings import CollectiveMismatchError
from . import c10d, caches, frames
from . import redistribute as _redistribute
from .snapshot import Snapshots, ValueBudget, flatten, nbytes, present_ranks, same_bits, tensors, written
from .specs import COLLECTIVES, METADATA_OPS, Spec, op_name, params, reduce_name


def _has_per_rank_int(args: Any, kwargs: Any) -> bool:
    """Whether an op's arguments (or a list among them: a size) hold a per-rank SymInt. Runs for
    every op on plain tensors only, so it looks no deeper than that."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if type(a) is torch.SymInt:
            if _torch.per_rank_ints(a) is not None:
                return True
        elif type(a) in (list, tuple) and any(
            type(b) is torch.SymInt and _torch.per_rank_ints(b) is not None for b in a
        ):
            return True
    return False


_AOT_NOTE = (
    'torch.compile ran graphs compiled with backend="aot_eager" at {where}: that backend compiles '
    "the simulated ranks' tensors into the graph, so their collectives ran as plain per-rank "
    "arithmetic (the results are right) and are not in this trace. To see them, compile with "
    'backend="eager" (DTensor then runs its ops as they come), run that code uncompiled, or use '
    "sv.use('threads', ...)."
)


class SharedLocalWriteError(ShardvizError, RuntimeError):
    """Per-rank values that differ written in place into a tensor every simulated rank shares."""


def shared_write(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """Run an op that writes per-rank values (LocalTensors) into plain tensors, as real ranks would.

    A plain tensor made outside the simulation (a module's parameter or buffer that no parallel
    style touched, the ``to_local()`` of a DTensor made from one) is one storage that every
    simulated rank shares; LocalTensorMode runs such a write once per rank on it, so an optimizer
    step on a plain parameter was applied world-size times. When every rank writes the same
    values, the write runs once, which is what each real rank does to its own copy. When the
    ranks' values differ, no single tensor can hold what each rank would: an explained error.
    Returns ``NOT_SHARED`` when the op is not such a write.
    """
    written_args = written(func)
    if not written_args:
        return NOT_SHARED
    targets = [
        t
        for i, name in written_args
        for t in flatten(args[i] if i < len(args) else kwargs.get(name))
        if isinstance(t, torch.Tensor)
    ]
    if not targets or any(_torch.is_local_tensor(t) for t in targets):
        return NOT_SHARED
    per_rank = [a for a in flatten((args, kwargs)) if _torch.is_local_tensor(a)]
    if not per_rank:
        return NOT_SHARED  # the same values for every rank: one storage holds them, one write is right
    firsts: dict[int, torch.Tensor] = {}
    with _torch.no_dispatch():
        for lt in per_rank:
            values = list((_torch.local_tensors(lt) or {}).values())
            if any(not same_bits(values[0], v) for v in values[1:]):
                raise SharedLocalWriteError(
                    f"{op_name(func)} writes per-rank values that differ between ranks in place into a "
                    "tensor that every simulated rank shares: a tensor made outside the simulation (a plain "
                    "module parameter or buffer, or the to_local() of a DTensor made from one), which no "
                    "single tensor can hold per rank; on real ranks each rank has its own copy. Make it per "
                    "rank: distribute the parameter (a DTensor), write through the DTensor (an in-place "
                    "DTensor op gives each simulated rank its own copy first), or build the tensor inside "
                    "sv.record() or with sv.per_rank(...)."
                )
            firsts[id(lt)] = values[0]
        return func(*_first_rank(args, firsts), **_first_rank(kwargs, firsts))


NOT_SHARED = object()


def _first_rank(x: Any, firsts: dict[int, torch.Tensor]) -> Any:
    """``x`` with each LocalTensor replaced by its first rank's tensor (all ranks hold the same)."""
    if isinstance(x, torch.Tensor):
        return firsts.get(id(x), x)
    if isinstance(x, list | tuple):
        return type(x)(_first_rank(v, firsts) for v in x)
    if isinstance(x, dict):
        return {k: _first_rank(v, firsts) for k, v in x.items()}
    return x


class Recorder(_torch.DebugMode):
    """Records collectives, redistributes and DTensor ops of one simulated SPMD run into a Trace."""

    def __init__(
        self,
        trace: Trace,
        world_size: int,
        values: str | int | ValueBudget,
        rank: int | None = None,
        on_collective: Callable[[str, str, tuple[tuple[int, ...], ...], Source | None], None] | None = None,
        alias_buffers: bool = True,
        passive: bool = False,
    ) -> None:
        """``rank=None`` records a simulation (every rank's buffers, from LocalTensors); a rank
        number records one real process's own buffers and group, for the client to merge.
        ``values`` is the value policy, or a budget shared with other recorders of one trace.
        ``on_collective(stage, op, groups, source)`` is called with stage ``"enter"`` just before a
        collective runs and ``"leave"`` after: a real rank publishes it so that the client can
        tell where a rank blocked inside the collective is. ``alias_buffers=False`` copies every
        snapshot at once (see ``Snapshots``). ``passive`` only watches: every op runs as
        LocalTensorMode alone would run it (no collective done or refused here), for recording
        code that must behave exactly as without shardviz (``pytest --shardviz-traces``)."""
        _torch.TorchDispatchMode.__init__(self)
        self.trace = trace
        self.world_size = world_size
        self.rank = rank
        self.on_collective = on_collective
        self.passive = passive
        self.snaps = Snapshots(
            values if isinstance(values, ValueBudget) else ValueBudget(values), alias=alias_buffers
        )
        self._slots: list[Event | None] = []
        self.ended = 0  # events completed so far: what ``partial`` shows changes with it
        self._stack: list[_redistribute.OpenRedistribute] = []  # redistributes entered, not left
        self._has_children: set[int] = set()
        self._current_op: int | None = None
        self._in_dtensor_op = False
        self._meshes: dict[int, tuple[tuple[int, ...], tuple[str, ...] | None, tuple[int, ...]]] = {}
        self._group_desc: dict[int, str] = {}  # by id() of the event
        self.modules = _torch.ModuleStack()
        self._tracked: dict[int, weakref.ReferenceType[Any]] = {}
        self._aot_lines: list[str] = []  # where graphs of backend="aot_eager" ran unseen
        self._aot_note = ""
        self._kept_count = 0  # kept_so_far's progress through the slots
        self._kept_scan = 0

    @property
    def budget(self) -> ValueBudget:
        return self.snaps.budget

    # --- DebugMode's interface, as DTensor calls it ------------------------------------------

    def __enter__(self) -> Recorder:
        self._calls = _torch.UserCallWatch(self._on_to_local, self._on_from_local)
        self._calls.__enter__()
        _torch.TorchDispatchMode.__enter__(self)
        _torch.debug_mode_counter(+1)
        self.modules.__enter__()
        adapters.recording_started(self, self.rank, self.world_size)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            adapters.recording_ended(self)
            self.modules.__exit__(*exc)
        finally:
            _torch.debug_mode_counter(-1)
            _torch.TorchDispatchMode.__exit__(self, *exc)
            self._calls.__exit__(*exc)
            self._tracked.clear()
            self.snaps.settle()

    # --- user calls a dispatch mode cannot see -------------------------------------------------

    def _on_to_local(self, dt: Any, out: Any, caller: FrameType) -> None:
        """A user's ``to_local()``: an op event, and its result is followed for local compute."""
        if frames.is_library(caller):
            return
        name = f"{type(dt).__name__}.to_local"  # DTensor, or a framework's own (ShardTensor)
        self._user_call(name, dt, inputs=(_torch.placements_str(dt.placements),))
        self._track(out)

    def _on_from_local(self, out: Any, caller: FrameType) -> None:
        if frames.is_library(caller) or not (_torch.is_dtensor(out) or adapters.for_object(out)):
            return
        name = f"{type(out).__name__}.from_local"
        self._user_call(name, out, outputs=(_torch.placements_str(out.placements),))

    def note_to_local(self, t: Any, out: Any, caller: FrameType) -> None:
        """A framework adapter saw ``t.to_local()`` (a tensor type with its own spec) called."""
        self._on_to_local(t, out, caller)

    def note_from_local(self, out: Any, caller: FrameType) -> None:
        """A framework adapter saw its ``from_local`` make ``out``."""
        self._on_from_local(out, caller)

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
        self._end(
            OpEvent(
                id=eid,
                source=source,
                module=module,
                phase=phase,
                name=name,
                input_placements=inputs,
                output_placements=outputs,
            )
        )

    def _track(self, t: Any) -> None:
        for x in flatten(t):
            if isinstance(x, torch.Tensor):
                self._tracked[id(x)] = weakref.ref(x)

    def _is_tracked(self, x: Any) -> bool:
        ref = self._tracked.get(id(x))
        return ref is not None and ref() is x

    def _local_op(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """An op on the local shards a user took with ``to_local()``: recorded with per-rank values."""
        inputs = [a for a in flatten(args) if isinstance(a, torch.Tensor)]
        if (
            not any(self._is_tracked(a) for a in inputs)
            or func in METADATA_OPS
            or not frames.called_by_user(sys._getframe(1))
        ):
            return self._plain(func, args, kwargs)
        eid = self._reserve()
        source, module, phase, _ = self._context()
        ranks = [self.rank] if self.rank is not None else present_ranks(inputs, self.world_size)
        # An input the op writes is copied now: an alias would show it after the write.
        snaps_in = self.snaps.take(inputs, ranks, eid, alias=not written(func)) if inputs else {}
        out = self._plain(func, args, kwargs)
        self._track(out)
        self._end(
            LocalEvent(
                id=eid,
                source=source,
                module=module,
                phase=phase,
                name=op_name(func),
                inputs=snaps_in,
                outputs=self.snaps.take(out, ranks, eid),
            )
        )
        return out

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Not wrapping __torch_dispatch__ in torch._disable_dynamo saves a frame-evaluation
        # switch on every op the simulation runs; compiled regions ignore this mode anyway
        # (ignore_compile_internals, inherited from DebugMode).
        return False

    @property
    def run_compile_with_interpreter(self) -> bool:
        """torch.compile's aot_eager backend asks the active DebugMode this each time a compiled
        graph runs. In the simulator that graph is blind to the recorder: AOTAutograd traced
        through the LocalTensors too, so each collective became plain arithmetic on every rank's
        tensor (the same numbers, no collective dispatched). The trace says so instead of
        silently lacking them."""
        if self.rank is None:
            src = frames.user_source(sys._getframe(1))
            where = f"line {src.line} ({src.text})" if src is not None else "a compiled region"
            if where not in self._aot_lines:
                note = _AOT_NOTE.format(where=", ".join([*self._aot_lines, where]))
                if self._aot_lines:
                    self.trace.notes[self.trace.notes.index(self._aot_note)] = note
                else:
                    self.trace.notes.append(note)
                self._aot_lines.append(where)
                self._aot_note = note
        return False

    # Attributes and hooks other parts of torch read from an active DebugMode (compiled regions,
    # higher-order ops): present, and doing nothing.
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
    ) -> _redistribute.RedistributeScope:
        return _redistribute.RedistributeScope(
            self, sys._getframe(1), arg, src_placement, dst_placement, transform_info_str, is_explicit
        )

    # --- redistributes, as their scope reports them -----------------------------------------------

    def open_redistribute(
        self, caller: FrameType, src: Any, dst: Any, plan: str, explicit: bool, implicit_outer: bool
    ) -> _redistribute.OpenRedistribute | None:
        """A redistribute begins; None when it is the implicit path's inner report of one already open."""
        top = self._stack[-1] if self._stack else None
        if top is not None and top.implicit_outer and not top.inner_seen:
            top.inner_seen = True
            top.plan = plan or top.plan
            return None
        eid = self._reserve()
        source, module, phase, in_dispatch = self._context()
        parent = self._parent(in_dispatch or implicit_outer)
        if parent is not None:
            self._has_children.add(parent)
        before, after, src_pl, dst_pl = _redistribute.layouts(caller, src, dst, self._note_mesh)
        return self._open(
            eid, parent, source, module, phase, before, after, src_pl, dst_pl, plan, explicit, implicit_outer
        )

    def open_layout_redistribute(
        self, mesh: Any, before: Any, src: tuple[str, ...], dst: tuple[str, ...], plan: str, explicit: bool
    ) -> _redistribute.OpenRedistribute:
        """A redistribute a framework adapter reports (its own, not DTensor's), with the layout
        before it; the adapter sets ``after`` once it is known, then closes it."""
        eid = self._reserve()
        source, module, phase, in_dispatch = self._context()
        parent = self._parent(in_dispatch)
        if parent is not None:
            self._has_children.add(parent)
        self._note_mesh(mesh)
        return self._open(eid, parent, source, module, phase, before, None, src, dst, plan, explicit, False)

    def _open(
        self,
        eid: int,
        parent: int | None,
        source: Source | None,
        module: str | None,
        phase: str | None,
        before: Any,
        after: Any,
        src_pl: tuple[str, ...],
        dst_pl: tuple[str, ...],
        plan: str,
        explicit: bool,
        implicit_outer: bool,
    ) -> _redistribute.OpenRedistribute:
        opened = _redistribute.OpenRedistribute(
            id=eid,
            parent=parent,
            source=source,
            module=module,
            phase=phase,
            src=src_pl,
            dst=dst_pl,
            explicit=explicit and not implicit_outer,
            before=before,
            after=after,
            plan=plan,
            implicit_outer=implicit_outer,
        )
        self._stack.append(opened)
        return opened

    def close_redistribute(self, opened: _redistribute.OpenRedistribute) -> None:
        popped = self._stack.pop()
        assert popped is opened, "redistributes close in the order they opened"
        self._end(opened.event())

    # --- dispatch ----------------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        snaps = self.snaps
        if snaps.aliases:
            snaps.before_op(func, args, kwargs or {})
        entry = COLLECTIVES.get(func)
        if entry is None:
            if _torch.DTensor in types:
                if self._in_dtensor_op:
                    return NotImplemented
                return self._dtensor_op(func, args, kwargs or {})
            if not types and self.rank is None and not self.passive and _has_per_rank_int(args, kwargs):
                return self._per_rank_scalar(func, args, kwargs or {})
            if (
                kwargs
                and kwargs.get("generator") is not None
                and self.rank is None
                and not self._in_dtensor_op
            ):
                return _torch.one_draw_per_rank(func, args, kwargs)
            if self._tracked and not self._in_dtensor_op:
                return self._local_op(func, args, kwargs or {})
            return self._plain(func, args, kwargs or {})
        return self._collective(entry, func, args, kwargs or {})

    def _plain(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A local op: on to LocalTensorMode, unless it writes per-rank values into a plain tensor
        all simulated ranks share (``shared_write``)."""
        if self.rank is None and written(func):
            out = shared_write(func, args, kwargs)
            if out is not NOT_SHARED:
                return out
        return func(*args, **kwargs)

    def _per_rank_scalar(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Plain tensors met a per-rank int (``tokens - dist.get_rank(group) * n``). LocalTensorMode
        hands an op without LocalTensors to the kernel, which takes one int: a placeholder
        (``tokens - r`` gives ``tokens - 7777777`` on every rank) or an AttributeError. Every rank
        holds the plain tensor, so the op runs on LocalTensors holding it on every rank. An op that
        writes a plain input cannot: it would write copies, not the caller's tensor."""
        if _torch.written_arguments(func):
            raise PerRankValueError(
                f"{op_name(func)} writes a plain tensor in place with a per-rank value (a rank, a mesh "
                "coordinate): a plain tensor made outside the simulation holds one value for every "
                "rank, so it cannot take each rank's own. Make it inside sv.record() / %%spmd, or "
                "per rank with sv.per_rank(lambda rank: t.clone()), or write it out of place "
                "(t = t + offset)."
            )
        ranks = range(self.world_size)
        return func(*c10d.lift(args, ranks), **{k: c10d.lift(v, ranks) for k, v in kwargs.items()})

    def _reserve(self) -> int:
        self._slots.append(None)
        return len(self._slots) - 1

    def _end(self, event: Event) -> None:
        """An event begun with ``_reserve`` is complete."""
        self._slots[event.id] = event
        self.ended += 1

    def _parent(self, in_dispatch: bool) -> int | None:
        if self._stack:
            return self._stack[-1].id
        if in_dispatch and self._current_op is not None:
            return self._current_op
        return None

    def _context(
        self, meshes: list[Any] | None = None, on_behalf: list[bool] | None = None
    ) -> tuple[Source | None, str | None, str | None, bool]:
        found = frames.Found(look_for_call=self.modules.compiled)
        frame, in_dispatch = frames.user_frame(sys._getframe(2), meshes, found)
        if on_behalf is not None and found.on_behalf:
            on_behalf.append(True)
        module = self.modules.current(found.fsdp, found.called)
        # FSDP2's backward methods are the backward wherever they run: a pipeline schedule calls
        # post_backward (the gradients' reduce-scatter) itself, outside the autograd engine.
        backward = found.fsdp_backward or _torch.in_backward()
        phase = "backward" if backward else ("forward" if module is not None else None)
        return frames.source(frame), module, phase, in_dispatch

    def _dtensor_op(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        eid = self._reserve()
        source, module, phase, _ = self._context()
        flat = _dtensors(*args, *kwargs.values())
        for a in flat:
            self._note_mesh(a.device_mesh)
        if self.rank is None and written(func):
            self._own_copies(func, args, kwargs)
        inputs = tuple(_torch.placements_str(a.placements) for a in flat)
        self._current_op = eid
        self._in_dtensor_op = True
        # Back on top of the mode stack (torch took this mode off for this call), so that the
        # collectives and local ops of DTensor's dispatch reach it.
        _torch.reenter(self)
        try:
            out = func(*args, **kwargs)
        finally:
            _torch.leave_reentered()
            self._in_dtensor_op = False
        outputs = tuple(_torch.placements_str(o.placements) for o in _dtensors(out))
        self._end(
            OpEvent(
                id=eid,
                parent=None,
                source=source,
                module=module,
                phase=phase,
                name=op_name(func),
                input_placements=inputs,
                output_placements=outputs,
            )
        )
        return out

    def _own_copies(self, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        """A DTensor the op writes whose local tensor every simulated rank shares (a plain tensor
        it was made from) gets one copy per rank first, as on real ranks (``_torch.own_copies``)."""
        for i, name in written(func):
            target = args[i] if i < len(args) else kwargs.get(name)
            for t in flatten(target):
                if _torch.is_dtensor(t):
                    _torch.own_copies(t, range(self.world_size))

    def _collective(
        self, entry: tuple[Spec, str, list[str]], func: Any, args: Any, kwargs: dict[str, Any]
    ) -> Any:
        spec, impl, names = entry
        if self.passive and spec.op in ("send", "recv"):
            return func(*args, **kwargs)
        if self.rank is None and spec.op in ("send", "recv"):
            raise P2PError(
                f"{impl} cannot run in a plain simulation: every rank runs in one thread here.\n{P2P_HELP}"
            )
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        eid = self._reserve()
        # The mesh a collective runs on, from torch's frames (distribute_tensor's device_mesh, a
        # redistribute's mesh): several live meshes can have the same groups, and it names them.
        parent: int | None
        meshes: list[Any] = []
        on_behalf: list[bool] = []
        if self._stack:
            # Inside a redistribute, which has already found the user's line and noted the mesh.
            top = self._stack[-1]
            parent, source, module, phase = top.id, top.source, top.module, top.phase
        else:
            source, module, phase, in_dispatch = self._context(meshes, on_behalf)
            for m in meshes:
                self._note_mesh(m)
            parent = self._parent(in_dispatch)
        # A dist.* call straight from user code on the default group: no mesh dim, even where a
        # 1-D mesh of the whole world (which reuses the default group) exists.
        raw = not self._stack and parent is None and not meshes and not on_behalf

        in_arg = bound.get(spec.inputs) if spec.inputs else None
        out_arg = bound.get(spec.outputs) if spec.outputs and spec.outputs != "return" else None
        in_flat = tensors(in_arg)
        ts = in_flat + tensors(out_arg) if out_arg is not None else in_flat
        group = bound.get(spec.group)
        gkey = _torch.process_group_key(group) if group is not None else "WORLD"
        if self.rank is None:
            local = [t for t in ts if _torch.is_local_tensor(t)]
            if ts and not local and not self.passive and not c10d.plain_is_fine(spec, bound):
                self._slots.pop()
                raise c10d.plain_tensor_error(spec.op, impl)
            ranks = present_ranks(local, self.world_size)
            if (
                not self.passive
                and spec.inputs
                and (spec.inputs != spec.outputs or not local)
                and len(local) < len(ts)
                and c10d.has_plain(in_arg)
            ):
                # Read-only inputs made outside the simulation (a scatter list built from a plain
                # tensor, say) hold the same value on every rank: give the collective that. An
                # in-place one on plain tensors alone (a max of identical values: plain_is_fine)
                # runs on such copies too: its result is its input, and the fake process group,
                # which refuses collectives, is never reached.
                in_arg = bound[spec.inputs] = c10d.lift(in_arg, ranks)
                args, kwargs = (), bound
            groups = self._groups(gkey, group, ranks)
            mismatch = c10d.mismatched_shapes(spec, impl, in_flat, groups) if not self.passive else None
            if mismatch is not None:
                self._slots.pop()
                at = f", at line {source.line}: {source.text}" if source is not None and source.text else ""
                raise CollectiveMismatchError(
                    f"mismatched collective: {mismatch}{at}. On real process groups "
                    "this would fail, hang or mix up data. Every rank of a group must pass the same "
                    "shapes and dtypes to this collective (sv.per_rank(fn) returning a different shape "
                    "on some rank is a usual cause)."
                )
        else:
            ranks = [self.rank]
            groups = (
                tuple(_torch.process_group_ranks(group) if group is not None else range(self.world_size)),
            )
        sizes = nbytes(in_flat, ranks)
        if self.snaps.aliases and out_arg is not None:
            self.snaps.unalias(flatten(out_arg))  # a c10d collective writes its outputs in place
        in_place = spec.inputs == spec.outputs
        inputs = self.snaps.take(in_arg, ranks, eid, alias=not in_place) if in_arg is not None else {}

        if self.on_collective is not None:
            self.on_collective("enter", spec.op, groups, source)
        simulating = self.rank is None and not self.passive  # done or emulated here
        per_group = c10d.PER_GROUP.get(impl) if simulating else None
        done = per_group(bound, groups) if per_group is not None else None
        if done is not None:
            out, group_values = done
        else:
            group_values = None
            emulate = c10d.emulator(impl, bound) if simulating else None
            out = emulate(bound, groups) if emulate is not None else func(*args, **kwargs)
        if self.rank is not None:  # a real process: the result is only there once the work is done
            _torch.wait_collective(out, functional=spec.group == "group_name")
        if self.on_collective is not None:
            self.on_collective("leave", spec.op, groups, source)

        if spec.outputs == "return":
            out_arg = out
        if group_values is not None:
            outputs = self.snaps.take_groups(group_values, out, groups, ranks, eid)
        else:
            shared = groups if spec.op in ("all_reduce", "all_gather", "broadcast") else ()
            outputs = self.snaps.take(out_arg, ranks, eid, shared) if out_arg is not None else {}
        root = bound.get(spec.root) if spec.root else None
        desc = self._desc(gkey, group)
        if parent is not None:
            self._has_children.add(parent)
        event = CollectiveEvent(
            id=eid,
            parent=parent,
            source=source,
            module=module,
            phase=phase,
            op=spec.op,
            impl=impl,
            reduce_op=reduce_name(bound.get("reduce_op")) if spec.reduce else None,
            groups=groups,
            root=None if root is None else int(root),  # c10d and functional ops pass a group rank
            inputs=inputs,
            outputs=outputs,
            nbytes=sizes,
            params=params(bound, spec),
        )
        self._group_desc[id(event)] = desc
        if raw and _torch.is_default_group(group):
            # on the default group straight from user code: no mesh dim (merges keep it so too)
            event.params[_mesh.DEFAULT_GROUP] = True
        self._end(event)
        return out

    # --- groups and meshes -------------------------------------------------------------------

    def _groups(self, key: str, group: Any, ranks: Any) -> tuple[tuple[int, ...], ...]:
        def tile() -> tuple[tuple[int, ...], ...]:
            try:
                first = (
                    _torch.process_group_ranks(group) if group is not None else list(range(self.world_size))
                )
            except Exception:
                first = list(range(self.world_size))
            return tuple(tuple(g) for g in _mesh.tile_groups(first, self.world_size))

        cached = caches.per_world(("groups", key, self.world_size), tile)
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

        return caches.per_world(("desc", key), describe)

    # --- the trace -----------------------------------------------------------------------------

    def all_closed(self) -> bool:
        """Whether every event begun has ended (a rank killed inside a collective has one open)."""
        return all(s is not None for s in self._slots)

    def kept_so_far(self) -> int:
        """The id the next event will have in the finished trace: every event with a smaller id
        has run. Lets code that watches a recording (``sv.diff``'s capture) say which events came
        before a point of the program, in the ids the trace will show. Incremental: each slot is
        looked at once, from the first one still open on."""
        n, i, slots = self._kept_count, self._kept_scan, self._slots
        while i < len(slots):
            slot = slots[i]
            if slot is None:
                break
            if not self._dropped(slot):
                n += 1
            i += 1
        self._kept_count, self._kept_scan = n, i
        return n

    def _dropped(self, slot: Event) -> bool:
        """A no-op redistribute with nothing inside (a backward's hop): not shown in the trace."""
        return (
            isinstance(slot, RedistributeEvent) and slot.src == slot.dst and slot.id not in self._has_children
        )

    def _kept(self, stop_at_open: bool) -> tuple[list[Event], dict[int, int]]:
        """The events a trace shows, in execution order, and their final ids by provisional id:
        no-op redistributes with nothing inside are dropped (a backward's hops), and with
        ``stop_at_open`` nothing from the first event still open on."""
        renumber: dict[int, int] = {}
        kept: list[Event] = []
        for slot in self._slots:
            if slot is None:
                if stop_at_open:
                    break
                continue
            if self._dropped(slot):
                continue
            renumber[slot.id] = len(kept)
            kept.append(slot)
        return kept, renumber

    def _dropped_from(self, renumber: dict[int, int]) -> int | None:
        """The first kept event whose values the budget dropped."""
        dropped_at = self.budget.exhausted_at
        if dropped_at is None:
            return None
        later = [renumber[i] for i in renumber if i >= dropped_at]
        return min(later) if later else None

    def partial(self) -> tuple[list[Event], int | None]:
        """The events so far, numbered as ``finish`` would number them, up to the first one still
        open, as copies (the recording goes on), and the first whose values were dropped."""
        kept, renumber = self._kept(stop_at_open=True)
        events = [
            dataclasses.replace(
                e, id=renumber[e.id], parent=renumber.get(e.parent) if e.parent is not None else None
            )
            for e in kept
        ]
        return events, self._dropped_from(renumber)

    def finish(self) -> None:
        """Compact the event slots into the trace: ids in execution order, no-op backward hops dropped."""
        kept, renumber = self._kept(stop_at_open=False)
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
                    hit = dims[key] = mesh_dim(e.groups, desc, own, generation)
                dim, name = hit if not e.params.get(_mesh.DEFAULT_GROUP) else (None, None)
                object.__setattr__(e, "mesh_dim", dim)
                object.__setattr__(e, "mesh_dim_name", name)
        self.trace.events = kept
        dropped_from = self._dropped_from(renumber)
        if dropped_from is not None:
            self.trace.values_dropped_from = dropped_from


def _dtensors(*xs: Any) -> list[Any]:
    """The DTensors among an op's arguments or results (nested in lists, tuples and dicts), in
    order: ``flatten`` without a list of every leaf, as it runs once per DTensor op."""
    out: list[Any] = []
    for x in xs:
        if isinstance(x, torch.Tensor):
            if _torch.is_dtensor(x):
                out.append(x)
        elif isinstance(x, (list, tuple, dict)):
            out.extend(a for a in flatten(x) if _torch.is_dtensor(a))
    return out


def active() -> Recorder | None:
    """The recorder of the recording running in this thread (innermost), or None."""
    for mode in reversed(_torch.dispatch_mode_stack()):
        if isinstance(mode, Recorder):
            return mode
    return None


@caches.memo(maxsize=1024)
def mesh_dim(
    groups: tuple[tuple[int, ...], ...],
    desc: str,
    own: tuple[_mesh.MeshInfo, ...],
    generation: tuple[int, int],
) -> tuple[int | None, str | None]:
    """The mesh dim whose groups these are: meshes of this trace (``own``) first, then any seen
    before, newest first (a 1-D mesh of the whole world runs on the default group). ``generation``
    changes when a mesh is built or freed, so the memo follows them."""
    meshes = [*own, *reversed(_torch.known_mesh_infos())]
    return _mesh.find_dim(groups, meshes, _mesh.group_dim_name(desc))
