"""The pipeline timeline of a trace: one lane per rank, forward / backward per microbatch, sends.

Pure data from a Trace (``shardviz.p2p`` records the stages' compute as ``ComputeEvent`` and the
messages as send / recv pairs): no torch. The simulator has no clock, so time is counted in steps:
every forward takes ``forward`` steps, every backward ``backward`` steps, messages take none, and
each rank does its own work in the order it did it, starting an item as soon as the rank is free
and what it received has been sent. That is the classic pipeline diagram, and its idle cells are
the bubble: ``bubble`` is the idle fraction of the ranks' time up to the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .events import CollectiveEvent, Event
from .trace import Trace

_CODES = {"forward": "F", "backward": "B", "backward_weight": "W"}


@dataclass(frozen=True, slots=True)
class Interval:
    """One stage's forward or backward of one microbatch on one rank, from ``start`` to ``end``."""

    rank: int
    start: float
    end: float
    name: str  # "forward", "backward", "backward_weight"
    stage: int | None
    microbatch: int | None
    event: int  # the ComputeEvent's id
    label: str  # "F0", or "F0s2" where a rank holds several stages


@dataclass(frozen=True, slots=True)
class Arrow:
    """A message from ``src`` (sent at ``start``) to ``dst`` (received at ``end``)."""

    src: int
    dst: int
    start: float
    end: float
    send: int  # event ids
    recv: int
    phase: str | None  # "forward" (activations), "backward" (gradients) or None (metadata, user code)
    stage: int | None
    microbatch: int | None


@dataclass(frozen=True)
class Timeline:
    """Lanes (ranks), their compute intervals and the messages between them."""

    ranks: tuple[int, ...]
    intervals: tuple[Interval, ...]
    arrows: tuple[Arrow, ...]
    makespan: float
    forward: float = 1
    backward: float = 1
    busy: dict[int, float] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """Idle fraction of the lanes that compute, up to the last step (0 with no compute)."""
        lanes = [r for r in self.ranks if self.busy.get(r)]
        if not lanes or self.makespan <= 0:
            return 0.0
        return 1 - sum(self.busy[r] for r in lanes) / (len(lanes) * self.makespan)

    def lane(self, rank: int) -> list[Interval]:
        """The rank's compute intervals, in the order it ran them."""
        return [i for i in self.intervals if i.rank == rank]

    def actions(self, rank: int) -> list[str]:
        """The rank's compute in the order it ran, e.g. ``["F0", "F1", "B0", "B1"]``."""
        return [i.label for i in self.lane(rank)]

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON for views."""
        return {
            "ranks": list(self.ranks),
            "makespan": self.makespan,
            "bubble": self.bubble,
            "intervals": [
                {
                    "rank": i.rank,
                    "start": i.start,
                    "end": i.end,
                    "name": i.name,
                    "stage": i.stage,
                    "microbatch": i.microbatch,
                    "event": i.event,
                    "label": i.label,
                }
                for i in self.intervals
            ],
            "arrows": [
                {
                    "src": a.src,
                    "dst": a.dst,
                    "start": a.start,
                    "end": a.end,
                    "send": a.send,
                    "recv": a.recv,
                    "phase": a.phase,
                    "stage": a.stage,
                    "microbatch": a.microbatch,
                }
                for a in self.arrows
            ],
        }

    def __str__(self) -> str:
        return timeline_text(self)

    def __repr__(self) -> str:
        return (
            f"<Timeline {len(self.ranks)} ranks, {len(self.intervals)} compute intervals, "
            f"{len(self.arrows)} messages, {_num(self.makespan)} steps, bubble {self.bubble:.1%}>"
        )

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def timeline(trace: Trace, forward: float = 1, backward: float = 1) -> Timeline:
    """The pipeline timeline of a trace recorded with ``sv.run(fn, threads=N)``.

    ``forward`` / ``backward`` are the steps one microbatch's forward / backward takes
    (``backward_weight`` of zero-bubble schedules takes ``backward`` too).
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"timeline needs a Trace, got {type(trace).__name__}")
    events: list[Event] = list(trace.events)
    stages_of: dict[int, set[int | None]] = {}  # None: a compute event of no stage
    for e in events:
        if e.kind == "compute":
            for r in getattr(e, "ranks", ()):
                stages_of.setdefault(r, set()).add(getattr(e, "stage", None))
    cursor: dict[int, float] = {}
    busy: dict[int, float] = {}
    sent: dict[tuple[int, int, int], float] = {}
    intervals: list[Interval] = []
    arrows: list[Arrow] = []
    for e in events:
        if e.kind == "compute":
            ranks = tuple(getattr(e, "ranks", ()))
            if not ranks:
                continue
            name = getattr(e, "name", "")
            cost = forward if name == "forward" else backward
            start = max(cursor.get(r, 0) for r in ranks)
            stage, mb = getattr(e, "stage", None), getattr(e, "microbatch", None)
            for r in ranks:
                code = _CODES.get(name, name[:1].upper() or "?")
                label = f"{code}{'' if mb is None else mb}"
                if len(stages_of.get(r, ())) > 1 and stage is not None:
                    label += f"s{stage}"
                intervals.append(Interval(r, start, start + cost, name, stage, mb, e.id, label))
                cursor[r] = start + cost
                busy[r] = busy.get(r, 0) + cost
        elif isinstance(e, CollectiveEvent) and e.op in ("send", "recv") and e.root in (0, 1):
            pipe = e.params.get("pipeline") or {}
            for g in e.groups:
                if len(g) != 2:
                    continue
                src, dst = (g[1 - e.root], g[e.root]) if e.op == "send" else (g[e.root], g[1 - e.root])
                cursor.setdefault(src, 0)
                cursor.setdefault(dst, 0)
                if e.op == "send":
                    sent[(e.id, src, dst)] = cursor[src]
                    continue
                peer = e.params.get("peer")
                t0 = sent.get((peer, src, dst), 0) if peer is not None else 0
                cursor[dst] = max(cursor[dst], t0)
                arrows.append(
                    Arrow(
                        src,
                        dst,
                        t0,
                        cursor[dst],
                        peer if peer is not None else -1,
                        e.id,
                        pipe.get("phase"),
                        pipe.get("stage"),
                        pipe.get("microbatch"),
                    )
                )
    ranks = tuple(sorted(cursor))
    makespan = max((i.end for i in intervals), default=max(cursor.values(), default=0))
    return Timeline(ranks, tuple(intervals), tuple(arrows), makespan, forward, backward, busy)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def timeline_text(tl: Timeline) -> str:
    """One row per rank, one column per step: ``F<mb>`` forward, ``B<mb>`` backward, ``.`` idle."""
    if not tl.intervals:
        lines = [f"Pipeline timeline: {len(tl.ranks)} ranks, no stage compute recorded"]
        lines += [f"  message {a.src}->{a.dst}" for a in tl.arrows]
        return "\n".join(lines)
    unit = min(min(tl.forward, tl.backward), *(i.end - i.start for i in tl.intervals))
    steps = round(tl.makespan / unit) if unit > 0 else 0
    width = max(2, *(len(i.label) for i in tl.intervals)) + 1
    head = (
        f"Pipeline timeline: {len(tl.ranks)} ranks, {_num(tl.makespan)} steps, "
        f"bubble {tl.bubble:.1%} (F forward, B backward, . idle)"
    )
    lines = [head]
    name_w = max(len(f"rank {r}") for r in tl.ranks)
    for r in tl.ranks:
        cells = ["." for _ in range(steps)]
        for i in tl.lane(r):
            a, b = round(i.start / unit), round(i.end / unit)
            for k in range(a, min(b, steps)):
                cells[k] = i.label if k == a else "="
        lines.append(f"{f'rank {r}':<{name_w}} |" + "".join(c.ljust(width) for c in cells) + "|")
    fwd = sum(1 for a in tl.arrows if a.phase == "forward")
    bwd = sum(1 for a in tl.arrows if a.phase == "backward")
    other = len(tl.arrows) - fwd - bwd
    msg = f"messages: {fwd} activations, {bwd} gradients"
    if other:
        msg += f", {other} other (metadata, user sends)"
    lines.append(msg)
    return "\n".join(lines)
