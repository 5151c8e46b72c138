"""A rank's own recorder under the threads backend: the Recorder real ranks use, in a process where
the other ranks record too."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ...capture import threadpg
from ...capture import torch as _torch
from ...capture.recorder import Recorder
from ...capture.recorder.snapshot import flatten, nbytes
from ...capture.recorder.specs import params
from ...data.events import CollectiveEvent, ComputeEvent
from ...data.interleave import Link
from ...data.trace import Trace


class RankRecorder(Recorder):
    """A rank's own recorder (as on a real rank) in a process where other ranks record too: it
    ignores the other threads' calls that reach every recorder (module hooks, ``to_local``), stamps
    each event with the run's clock, notes which meeting or message each collective was, and
    records a receive when its data arrives (``irecv(...).wait()``), not when it is posted."""

    def __init__(
        self, trace: Trace, world_size: int, values: str | int, rank: int, pool: threadpg.RankThreads
    ) -> None:
        super().__init__(trace, world_size, values, rank=rank)
        self.pool = pool
        self.ident = threading.get_ident()
        self.keys: dict[int, int] = {}  # provisional event id -> the run's clock (ordering key)
        self.links: dict[int, tuple[str, int]] = {}
        self.pipeline: dict[int, dict[str, Any]] = {}  # event -> its pipeline label (a p2p event)
        self.labels: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(tensor) -> (tensor, label)
        self._computes: list[int] = []
        self._last = -1
        ms = self.modules
        for name in ("_enter_forward", "_leave_forward"):
            setattr(ms, name, self._only_mine(getattr(ms, name)))

    def _only_mine(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def only_mine(*a: Any) -> Any:
            return hook(*a) if threading.get_ident() == self.ident else None

        return only_mine

    def __enter__(self) -> RankRecorder:
        super().__enter__()
        mode = threadpg.current_mode()
        if mode is not None:
            mode.on_meeting = self._linked
        return self

    def __exit__(self, *exc: object) -> None:
        mode = threadpg.current_mode()
        if mode is not None:
            mode.on_meeting = None
            mode.on_recv = None
        super().__exit__(*exc)

    def _reserve(self) -> int:
        eid = super()._reserve()
        self.keys[eid] = self.pool.tick()
        self._last = eid
        return eid

    def _linked(self, kind: str, ident: int, stamp: int, tensor: int | None) -> None:
        self.links[self._last] = (kind, ident)
        self.keys[self._last] = stamp
        if tensor is not None and tensor in self.labels:
            self.pipeline[self._last] = dict(self.labels[tensor][1])

    # --- pipeline stages (torch.distributed.pipelining), through _torch.pipeline_stage_hooks ---

    def _parent(self, in_dispatch: bool) -> int | None:
        parent = super()._parent(in_dispatch)
        return parent if parent is not None or not self._computes else self._computes[-1]

    @contextlib.contextmanager
    def compute(self, stage: int, method: str, chunk: int) -> Iterator[None]:
        """A stage's forward or backward of one microbatch: an event whose children are what it
        communicates (its tensor-parallel collectives)."""
        eid = self._reserve()
        source, _, _, _ = self._context()
        name = _torch.STAGE_COMPUTE_NAMES.get(method, method)
        assert self.rank is not None
        self._slots[eid] = ComputeEvent(
            id=eid,
            parent=self._parent(False),
            source=source,
            phase="backward" if name.startswith("backward") else "forward",
            name=name,
            ranks=(self.rank,),
            stage=stage,
            microbatch=chunk,
        )
        self._computes.append(eid)
        try:
            yield
        finally:
            self._computes.pop()

    def stage_ops(self, stage: int, method: str, chunk: int, tensors: list[Any]) -> None:
        """The tensors a stage is about to send or receive: their messages are pipeline traffic."""
        label = {"stage": stage, "microbatch": chunk, "phase": _torch.STAGE_OPS_PHASES.get(method, method)}
        for x in tensors:
            self.labels[id(x)] = (x, label)  # the tensor is kept: its id stays its own

    def _on_to_local(self, dt: Any, out: Any, caller: Any) -> None:
        if threading.get_ident() == self.ident:
            super()._on_to_local(dt, out, caller)

    def _on_from_local(self, out: Any, caller: Any) -> None:
        if threading.get_ident() == self.ident:
            super()._on_from_local(out, caller)

    def _collective(self, entry: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if entry[0].op == "recv":
            return self._recv_later(entry, func, args, kwargs)
        return super()._collective(entry, func, args, kwargs)

    def _recv_later(self, entry: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A receive: its event is made when its data is in the buffer (the Work's ``wait()``)."""
        spec, impl, names = entry
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        eid = self._reserve()
        parent: int | None
        if self._stack:
            top = self._stack[-1]
            parent, source, module, phase = top.id, top.source, top.module, top.phase
        else:
            source, module, phase, in_dispatch = self._context()
            parent = self._parent(in_dispatch)
        group = bound.get(spec.group)
        gkey = _torch.process_group_key(group)
        groups = (tuple(_torch.process_group_ranks(group)),)
        out_arg = bound[spec.outputs]
        (buf,) = out_arg
        if self.snaps.aliases:
            self.snaps.unalias(flatten(out_arg))  # the receive writes it
        rank = self.rank
        assert rank is not None

        def received(msg: threadpg.Message) -> None:
            with _torch.no_dispatch():
                outputs = self.snaps.take(out_arg, [rank], eid)
            event = CollectiveEvent(
                id=eid,
                parent=parent,
                source=source,
                module=module,
                phase=phase,
                op=spec.op,
                impl=impl,
                groups=groups,
                root=int(bound["src"]),
                inputs={},
                outputs=outputs,
                nbytes=nbytes([], [rank]),
                params=params(bound, spec),
            )
            if parent is not None:
                self._has_children.add(parent)
            self._slots[eid] = event
            self._group_desc[id(event)] = self._desc(gkey, group)
            self.links[eid] = ("recv", msg.id)
            self.keys[eid] = msg.stamp
            if id(buf) in self.labels:
                self.pipeline[eid] = dict(self.labels[id(buf)][1])

        mode = threadpg.current_mode()
        if mode is not None:
            mode.on_recv = received
        return func(*args, **kwargs)

    def finish(self) -> None:
        super().finish()
        # The meshes alive now, in the rank's thread (a sub-mesh's root among them): they name the
        # mesh dims of the merged trace's collectives, as the lockstep simulator's recorder does.
        self.mesh_infos = _torch.known_mesh_infos()

    def links_of_events(self) -> list[Link]:
        """Each event of the finished trace's ``Link``, in trace order."""
        by_event: dict[int, Link] = {}
        for eid, slot in enumerate(self._slots):
            if slot is not None:
                kind, ident = self.links.get(eid, (None, None))
                by_event[id(slot)] = Link(self.keys.get(eid, 0), kind, ident, self.pipeline.get(eid))
        return [by_event.get(id(e), Link(0)) for e in self.trace.events]
