"""A trace's steps as plain data: what the collective player and its matplotlib picture draw.

``Model`` turns a ``Trace`` into the player's replies, computed on request:

- a compact **timeline** (columnar, strings deduplicated), so a 1,000-event trace costs tens of
  kilobytes of synced state;
- per step, ``detail`` (groups, each rank's buffers before and after cut into the parts the data
  flow moves, the transfers of ``flow.transfers``, padding, the flow check, cost, and for a
  redistribute its layouts and plan), ``values`` (each rank's buffers of one group as binary
  buffers, sampled when large) and ``ring`` (the ring algorithm's states from ``ring.py``,
  contributors and a few values).

The pieces live beside it: ``grid`` (a buffer as a drawn grid of parts), ``buffers`` (what each
rank's buffers hold before and after a step) and ``ring_states`` (the ring reply). No widget
library is imported here: the widget (views/player.py) sends these replies to the
browser, and views/mpl.py draws the same part descriptions without anywidget, so both agree.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..data import cost as _cost
from ..data import describe
from ..data import flow as _flow
from ..data import ring as _ring
from ..data.events import CollectiveEvent, Event, LocalEvent, OpEvent, RedistributeEvent
from ..data.plan import PlanStep, plan_steps
from ..data.trace import Trace
from . import geometry as g
from .buffers import (
    buffer_json,
    check_json,
    p2p_pairs,
    rle,
    snapshots_of,
    source_json,
    stays,
    step_buffers,
    transfer_json,
    valid_shapes,
)
from .ring_states import ring_reply

# Elements per buffer in a values reply: the view prints numbers into small buffers and a
# summary for large ones, so a sample of this size is all it ever shows.
VALUES_LIMIT = 4096
# Rings are drawn as a rank x chunk grid: beyond this many ranks it is no longer readable.
RING_MAX = 16

KIND_CODES = {"collective": "c", "redistribute": "r", "op": "o", "local": "l", "module": "m"}
STEP_KINDS = ("collective", "redistribute")

# Operators that only change how a tensor is viewed (or detach it from autograd): no rank computes
# or sends anything. Their timeline rows are folded by default; a real model has hundreds.
VIEW_OPS = frozenset(
    {
        "alias", "as_strided", "detach", "expand", "expand_as", "flatten", "lift_fresh", "narrow",
        "permute", "_reshape_alias", "reshape", "select", "slice", "split", "split_with_sizes",
        "squeeze", "t", "transpose", "unbind", "unflatten", "unsqueeze", "_unsafe_view", "view",
        "view_as", "view_as_complex", "view_as_real",
    }
)  # fmt: skip
PHASES = ("forward", "backward", "none")
# The keys of a player's filter (PlayerWidget.filter): which steps and timeline rows it shows.
FILTER_KEYS = ("phase", "module", "mesh_dim", "all_ops")


@dataclass
class Model:
    """The trace, its steps and the lookups every reply needs (built once per widget)."""

    trace: Trace
    local_steps: bool = False
    steps: list[Event] = field(init=False)
    by_id: dict[int, Event] = field(init=False)
    children: dict[int | None, list[Event]] = field(init=False)
    _plans: dict[int, list[PlanStep]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        kinds = (*STEP_KINDS, "local") if self.local_steps else STEP_KINDS
        self.steps = [e for e in self.trace.events if e.kind in kinds]
        self.by_id = {e.id: e for e in self.trace.events}
        self.children = {}
        for e in self.trace.events:
            self.children.setdefault(e.parent, []).append(e)

    def plan(self, e: RedistributeEvent) -> list[PlanStep]:
        if e.id not in self._plans:
            self._plans[e.id] = plan_steps(e, self.children.get(e.id, []))
        return self._plans[e.id]

    def plan_step_of(self, e: CollectiveEvent) -> PlanStep | None:
        parent = self.by_id.get(e.parent) if e.parent is not None else None
        if not isinstance(parent, RedistributeEvent):
            return None
        return next((s for s in self.plan(parent) if s.event == e.id), None)

    def step_of(self, event_id: int) -> int | None:
        for k, e in enumerate(self.steps):
            if e.id == event_id:
                return k
        return None

    def ancestors(self, e: Event) -> list[Event]:
        out: list[Event] = []
        p = e.parent
        while p is not None and p in self.by_id and len(out) < 32:
            out.append(self.by_id[p])
            p = self.by_id[p].parent
        return out[::-1]

    def collectives_under(self, e: Event) -> Iterator[CollectiveEvent]:
        for c in self.children.get(e.id, []):
            if isinstance(c, CollectiveEvent):
                yield c
            yield from self.collectives_under(c)

    def moves_no_data(self, e: Event) -> bool:
        """A DTensor operator that only views its input (``aten.detach``, ``aten.view``, ``aten.t``,
        ...) and redistributes nothing: folded in the timeline unless ``all_ops`` is asked for."""
        if not isinstance(e, OpEvent) or self.children.get(e.id):
            return False
        parts = e.name.split(".")
        base = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
        return base in VIEW_OPS

    def mesh_dims(self, e: Event) -> list[str]:
        """The mesh dims an event's collectives ran on (itself, or those it encloses), by label;
        "-" for a collective on no mesh dim."""
        if isinstance(e, CollectiveEvent):
            return [describe.mesh_dim(e) or "-"]
        return sorted({describe.mesh_dim(c) or "-" for c in self.collectives_under(e)})

    def matches(self, e: Event, flt: dict[str, Any]) -> bool:
        """Does an event pass a filter (keys of FILTER_KEYS; a missing key passes everything)?

        ``phase``: "forward", "backward", or "none" (outside both: setup, optimizer steps);
        ``module``: part of the name of the ``nn.Module`` the event ran in; ``mesh_dim``: a mesh
        dim's label ("tp", "dim 0") or "-" for none; a redistribute or operator matches through
        the collectives it encloses."""
        phase = flt.get("phase")
        if phase and (e.phase or "none") != phase:
            return False
        module = flt.get("module")
        if module and (e.module is None or module not in e.module):
            return False
        dim = flt.get("mesh_dim")
        return not dim or dim in self.mesh_dims(e)

    def steps_matching(self, flt: dict[str, Any]) -> list[int]:
        """The steps a filter keeps: what prev / next / first / last move between."""
        return [k for k, e in enumerate(self.steps) if self.matches(e, flt)]

    def step_start(self) -> int | None:
        """The first step of the training step: the first collective recorded inside an
        ``nn.Module``'s forward or backward (so after model setup: ``distribute_tensor``,
        ``parallelize_module``, ``fully_shard``, which run outside any forward). None when no
        collective ran in one."""
        for k, e in enumerate(self.steps):
            if isinstance(e, CollectiveEvent) and e.phase in ("forward", "backward"):
                return k
        return None

    def cost(self, e: Event) -> tuple[float, int]:
        """(bus bytes per rank, sequential ring steps) of a step, summed over a redistribute's
        collectives: time on a link is alpha x steps + bytes / beta (cost.py's model)."""
        if isinstance(e, CollectiveEvent):
            row = _cost.event_cost(e)
            return row.bus_bytes_per_rank, _cost.ring_steps(e.op, e.group_size)
        if isinstance(e, RedistributeEvent):
            total, hops = 0.0, 0
            for c in self.collectives_under(e):
                b, h = self.cost(c)
                total, hops = total + b, hops + h
            return total, hops
        return 0.0, 0

    # ---- synced state ----

    def timeline(self) -> dict[str, Any]:
        """Columnar rows (event rows and module headers), strings and sources deduplicated."""
        strings: dict[str, int] = {}
        sources: dict[tuple[int, str], int] = {}

        def sid(text: str) -> int:
            return strings.setdefault(text, len(strings))

        ids: list[int] = []
        kinds: list[str] = []
        depth: list[int] = []
        label: list[int] = []
        source: list[int] = []
        phase: list[str] = []  # per row: f / b / - (outside a forward or backward)
        module: list[int] = []  # per row: the module's name (a string id), -1 for none (sent as rle)
        dims: list[int] = []  # per row: the mesh dims of its collectives, comma-joined (rle)
        quiet: list[int] = []  # rows folded by default (operators that move no data)
        codes = {"forward": "f", "backward": "b"}
        step_rows: list[int] = []
        step_ids = {e.id for e in self.steps}
        levels: dict[int, int] = {}
        open_: list[tuple[str, str | None]] = []  # the module headers of the rows above
        for e in self.trace.events:
            if e.parent is None or e.parent not in levels:
                # nn.Modules nest as headers: "Net · forward" > "block", one level per name
                parts = e.module.split(".") if e.module else []
                keys = [(".".join(parts[: i + 1]), e.phase) for i in range(len(parts))]
                if not keys and e.phase:
                    keys = [("", e.phase)]
                same = 0
                while same < min(len(keys), len(open_)) and keys[same] == open_[same]:
                    same += 1
                for i in range(same, len(keys)):
                    name = parts[i] if parts else ""
                    text = " · ".join(x for x in (name, e.phase if i == 0 else None) if x)
                    ids.append(-1)
                    kinds.append("m")
                    depth.append(i)
                    label.append(sid(text))
                    source.append(-1)
                    phase.append(codes.get(e.phase or "", "-"))
                    module.append(sid(keys[i][0]) if keys[i][0] else -1)
                    dims.append(-1)
                open_ = keys
                d = len(keys)
            else:
                d = levels[e.parent] + 1
            levels[e.id] = d
            if e.id in step_ids:
                step_rows.append(len(ids))
            if self.moves_no_data(e):
                quiet.append(len(ids))
            ids.append(e.id)
            kinds.append(KIND_CODES.get(e.kind, "?"))
            depth.append(d)
            label.append(sid(describe.short(e)))
            phase.append(codes.get(e.phase or "", "-"))
            module.append(sid(e.module) if e.module else -1)
            row_dims = self.mesh_dims(e) if e.kind in ("collective", "redistribute", "op") else []
            dims.append(sid(",".join(row_dims)) if row_dims else -1)
            if e.source is not None:
                source.append(sources.setdefault((e.source.line, e.source.text), len(sources)))
            else:
                source.append(-1)
        bus, hops = [], []
        for e in self.steps:
            b, h = self.cost(e)
            bus.append(round(b, 3))
            hops.append(h)
        return {
            "ids": ids,
            "kinds": "".join(kinds),
            "depth": depth,
            "label": label,
            "source": source,
            "steps": step_rows,
            "phase": "".join(phase),
            "module": rle(module),
            "dims": rle(dims),
            "quiet": quiet,
            "bus": bus,
            "hops": hops,
            "total_kinds": "".join(KIND_CODES.get(e.kind, "?") for e in self.steps),
            "strings": list(strings),
            "sources": [[line, text] for line, text in sources],
        }

    def info(self, title: str | None) -> dict[str, Any]:
        t = self.trace
        notes = []
        if not self.steps:
            notes.append("this trace has no collectives or redistributes: nothing to step through")
        if t.values_dropped_from is not None:
            notes.append(
                f"values were kept until the value budget ran out at event #{t.values_dropped_from}; "
                "later steps show shapes only"
            )
        if not t.complete:
            notes.append("this trace is incomplete (a rank failed): the last steps may be missing")
        notes.extend(getattr(t, "notes", ()))
        bus_total = sum(self.cost(e)[0] for e in t.events if isinstance(e, CollectiveEvent))
        hops_total = sum(self.cost(e)[1] for e in t.events if isinstance(e, CollectiveEvent))
        return {
            "title": title or f"Trace: {t.backend}, {t.world_size} ranks",
            "world_size": t.world_size,
            "backend": t.backend,
            "events": len(t.events),
            "collectives": sum(1 for e in t.events if isinstance(e, CollectiveEvent)),
            "steps": len(self.steps),
            "local_steps": self.local_steps,
            "total_bus": round(bus_total, 3),
            "total_hops": hops_total,
            "links": {
                k: {"name": lk.name, "alpha": lk.alpha, "beta": lk.beta} for k, lk in _cost.PRESETS.items()
            },
            "notes": notes,
            "step_start": self.step_start(),
            "palette": {"fill": list(g.PALETTE), "text": list(g.TEXT_ON), "patterns": list(g.PATTERNS)},
        }

    # ---- replies ----

    def detail(self, k: int) -> dict[str, Any]:
        """Everything the view draws for step ``k`` except values (fetch_step's reply)."""
        e = self.steps[k]
        out: dict[str, Any] = {
            "step": k,
            "id": e.id,
            "kind": e.kind,
            "label": describe.short(e),
            "line": describe.line(e),
            "source": source_json(e),
            "module": e.module,
            "phase": e.phase,
            "context": [
                {"id": a.id, "label": describe.short(a), "step": self.step_of(a.id)}
                for a in self.ancestors(e)
            ],
            "notes": [],
        }
        bus, hops = self.cost(e)
        out["cost"] = {"bus": bus, "hops": hops}
        if isinstance(e, RedistributeEvent):
            out.update(self._redistribute(e))
        elif isinstance(e, CollectiveEvent):
            out.update(self._collective(e))
        elif isinstance(e, LocalEvent):
            out.update(self._local(e))
        return out

    def _groups_json(self, e: CollectiveEvent | LocalEvent) -> list[list[int]]:
        if isinstance(e, LocalEvent):
            ranks = sorted(set(e.inputs) | set(e.outputs))
            return [ranks] if ranks else []
        return [list(grp) for grp in e.groups]

    def _collective(self, e: CollectiveEvent) -> dict[str, Any]:
        step = self.plan_step_of(e)
        valid = valid_shapes(e, step)
        bufs = step_buffers(e, valid)
        n = e.group_size
        factor = _cost.bus_factor(e.op, n)
        ranks = {}
        for r, b in sorted(bufs.items()):
            nb = e.nbytes.get(r, 0)
            ranks[str(r)] = {
                "in": buffer_json(b["in"], n),
                "out": buffer_json(b["out"], n),
                "nbytes": nb,
                "bus": factor * nb,
            }
        notes = []
        padded = [
            r
            for r, b in bufs.items()
            if any(x and (x.pad or any(p.pad for p in x.parts)) for x in b.values())
        ]
        if padded:
            notes.append(
                f"uneven shards: hatched grey cells are padding (ranks {g.rank_list(padded)}); DTensor "
                "pads every shard to the same size before the collective and drops the padding after"
            )
        if e.op == "barrier":
            notes.append("barrier: no data moves; every rank of the group waits until all have arrived")
        pairs = p2p_pairs(e)
        if e.op in ("send", "recv"):
            peer = e.params.get("peer")
            peer_step = self.step_of(peer) if isinstance(peer, int) else None
            where = f" (step {peer_step + 1})" if peer_step is not None else ""
            for src, dst in pairs:
                if e.op == "send":
                    notes.append(
                        f"point-to-point send: rank {src} sends its whole buffer to rank {dst}; "
                        f"it lands in rank {dst}'s matching recv{where}"
                    )
                else:
                    notes.append(
                        f"point-to-point recv: rank {dst} receives the whole buffer rank {src} sent{where}"
                    )
            if not pairs:
                notes.append(
                    "point-to-point: the player shows each rank's buffer; the pairing is not recorded"
                )
        if e.op == "reduce":
            notes.append(
                "reduce: only the root's output is defined; other ranks' outputs are left as they were"
            )
        if e.op == "gather":
            notes.append("gather: only the root receives the list; other ranks' output lists are not used")
        if e.op == "scatter":
            notes.append("scatter: only the root's input list is read")
        drawn = [b for x in bufs.values() for b in x.values() if b]
        if drawn and not any(b.values for b in drawn):
            notes.append("values not kept for this step (value policy): shapes and bytes only")
        if "flight" in e.params:
            from ..data.flight import flight_notes

            notes.extend(flight_notes(e))
        check = _flow.check(e)
        ring_ok = e.op in _ring.RING_OPS and bool(e.groups)
        ring_note = ""
        if ring_ok and n > RING_MAX:
            ring_ok, ring_note = (
                False,
                f"the ring view draws groups of up to {RING_MAX} ranks (this one has {n})",
            )
        elif ring_ok and _ring.ring(e, 0) is None:
            ring_ok, ring_note = (
                False,
                "the ring view needs the buffers' values, which this trace did not keep",
            )
        return {
            "op": e.op,
            "impl": e.impl,
            "reduce_op": e.reduce_op,
            "root": e.root,
            "roots": e.roots(),
            "mesh_dim": e.mesh_dim,
            "mesh_dim_name": e.mesh_dim_name,
            "where": self.where(e),
            "pairs": [list(x) for x in pairs],
            "groups": self._groups_json(e),
            "ranks": ranks,
            "transfers": [transfer_json(t) for t in _flow.transfers(e)],
            "stays": [transfer_json(t) for t in stays(e)],
            "check": check_json(check),
            "ring": {"available": ring_ok, "note": ring_note} if e.op in _ring.RING_OPS else None,
            "plan_step": step.index if step else None,
            "bus_factor": factor,
            "notes": notes,
        }

    def where(self, e: CollectiveEvent) -> str:
        """Which process groups ran a collective, in words: its mesh dim, the default group, or
        point-to-point pairs (raw ``dist.*`` calls on no mesh are not "unmatched")."""
        if e.op in ("send", "recv"):
            pairs = p2p_pairs(e)
            return f"point-to-point, {len(pairs)} pair{'s' if len(pairs) != 1 else ''}"
        dim = describe.mesh_dim(e)
        if dim:
            return f"mesh {dim}"
        ranks = sorted(r for grp in e.groups for r in grp)
        if len(e.groups) == 1 and ranks == list(range(self.trace.world_size)):
            return f"default process group (all {self.trace.world_size} ranks)"
        if not self.trace.meshes:
            return "process groups of their own (no device mesh in this trace)"
        return "groups that match no mesh dim"

    def _local(self, e: LocalEvent) -> dict[str, Any]:
        bufs = step_buffers(e)
        n = len(bufs)
        ranks = {
            str(r): {
                "in": buffer_json(b["in"], n),
                "out": buffer_json(b["out"], n),
                "nbytes": 0,
                "bus": 0.0,
            }
            for r, b in sorted(bufs.items())
        }
        return {
            "op": "local",
            "name": e.name,
            "groups": self._groups_json(e),
            "ranks": ranks,
            "transfers": [],
            "stays": [[r, r, None, None, False] for r in sorted(bufs)],
            "check": None,
            "ring": None,
            "notes": [f"local compute ({e.name}) on each rank's own shard: no communication"],
        }

    def _redistribute(self, e: RedistributeEvent) -> dict[str, Any]:
        steps = self.plan(e)
        labels = e.before.mesh_dim_names if e.before is not None else None
        plan = []
        for s in steps:
            if s.mesh_dim is None:
                dim_label = "-"
            elif labels:
                dim_label = labels[s.mesh_dim]
            else:
                dim_label = f"dim {s.mesh_dim}"
            plan.append(
                {
                    "mesh_dim": s.mesh_dim,
                    "dim_label": dim_label,
                    "src": s.src,
                    "dst": s.dst,
                    "op": s.op,
                    "event": s.event,
                    "step": self.step_of(s.event) if s.event is not None else None,
                }
            )
        notes = []
        if not steps and e.plan:
            notes.append(f"plan {e.plan} (not split into steps)")
        if not e.explicit:
            notes.append("implicit: DTensor redistributed an operand to run the operator that encloses it")
        return {
            "src": list(e.src),
            "dst": list(e.dst),
            "plan": e.plan,
            "explicit": e.explicit,
            "before": g.payload(e.before) if e.before is not None else None,
            "after": g.payload(e.after) if e.after is not None else None,
            "plan_steps": plan,
            "children": [c.id for c in self.collectives_under(e)],
            "notes": notes,
        }

    def values(self, k: int, group: int) -> tuple[dict[str, Any], list[bytes]]:
        """Every rank's buffers of one group of step ``k``: one binary buffer per tensor."""
        e = self.steps[k]
        if not isinstance(e, CollectiveEvent | LocalEvent):
            return {"error": "a redistribute's values are in the steps of its collectives"}, []
        groups = self._groups_json(e)
        if not 0 <= group < len(groups):
            return {"error": f"step {k} has no group {group} (it has {len(groups)})"}, []
        entries: list[dict[str, Any]] = []
        buffers: list[bytes] = []
        missing = 0
        for r in groups[group]:
            for side, per_rank in (("in", e.inputs), ("out", e.outputs)):
                snap = per_rank.get(r)
                listed = isinstance(snap, list)
                for slot, s in enumerate(snapshots_of(snap)):
                    if s.values is None:
                        missing += 1
                        continue
                    meta, data = g.encode(s.values, s.dtype, VALUES_LIMIT)
                    meta.update({"rank": r, "side": side, "slot": slot if listed else None})
                    summary = s.summary
                    if summary is not None and summary.min is not None and summary.max is not None:
                        # exact, also when the values sent are a sample
                        meta.update({"min": summary.min, "max": summary.max})
                    entries.append(meta)
                    buffers.append(data)
        if not entries:
            return {"error": "values not kept for this step (value policy): shapes only"}, []
        return {"step": k, "group": group, "entries": entries, "missing": missing}, buffers

    def ring(self, k: int, group: int) -> tuple[dict[str, Any], list[bytes]]:
        """The ring algorithm's states for one group of step ``k`` (contributors as bit masks over
        the group's ranks, and the first values of every chunk in one float64 buffer)."""
        e = self.steps[k]
        if not isinstance(e, CollectiveEvent) or e.op not in _ring.RING_OPS:
            return {"error": "the ring view is for all_reduce, all_gather and reduce_scatter"}, []
        if not 0 <= group < len(e.groups):
            return {"error": f"step {k} has no group {group} (it has {len(e.groups)})"}, []
        n = len(e.groups[group])
        if n > RING_MAX:
            return {"error": f"the ring view draws groups of up to {RING_MAX} ranks (this one has {n})"}, []
        rg = _ring.ring(e, group)
        if rg is None:
            return {"error": "the ring view needs the buffers' values, which this trace did not keep"}, []
        return ring_reply(k, group, rg, e)


def event_trace(event: Event) -> Trace:
    """A one-event trace, so that an event alone can be played, plotted or exported."""
    ranks: set[int] = set()
    if isinstance(event, CollectiveEvent):
        ranks = {r for grp in event.groups for r in grp} | set(event.inputs) | set(event.outputs)
    elif isinstance(event, LocalEvent):
        ranks = set(event.inputs) | set(event.outputs)
    elif isinstance(event, RedistributeEvent) and event.before is not None:
        ranks = set(event.before.ranks)
    t = Trace(max(ranks, default=0) + 1, backend="event")
    t.events = [event]
    return t
