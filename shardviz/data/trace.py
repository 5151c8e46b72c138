"""The trace: what one ``record()`` / ``run()`` / ``%%spmd`` cell did, as plain data.

A trace holds events (``shardviz.data.events``) and no live tensors or torch objects, so views can
read it anywhere (a notebook without torch, a saved file, a browser); ``check``, ``summary`` and
its text are the analyses below it (``flow``, ``cost``, ``describe``), and ``save`` writes the
file format of ``trace_file``: a zip of one JSON document and ``.npy`` arrays, so opening a
stranger's trace runs no code.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import TraceFileError
from . import describe, trace_file
from .cost import CostSummary, Link
from .cost import summary as cost_summary
from .events import (
    EVENT_TYPES,
    CollectiveEvent,
    ComputeEvent,
    Event,
    LocalEvent,
    OpEvent,
    RedistributeEvent,
    array_eq,
    array_of,
)
from .flow import FlowCheck, check_trace

if TYPE_CHECKING:
    from .memory import MemoryTimeline

# The value policy's default budget: values of all snapshots in one trace, in bytes. Enough for
# every teaching-size example; a model-size run keeps metadata (shapes, groups, bytes) only.
DEFAULT_VALUE_BUDGET = 64 * 2**20


class Trace:
    """What one ``record()`` / ``run()`` / ``%%spmd`` cell did, in execution order."""

    def __init__(
        self,
        world_size: int,
        backend: str = "local",
        values: str | int = DEFAULT_VALUE_BUDGET,
    ) -> None:
        self.world_size = world_size
        self.backend = backend
        self.values = values
        self.events: list[Event] = []
        self.results: dict[int, Any] | None = None
        self.values_dropped_from: int | None = None
        self.meshes: list[dict[str, Any]] = []
        self.complete = True
        # What a reader should know before trusting the picture (a partial merge's report, a Flight
        # Recorder dump's desyncs), one line each; printed by str(trace) and shown by the player.
        self.notes: list[str] = []
        # Plain JSON facts about where the trace came from: a job rank's status, the event a viewer
        # should start at ("start_event"), a Flight Recorder dump's groups.
        self.meta: dict[str, Any] = {}
        # Live bytes per rank over the recording (``sv.record(memory=...)``), else None.
        self.memory: MemoryTimeline | None = None

    # --- reading -----------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def __getitem__(self, i: int) -> Event:
        return self.events[i]

    def event(self, event_id: int) -> Event:
        """The event with id ``event_id`` (KeyError if none)."""
        for e in self.events:
            if e.id == event_id:
                return e
        raise KeyError(f"no event with id {event_id} in this trace")

    def collectives(self) -> list[CollectiveEvent]:
        """The collective events (send and recv included), in execution order."""
        return [e for e in self.events if isinstance(e, CollectiveEvent)]

    def redistributes(self) -> list[RedistributeEvent]:
        """The redistribute events, in execution order."""
        return [e for e in self.events if isinstance(e, RedistributeEvent)]

    def ops(self) -> list[OpEvent]:
        """The DTensor operator events, in execution order."""
        return [e for e in self.events if isinstance(e, OpEvent)]

    def locals(self) -> list[LocalEvent]:
        """The events of local compute on shards (``to_local()`` code), in execution order."""
        return [e for e in self.events if isinstance(e, LocalEvent)]

    def children(self, event_id: int | None) -> list[Event]:
        """The events directly inside event ``event_id`` (None: the top-level events)."""
        return [e for e in self.events if e.parent == event_id]

    def __str__(self) -> str:
        """One line per event, nested under its parent, with the user's line that ran it."""
        lines = [f"Trace: {self.backend}, {self.world_size} ranks, {len(self.events)} events"]
        depth: dict[int, int] = {}
        for e in self.events:
            d = depth[e.parent] + 1 if e.parent is not None and e.parent in depth else 0
            depth[e.id] = d
            where = describe.context_brackets(e)
            src = f"  <- {e.source.text}" if e.source is not None and e.source.text else ""
            lines.append(f"{'  ' * d}#{e.id} {describe.line(e)}{where}{src}")
        if self.values_dropped_from is not None:
            lines.append(f"(values kept until the budget ran out at event #{self.values_dropped_from})")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)

    def check(self) -> dict[int, FlowCheck]:
        """Collectives whose recorded outputs differ from what the op's semantics give for their
        recorded inputs (``shardviz.data.flow``), and events that name ranks outside this trace's
        world, by event id: empty when everything adds up. A debugging tool must not hide a wrong
        result, the simulator's own included."""
        out = {i: c for i, c in check_trace(self.events).items() if c.checked and not c.ok}
        for i, why in self.outside_world().items():
            out[i] = FlowCheck(ok=False, checked=True, max_error={}, note=why)
        return out

    def outside_world(self) -> dict[int, str]:
        """Events that name ranks this trace's world does not have (or a rank twice in one group),
        by event id, each with what it names: a trace of 4 ranks holding a group [0..7] was recorded
        in another world than the one it says, and no reader can trust its numbers."""
        world = range(self.world_size)
        out: dict[int, str] = {}
        for e in self.events:
            groups = getattr(e, "groups", ())
            if isinstance(e, ComputeEvent):
                groups = (e.ranks,)
            named = [r for g in groups for r in g]
            for attr in ("inputs", "outputs", "nbytes"):
                named += list(getattr(e, attr, {}))
            outside = sorted({r for r in named if r not in world})
            if outside:
                out[e.id] = (
                    f"event #{e.id} names {'rank' if len(outside) == 1 else 'ranks'} "
                    f"{describe.rank_list(outside)} outside this trace's world of "
                    f"{self.world_size} ranks (0..{self.world_size - 1})"
                )
                continue
            twice = next((g for g in groups if len(set(g)) != len(g)), None)
            if twice is not None:
                out[e.id] = f"event #{e.id} has a group that names a rank twice: {describe.group(twice)}"
        return out

    def summary(self, link: str | Link | None = None) -> CostSummary:
        """Communication cost per collective, per mesh dim and per module (``str()`` is a table,
        ``.rows`` the data); ``link`` is a preset name ("nvlink4", "pcie5", "ib-ndr", ...) or a
        ``shardviz.data.cost.Link``."""
        return cost_summary(self.events, link)

    def __repr__(self) -> str:
        kinds = {k: sum(1 for e in self.events if e.kind == k) for k in EVENT_TYPES}
        parts = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in kinds.items() if n)
        return f"<Trace {self.backend} world_size={self.world_size}: {parts or 'no events'}>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Trace):
            return NotImplemented
        return (
            self.world_size == other.world_size
            and self.backend == other.backend
            and self.values == other.values
            and self.complete == other.complete
            and self.values_dropped_from == other.values_dropped_from
            and self.meshes == other.meshes
            and self.notes == other.notes
            and self.meta == other.meta
            and self.memory == other.memory
            and self.events == other.events
            and _results_eq(self.results, other.results)
        )

    __hash__ = None  # type: ignore[assignment]

    # --- files -------------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Write the trace (values and results included) as one zip of JSON and .npy files. A trace
        ``sv.load`` would refuse (ranks outside its world) is not written: the error says why."""
        wrong = self.outside_world()
        if wrong or (self.results and any(not 0 <= int(r) < self.world_size for r in self.results)):
            what = next(iter(wrong.values()), f"results of ranks outside 0..{self.world_size - 1}")
            raise TraceFileError(
                f"{path} not written: {what}. sv.load refuses such a file, so it is not saved; the "
                "trace was recorded in another world than the one it names (trace.check() lists each "
                "such event)."
            )
        w = trace_file.Writer()
        return trace_file.write(path, self._document(w), w.arrays)

    def _document(self, w: trace_file.Writer, results: bool = True) -> dict[str, Any]:
        """The trace as trace.json holds it, its arrays handed to ``w`` (a report embeds it,
        without ``results``: what sv.diff's ranks returned is in the report's rows)."""
        saved: dict[str, Any] | None = None
        if self.results is not None and results:
            saved = {}
            dropped = []
            for rank, value in self.results.items():
                enc = trace_file.encode_result(value, w)
                if enc is None:
                    dropped.append(f"rank {rank}: {type(value).__name__}")
                else:
                    saved[str(rank)] = enc
            if dropped:
                warnings.warn(
                    "trace.save: results that are neither tensors nor JSON values are not saved ("
                    + ", ".join(dropped)
                    + ")",
                    stacklevel=3,
                )
        doc = {
            "world_size": self.world_size,
            "backend": self.backend,
            "values": self.values,
            "values_dropped_from": self.values_dropped_from,
            "complete": self.complete,
            "meshes": self.meshes,
            "events": [w.event(e) for e in self.events],
            "results": saved,
            "notes": list(self.notes),
            "meta": self.meta,
            "memory": self.memory.to_dict(w.array) if self.memory is not None else None,
        }
        return doc


def _results_eq(a: dict[int, Any] | None, b: dict[int, Any] | None) -> bool:
    if a is None or b is None:
        return a is b
    return set(a) == set(b) and all(_value_eq(a[k], b[k]) for k in a)


def _value_eq(x: Any, y: Any) -> bool:
    if hasattr(x, "shape") and hasattr(y, "shape"):
        same_dtype = str(getattr(x, "dtype", "")) == str(getattr(y, "dtype", ""))
        return same_dtype and array_eq(np.asarray(array_of(x)), np.asarray(array_of(y)))
    if isinstance(x, tuple | list) and isinstance(y, tuple | list):
        same = type(x) is type(y) and len(x) == len(y)
        return same and all(_value_eq(p, q) for p, q in zip(x, y, strict=True))
    if isinstance(x, dict) and isinstance(y, dict):
        return set(x) == set(y) and all(_value_eq(x[k], y[k]) for k in x)
    return bool(x == y)
