"""One trace from ranks that took different paths through the code, told by where they met.

``merge.merge`` pairs the ranks' events by position, which is right for SPMD code and refused
otherwise. Under ``sv.use("threads")`` code may branch on the rank (``if rank == 0: send``), but
shardviz knows where the ranks really met: which collective each rank's event took part in, which
message each send and receive carried, and one clock for every rank's events. The merge walks the
ranks' sequences together, taking at each step, in clock order, the ranks whose next events are
the same step (same kind, source line, module, phase, parent and call), and merges them as
``merge.merge`` would: one event with every rank's buffers and every group that ran it at once. A
collective is taken only together with every member of the meeting it was part of. Sends and
receives become the simulator's point-to-point events (``shardviz.p2p``): ``groups`` the
(source, destination) pairs, ``root`` 1 on a send and 0 on a receive, ``params["peer"]`` the id of
the matching event, ``params["process_group"]`` each pair's whole group.

For SPMD code this is exactly ``merge.merge``: every step takes every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..geometry import mesh as _mesh
from .events import CollectiveEvent, ComputeEvent, Event
from .merge import merge_event, mesh_candidates, signature
from .trace import DEFAULT_VALUE_BUDGET, Trace


@dataclass(frozen=True)
class Link:
    """What one recorded event took part in: ``("meeting", id)`` for a collective, ``("send", id)``
    or ``("recv", id)`` for a message; ``key`` orders events across ranks (the run's clock)."""

    key: int
    kind: str | None = None
    id: int | None = None
    pipeline: dict[str, Any] | None = None  # a pipeline stage's message: stage, microbatch, phase


@dataclass(frozen=True)
class Message:
    src: int
    dst: int
    tag: int
    group: tuple[int, ...]


def interleave(
    traces: Mapping[int, Trace],
    links: Mapping[int, Sequence[Link]],
    messages: Mapping[int, Message],
    backend: str,
    values: str | int = DEFAULT_VALUE_BUDGET,
    known_meshes: Sequence[dict[str, Any]] = (),
) -> Trace:
    """Merge per-rank traces (rank -> Trace, each event's ``Link`` alongside) into one Trace."""
    ranks = sorted(traces)
    world_size = traces[ranks[0]].world_size
    meshes: list[dict[str, Any]] = []
    for r in ranks:
        for m in traces[r].meshes:
            if m not in meshes:
                meshes.append(m)
    candidates = mesh_candidates([*meshes, *known_meshes])
    walk = _Walk(traces, links)
    out = Trace(world_size, backend, values)
    out.meshes = meshes
    out.complete = all(traces[r].complete for r in ranks)
    events: list[Event] = []
    p2p: dict[tuple[str, int], int] = {}  # ("send" | "recv", message id) -> merged event id
    sent = _sent_snapshots(traces, links)
    while True:
        step = walk.next_step()
        if step is None:
            break
        i = len(events)
        per_rank = {r: walk.events[r][walk.pos[r]] for r in step}
        parent = walk.parent(step[0])
        kind = walk.link(step[0]).kind
        if kind in ("send", "recv"):
            event: Event = _p2p(i, per_rank, {r: walk.link(r) for r in step}, messages, sent, candidates)
            for r in step:
                p2p[(kind, walk.link(r).id)] = i  # type: ignore[index]
        elif isinstance(head := per_rank[step[0]], ComputeEvent):  # one stage's step, on its ranks
            on = tuple(sorted({q for e in per_rank.values() for q in getattr(e, "ranks", ())}))
            event = dataclasses.replace(head, ranks=on)
        else:
            event = merge_event(i, per_rank, candidates)
        events.append(dataclasses.replace(event, id=i, parent=parent))
        walk.advance(step, i)
    for e in events:  # each point-to-point event names its peer
        if isinstance(e, CollectiveEvent) and e.op in ("send", "recv"):
            peer = "recv" if e.op == "send" else "send"
            ids = e.params.pop("_messages", [])
            e.params["peer"] = next((p2p[(peer, m)] for m in ids if (peer, m) in p2p), None)
    out.events = events
    dropped = [walk.new_id.get((r, d)) for r in ranks if (d := traces[r].values_dropped_from) is not None]
    known = [d for d in dropped if d is not None]
    out.values_dropped_from = min(known) if known else None
    return out


class _Walk:
    """A cursor into each rank's events; ``next_step`` picks the ranks whose next events merge."""

    def __init__(self, traces: Mapping[int, Trace], links: Mapping[int, Sequence[Link]]) -> None:
        # Each rank's events in the order they happened: a receive posted early (irecv) happened
        # when its data arrived. Parents still come first (a child begins after its parent).
        self.events: dict[int, list[Event]] = {}
        self.links: dict[int, list[Link]] = {}
        for r, t in traces.items():
            order = sorted(range(len(t.events)), key=lambda i: links[r][i].key)
            self.events[r] = [t.events[i] for i in order]
            self.links[r] = [links[r][i] for i in order]
        self.pos = {r: 0 for r in traces}
        self.new_id: dict[tuple[int, int], int] = {}
        self._sig: dict[tuple[int, int], str] = {}

    def link(self, r: int) -> Link:
        return self.links[r][self.pos[r]]

    def parent(self, r: int) -> int | None:
        e = self.events[r][self.pos[r]]
        return self.new_id.get((r, e.parent)) if e.parent is not None else None

    def _same_step(self, r: int) -> tuple[Any, ...]:
        """What two ranks' next events must share to be one step."""
        key = (r, self.pos[r])
        sig = self._sig.get(key)
        if sig is None:
            e = self.events[r][self.pos[r]]
            if self.link(r).kind in ("send", "recv"):
                src = (e.source.line, e.source.text) if e.source is not None else None
                sig = repr((e.kind, getattr(e, "op", None), src, e.module, e.phase, self.link(r).pipeline))
            elif isinstance(e, ComputeEvent):
                sig = repr((e.kind, e.name, e.stage, e.microbatch, e.phase))
            else:
                sig = repr(signature(dataclasses.replace(e, parent=None)))
            self._sig[key] = sig
        return (sig, self.parent(r))

    def next_step(self) -> list[int] | None:
        heads = [r for r in self.pos if self.pos[r] < len(self.events[r])]
        if not heads:
            return None
        heads.sort(key=lambda r: (self.link(r).key, r))
        for r in heads:
            step = self._step_from(r, heads)
            if step:
                return step
        return [heads[0]]  # nothing closes (async collectives crossing groups): one rank alone

    def _step_from(self, r: int, heads: list[int]) -> list[int]:
        want = self._same_step(r)
        if self.link(r).kind != "meeting":
            return sorted(q for q in heads if self._same_step(q) == want)
        # A collective is taken with its whole meeting (whatever line each member called it
        # from), and with the other groups' meetings of the same step, each whole too.
        at = {q: self.link(q).id for q in heads if self.link(q).kind == "meeting"}

        def whole(q: int) -> bool:
            return all(at.get(p) == at[q] for p in self._group(q))

        if not whole(r):
            return []
        step: set[int] = set()
        for q in at:
            if at[q] == at[r] or (self._same_step(q) == want and whole(q)):
                step.update(self._group(q))
        return sorted(step)

    def _group(self, r: int) -> tuple[int, ...]:
        e = self.events[r][self.pos[r]]
        return e.groups[0] if isinstance(e, CollectiveEvent) and e.groups else (r,)

    def advance(self, step: list[int], new_id: int) -> None:
        for r in step:
            self.new_id[(r, self.events[r][self.pos[r]].id)] = new_id
            self.pos[r] += 1


def _p2p(
    i: int,
    per_rank: Mapping[int, Event],
    links: Mapping[int, Link],
    messages: Mapping[int, Message],
    sent: Mapping[int, Any],
    candidates: list[_mesh.MeshInfo],
) -> CollectiveEvent:
    """Sends (or receives) of several ranks at one step, in the simulator's point-to-point form."""
    ranks = sorted(per_rank)
    first = per_rank[ranks[0]]
    assert isinstance(first, CollectiveEvent)
    kind = links[ranks[0]].kind
    ids = [links[r].id for r in ranks]
    msgs = [messages[m] for m in ids if m is not None and m in messages]
    pairs = tuple((m.src, m.dst) for m in msgs)
    process_groups = tuple(m.group for m in msgs)
    dim, name = (
        _mesh.find_dim(process_groups, candidates, first.mesh_dim_name) if process_groups else (None, None)
    )
    params: dict[str, Any] = {
        "tag": msgs[0].tag if msgs else 0,
        "process_group": [list(g) for g in process_groups],
        "_messages": ids,
    }
    label = links[ranks[0]].pipeline
    if label is not None:
        params["pipeline"] = dict(label)
    common: dict[str, Any] = {
        "id": i,
        "parent": first.parent,
        "source": first.source,
        "module": first.module,
        "phase": label["phase"] if label is not None else first.phase,
        "groups": pairs,
        "mesh_dim": dim,
        "mesh_dim_name": name,
        "params": params,
    }
    if kind == "send":
        return CollectiveEvent(
            op="send",
            impl=first.impl,
            root=1,
            inputs={r: per_rank[r].inputs[r] for r in ranks if r in per_rank[r].inputs},  # type: ignore[attr-defined]
            outputs={},
            nbytes={r: per_rank[r].nbytes[r] for r in ranks if r in per_rank[r].nbytes},  # type: ignore[attr-defined]
            **common,
        )
    inputs = {}
    for m, mid in zip(msgs, ids, strict=False):
        snap = sent.get(mid)  # type: ignore[arg-type]
        if snap is not None:
            inputs[m.src] = snap
    return CollectiveEvent(
        op="recv",
        impl=first.impl,
        root=0,
        inputs=inputs,
        outputs={r: per_rank[r].outputs[r] for r in ranks if r in per_rank[r].outputs},  # type: ignore[attr-defined]
        nbytes={},
        **common,
    )


def _sent_snapshots(traces: Mapping[int, Trace], links: Mapping[int, Sequence[Link]]) -> dict[int, Any]:
    """Each message's value as its sender recorded it, by message id."""
    out: dict[int, Any] = {}
    for r, t in traces.items():
        for e, link in zip(t.events, links[r], strict=True):
            if (
                link.kind == "send"
                and link.id is not None
                and isinstance(e, CollectiveEvent)
                and r in e.inputs
            ):
                out[link.id] = e.inputs[r]
    return out
