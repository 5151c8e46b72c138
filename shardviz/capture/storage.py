"""Counting live tensor storage per rank while a recording runs (``sv.record(memory=...)``).

Every tensor an operator returns under the recorder is looked at once per storage: its bytes are
added to the ranks that hold it (a LocalTensor's ranks, or every rank for a plain tensor in the
simulation, or the recording rank on a real process) and a finalizer takes them off again when
the storage dies. Storages that change size in place (FSDP2 frees and refills its unsharded
parameters that way) are re-read when an operator returns them or when FSDP resizes them.

What the recorder keeps is not counted: its snapshots are copies made where no operator is seen,
never aliases of the program's buffers, so the count is the same whatever the value policy.
FakeTensors (DTensor's sharding propagation makes some) hold no memory and are skipped.

A sample of the running totals is taken as each event starts; the peak is kept between samples.
The result is a plain ``shardviz.memory.MemoryTimeline``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ..data import describe
from ..data.events import Event
from ..data.memory import MemoryTimeline
from ..data.trace import Trace
from . import torch as _torch
from .recorder import Recorder

# The trackers of the recordings running now: ``sv.per_rank`` makes its LocalTensor without an
# operator, so it reports the tensor here.
ACTIVE: list[StorageTracker] = []


def made(t: torch.Tensor) -> None:
    """A tensor made without an operator while recording (``sv.per_rank``)."""
    for tracker in ACTIVE:
        tracker.add(t)


class StorageTracker:
    """Running totals of live storage bytes per rank, with their peaks."""

    def __init__(self, world_size: int, rank: int | None = None) -> None:
        self.world_size = world_size
        self.every = tuple(range(world_size)) if rank is None else (rank,)
        self.own: tuple[int, ...] = () if rank is None else (rank,)
        self._live: dict[int, list[Any]] = {}  # id(storage) -> [finalizer, ranks, nbytes]
        self.now = [0] * world_size
        self.peak = [0] * world_size
        self.peak_slot: list[int | None] = [None] * world_size
        self.slot: int | None = None
        self.samples: list[tuple[int | None, list[int]]] = []
        self.closed = False
        self.counted = ["tensors made in the recording"]

    # --- what is seen --------------------------------------------------------------------------

    def add(self, x: Any) -> None:
        """An operator's result: a tensor, or a tuple / list with tensors in it."""
        if isinstance(x, torch.Tensor):
            self._add_tensor(x)
        elif isinstance(x, tuple | list):
            for y in x:
                if isinstance(y, torch.Tensor):
                    self._add_tensor(y)

    def _add_tensor(self, t: torch.Tensor, plain: tuple[int, ...] | None = None) -> None:
        """``plain``: the ranks a plain tensor stands for. In the simulation every tensor of the
        program is a LocalTensor; the plain ones an operator returns there are the simulator's
        own per-rank plumbing, so by default they count only on a real rank."""
        per_rank = _torch.rank_tensors(t)
        # Ranks whose tensors are slices of one storage (the batched engine stacks them) each hold
        # their share of it, as each would hold its own storage.
        shares: dict[int, int] = {}
        if len(per_rank) > 1:
            for p in per_rank.values():
                key = _storage_key(p)
                shares[key] = shares.get(key, 0) + 1
        for r, p in per_rank.items():
            ranks = (r,) if r is not None else (self.own if plain is None else plain)
            if ranks:
                self.add_storage(p, ranks, shares.get(_storage_key(p), 1) if shares else 1)

    def add_storage(self, p: torch.Tensor, ranks: Iterable[int], share: int = 1) -> None:
        """``p``'s storage, held by ``ranks``; ``share``: how many ranks' tensors it holds (each
        rank holds that part of it)."""
        if p.is_meta:
            return
        try:
            st = p.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass with no storage of its own
            return
        if st.device.type == "meta":
            # A FakeTensor (DTensor's sharding propagation makes global-shape ones the first time
            # it meets an operator): metadata only, no memory on any rank.
            return
        key = id(st)
        entry = self._live.get(key)
        if entry is None:
            # The storage's Python object lives exactly as long as the storage (torch keeps it),
            # so its finalizer runs when the last tensor or view over it is gone.
            fin = weakref.finalize(st, self._free, key)
            fin.atexit = False
            entry = self._live[key] = [fin, set(), st.nbytes() // share, share]
        elif entry[2] != st.nbytes() // entry[3]:
            self._resize(entry, st.nbytes() // entry[3])
        held: set[int] = entry[1]
        for r in ranks:
            if r not in held:
                held.add(r)
                self._bump(r, entry[2])

    def resized(self, rank: int | None, p: torch.Tensor) -> None:
        """A storage changed size in place (FSDP2's unsharded parameters)."""
        self.add_storage(p, self.every if rank is None else (rank,))

    def add_objects(self, objs: Any) -> None:
        """Tensors that exist before the recording: modules (parameters, buffers, grads),
        optimizers (their state), tensors, or lists / tuples / dicts of them."""
        items = list(objs) if isinstance(objs, list | tuple) else [objs]
        for obj in items:
            if isinstance(obj, torch.nn.Module):
                for p in obj.parameters():
                    self._add_tensor(p, self.every)
                    if p.grad is not None:
                        self._add_tensor(p.grad, self.every)
                for b in obj.buffers():
                    self._add_tensor(b, self.every)
                self.counted.append(f"{type(obj).__name__}'s parameters, buffers and grads")
            elif isinstance(obj, torch.optim.Optimizer) and isinstance(getattr(obj, "optimizers", 0), list):
                # One optimizer per model part (torchtitan's OptimizersContainer, whose own state
                # stays empty): each part's state.
                self.add_objects(getattr(obj, "optimizers"))  # noqa: B009 (not in Optimizer's stubs)
            elif isinstance(obj, torch.optim.Optimizer):
                for state in obj.state.values():
                    for v in state.values():
                        if isinstance(v, torch.Tensor):
                            self._add_tensor(v, self.every)
                self.counted.append(f"{type(obj).__name__}'s state")
            elif isinstance(obj, torch.Tensor):
                self._add_tensor(obj, self.every)
            elif isinstance(obj, dict):
                self.add_objects(list(obj.values()))
            else:
                raise TypeError(
                    "sv.record(memory=...) counts modules, optimizers and tensors; got "
                    f"{type(obj).__name__}. Pass memory=True to count only what the recording makes."
                )
        if any(isinstance(o, torch.Tensor) for o in items):
            self.counted.append("the tensors given")

    # --- bookkeeping ---------------------------------------------------------------------------

    def _bump(self, r: int, n: int) -> None:
        now = self.now[r] = self.now[r] + n
        if now > self.peak[r]:
            self.peak[r] = now
            self.peak_slot[r] = self.slot

    def _resize(self, entry: list[Any], nb: int) -> None:
        delta = nb - entry[2]
        entry[2] = nb
        for r in entry[1]:
            self._bump(r, delta)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is None or self.closed:
            return
        for r in entry[1]:
            self.now[r] -= entry[2]

    def sample(self, slot: int | None) -> None:
        self.slot = slot
        self.samples.append((slot, list(self.now)))

    def close(self) -> None:
        """Stop counting; the finalizers no longer hold this tracker."""
        self.closed = True
        for fin, *_ in self._live.values():
            fin.detach()
        self._live.clear()


class MemoryRecorder(Recorder):
    """The Recorder, also counting live storage per rank (only when asked: it costs a look at
    every operator's result)."""

    def __init__(self, *args: Any, memory: Any = True, **kwargs: Any) -> None:
        # Snapshots are copied, never aliased: an alias would keep a buffer the program dropped
        # alive, and the count would then depend on the value policy.
        kwargs["alias_buffers"] = False
        super().__init__(*args, **kwargs)
        self.tracker = StorageTracker(self.world_size, self.rank)
        if memory is not True:
            self.tracker.add_objects(memory)

    def __enter__(self) -> MemoryRecorder:
        super().__enter__()
        _torch.STORAGE_RESIZE_LISTENERS.append(self.tracker.resized)
        ACTIVE.append(self.tracker)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            _torch.STORAGE_RESIZE_LISTENERS.remove(self.tracker.resized)
            ACTIVE.remove(self.tracker)
        finally:
            super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented:
            self.tracker.add(out)
        return out

    def _reserve(self) -> int:
        slot = super()._reserve()
        self.tracker.sample(slot)
        return slot

    def finish(self) -> None:
        tracker = self.tracker
        tracker.sample(None)  # the end of the recording
        tracker.close()
        super().finish()
        self.trace.memory = timeline(self.trace, self._slots, tracker)


def _storage_key(p: torch.Tensor) -> int:
    try:
        return id(p.untyped_storage())  # torch keeps one Python object per live storage
    except (RuntimeError, NotImplementedError):
        return id(p)


def timeline(trace: Trace, slots: list[Event | None], tracker: StorageTracker) -> MemoryTimeline:
    """The tracker's samples by final event id (``Recorder.finish`` renumbers the events and drops
    some; a sample or peak at a dropped one goes to the last kept event before it)."""
    kept = {id(e) for e in trace.events}
    last: int | None = None
    final: list[int | None] = []
    for s in slots:
        if s is not None and id(s) in kept:
            last = s.id
        final.append(last)
    events: list[int | None] = []
    rows: list[list[int]] = []
    for slot, now in tracker.samples:
        if slot is not None:
            s = slots[slot]
            if s is None or id(s) not in kept:
                continue
            events.append(s.id)
        else:
            events.append(None)
        rows.append(now)
    peak_event = tuple(None if s is None else final[s] for s in tracker.peak_slot)
    by_id = {e.id: e for e in trace.events}
    labels = {i: describe.label(by_id[i]) for i in set(peak_event) if i is not None and i in by_id}
    return MemoryTimeline(
        world_size=tracker.world_size,
        events=tuple(events),
        bytes=np.asarray(rows, dtype=np.int64).reshape(len(rows), tracker.world_size),
        peak=np.asarray(tracker.peak, dtype=np.int64),
        peak_event=peak_event,
        counted=", ".join(tracker.counted),
        labels=labels,
    )
