"""Redistributes as DTensor reports them: a scope around the collectives each one runs.

DTensor tells an active DebugMode of each redistribute with ``record_redistribute_calls``, a
context manager around the transform; the recorder gives back a ``RedistributeScope``. The
implicit path (an operator's inputs redistributed to the placements it needs) reports the same
redistribute twice, an outer call with no plan and an inner one with it: the inner one only fills
in the outer one's plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any, Protocol

from ...data.events import RedistributeEvent, Source
from ...geometry.layout import Layout
from ...geometry.layout import compute as compute_layout
from .. import adapters
from .. import torch as _torch
from . import caches

Layouts = tuple[Layout | None, Layout | None, tuple[str, ...], tuple[str, ...]]


@dataclass(slots=True)
class OpenRedistribute:
    """A redistribute entered and not yet left: its event as far as it is known."""

    id: int
    parent: int | None
    source: Source | None
    module: str | None
    phase: str | None
    src: tuple[str, ...]
    dst: tuple[str, ...]
    explicit: bool
    before: Layout | None
    after: Layout | None
    plan: str
    implicit_outer: bool  # the implicit path's outer report: an inner one with the plan follows
    inner_seen: bool = False

    def event(self) -> RedistributeEvent:
        return RedistributeEvent(
            id=self.id,
            parent=self.parent,
            source=self.source,
            module=self.module,
            phase=self.phase,
            src=self.src,
            dst=self.dst,
            explicit=self.explicit,
            before=self.before,
            after=self.after,
            plan=self.plan,
        )


class Redistributes(Protocol):
    """What a scope asks of the recorder that made it (``mode.Recorder``): open the event when the
    redistribute starts, close it when it ends."""

    def open_redistribute(
        self, caller: FrameType, src: Any, dst: Any, plan: str, explicit: bool, implicit_outer: bool
    ) -> OpenRedistribute | None: ...

    def close_redistribute(self, opened: OpenRedistribute) -> None: ...


class RedistributeScope:
    """The context DTensor enters around a redistribute."""

    def __init__(
        self,
        rec: Redistributes,
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
        self.open: OpenRedistribute | None = None

    def __enter__(self) -> None:
        assert self.caller is not None
        # The implicit path passes the input's index for ``arg``, the explicit one the tensor.
        self.open = self.rec.open_redistribute(
            self.caller, self.src, self.dst, self.plan or "", bool(self.explicit), isinstance(self.arg, int)
        )
        # The caller's frame holds this scope while it runs and the redistribute's buffers in its
        # locals: keeping the frame would make a cycle that holds those buffers until the next
        # garbage collection instead of freeing them when the program drops them.
        self.caller = self.arg = None

    def __exit__(self, *exc: object) -> None:
        self.caller = self.arg = None
        if self.open is not None:
            self.rec.close_redistribute(self.open)
            self.open = None


def layouts(caller: FrameType, src: Any, dst: Any, note_mesh: Callable[[Any], None]) -> Layouts:
    """Layouts and placements before and after, from the DTensor specs in DTensor's own frame or
    arguments; ``note_mesh`` is told of the mesh."""
    src_spec = src if hasattr(src, "placements") else None
    dst_spec = dst if hasattr(dst, "placements") else None
    if src_spec is None or dst_spec is None:
        # DTensor passes placements; its frame holds the specs.
        current, target = _torch.redistribute_specs(caller)
        src_spec = current if src_spec is None else src_spec
        dst_spec = target if dst_spec is None else dst_spec
    if src_spec is not None:
        note_mesh(src_spec.mesh)
    # A spec is immutable: the same DTensor redistributed again (a loop, a training step) gives
    # the same layouts.
    key = (
        id(src_spec),
        id(dst_spec.mesh) if dst_spec is not None else None,
        tuple(dst_spec.placements if dst_spec is not None else dst),
    )
    hit = caches.LAYOUTS.get(key)
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
            # A framework's spec with its own shard sizes (PhysicsNeMo's, behind DTensor's
            # fallback) keeps them on the mesh dims the redistribute leaves alone.
            sizes = adapters.shard_sizes(src_spec)
            kept = {m: v for m, v in (sizes or {}).items() if src_pl[m] == dst_pl[m]} or None
            before = compute_layout(
                gshape, shape, src_pl, names, dtype=dtype, mesh_ranks=ranks, shard_sizes=sizes
            )
            after = compute_layout(
                gshape, shape, dst_pl, names, dtype=dtype, mesh_ranks=ranks, shard_sizes=kept
            )
    except Exception:
        before = after = None
    result = (before, after, src_pl, dst_pl)
    if src_spec is not None:
        caches.remember(caches.LAYOUTS, key, (src_spec, result), 257)  # holds the spec: its id stays its own
    return result
