"""One trace from many: merge what each real rank recorded into the simulator's schema.

A real rank sees only its own buffers and its own group; the simulator sees every rank at once.
Merging puts every rank's buffers into each event and lists every group that ran a collective at
once, so that views, files and comparisons treat a gloo or NCCL trace exactly like a simulated
one. SPMD code records the same sequence of events on every rank; when ranks disagree (code that
branches on the rank, a skipped collective), the merge refuses and says where they diverged,
because pairing unrelated events would draw a picture of something that never happened.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import ShardvizError
from ..geometry import mesh as _mesh
from . import describe
from .events import CollectiveEvent, Event, OpEvent, RedistributeEvent
from .trace import DEFAULT_VALUE_BUDGET, Trace


class SequenceMismatchError(ShardvizError, RuntimeError):
    """Ranks recorded different event sequences: the code was not SPMD, so no merge is drawn."""

    def __init__(self, message: str, index: int, by_rank: dict[int, str]) -> None:
        super().__init__(message)
        self.index = index
        self.by_rank = by_rank


def merge(
    traces: Mapping[int, Trace],
    backend: str,
    values: str | int = DEFAULT_VALUE_BUDGET,
    known_meshes: Iterable[dict[str, Any]] = (),
) -> Trace:
    """Merge per-rank traces (rank → Trace from ``record_rank``) into one Trace.

    ``known_meshes`` are meshes seen in earlier cells (``trace.meshes`` entries): a collective on a
    mesh made in another cell is still attributed to its mesh dim, as the simulator does.
    """
    if not traces:
        raise ValueError("merge needs at least one rank's trace")
    ranks = sorted(traces)
    sizes = {traces[r].world_size for r in ranks}
    if len(sizes) != 1:
        raise ValueError(f"ranks report different world sizes: {sorted(sizes)}")
    world_size = sizes.pop()
    check_sequences({r: traces[r].events for r in ranks})

    meshes = _union_meshes([m for r in ranks for m in traces[r].meshes])
    candidates = mesh_candidates([*meshes, *known_meshes])
    out = Trace(world_size, backend, values)
    out.meshes = meshes
    out.complete = all(traces[r].complete for r in ranks)
    dropped = [d for d in (traces[r].values_dropped_from for r in ranks) if d is not None]
    out.values_dropped_from = min(dropped) if dropped else None
    events = [
        merge_event(i, {r: traces[r].events[i] for r in ranks}, candidates)
        for i in range(len(traces[ranks[0]].events))
    ]
    out.events = events
    return out


def merge_event(i: int, per_rank: Mapping[int, Event], candidates: list[_mesh.MeshInfo]) -> Event:
    """One step that several ranks recorded alike (``per_rank``: rank -> its event) as one event:
    every rank's buffers, every group that ran it. ``candidates``: see ``mesh_candidates``."""
    first = per_rank[min(per_rank)]
    if isinstance(first, CollectiveEvent):
        return _merge_collective(i, per_rank, candidates)  # type: ignore[arg-type]
    if hasattr(first, "inputs") and hasattr(first, "outputs"):  # per-rank local compute
        return dataclasses.replace(first, inputs=_own(per_rank, "inputs"), outputs=_own(per_rank, "outputs"))  # type: ignore[call-arg]
    return first


def mesh_candidates(meshes: Iterable[dict[str, Any]]) -> list[_mesh.MeshInfo]:
    """The meshes (``trace.meshes`` entries, duplicates dropped) a merged collective's groups are
    matched against to name its mesh dim."""
    return [_mesh_info(m) for m in _union_meshes(meshes)]


def check_sequences(events: Mapping[int, Sequence[Event]]) -> None:
    """Raise SequenceMismatchError at the first event where the ranks' sequences differ."""
    ranks = sorted(events)
    longest = max(len(events[r]) for r in ranks)
    for i in range(longest):
        sigs = {r: signature(events[r][i]) if i < len(events[r]) else None for r in ranks}
        if len({repr(s) for s in sigs.values()}) == 1:
            continue
        by_rank = {
            r: describe.brief(events[r][i], group_too=False)
            if i < len(events[r])
            else f"nothing: it recorded {len(events[r])} events"
            for r in ranks
        }
        raise SequenceMismatchError(_mismatch_message(i, by_rank), i, by_rank)


def signature(e: Event) -> tuple[Any, ...]:
    """What must agree across ranks for two events to be the same SPMD step."""
    src = (e.source.line, e.source.text) if e.source is not None else None
    base: tuple[Any, ...] = (e.kind, e.parent, src, e.module, e.phase)
    if isinstance(e, CollectiveEvent):
        return (*base, e.op, e.impl, e.reduce_op, e.root)
    if isinstance(e, RedistributeEvent):
        return (*base, e.src, e.dst, e.plan, e.explicit, e.before, e.after)
    if isinstance(e, OpEvent):
        return (*base, e.name, e.input_placements, e.output_placements)
    return (*base, getattr(e, "name", None))


def _mismatch_message(i: int, by_rank: dict[int, str]) -> str:
    groups: dict[str, list[int]] = {}
    for r, d in by_rank.items():
        groups.setdefault(d, []).append(r)
    lines = [
        f"the ranks recorded different sequences of events (code that branches on the rank, or a "
        f"skipped collective), so they cannot be merged into one trace. First difference at event #{i}:"
    ]
    for d, rs in sorted(groups.items(), key=lambda kv: kv[1]):
        lines.append(f"  {_ranks_text(rs)}: {d}")
    return "\n".join(lines)


def _ranks_text(ranks: Sequence[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def _merge_collective(
    i: int, per_rank: Mapping[int, CollectiveEvent], candidates: list[_mesh.MeshInfo]
) -> CollectiveEvent:
    groups = _merge_groups(i, per_rank)
    names = {e.mesh_dim_name for e in per_rank.values()}
    hint = names.pop() if len(names) == 1 else None
    first = per_rank[min(per_rank)]
    dim, name = _mesh.find_dim(groups, candidates, hint)
    if dim is None and name is None:
        dim, name = first.mesh_dim, first.mesh_dim_name
    if all(e.params.get(_mesh.DEFAULT_GROUP) for e in per_rank.values()):
        dim, name = None, None  # a raw dist.* call on the default group, as in the simulator
    return dataclasses.replace(
        first,
        groups=groups,
        inputs=_own(per_rank, "inputs"),
        outputs=_own(per_rank, "outputs"),
        nbytes=_own(per_rank, "nbytes"),
        mesh_dim=dim,
        mesh_dim_name=name,
    )


def _own(per_rank: Mapping[int, Event], attr: str) -> dict[int, Any]:
    """Each rank's own entry of a per-rank field: a real rank knows only its own buffers."""
    out = {}
    for r in sorted(per_rank):
        d = getattr(per_rank[r], attr)
        if r in d:
            out[r] = d[r]
    return out


def _merge_groups(i: int, per_rank: Mapping[int, CollectiveEvent]) -> tuple[tuple[int, ...], ...]:
    """The distinct groups the ranks reported, sorted; each rank in exactly one of them."""
    reported: dict[int, tuple[int, ...]] = {}
    for r, e in per_rank.items():
        if len(e.groups) != 1 or r not in e.groups[0]:
            raise SequenceMismatchError(
                f"event #{i}: rank {r} reported groups {list(map(list, e.groups))}; a real rank reports "
                "exactly its own group",
                i,
                {r: describe.brief(e)},
            )
        reported[r] = tuple(sorted(e.groups[0]))
    for r, g in reported.items():
        for other in g:
            if other in reported and reported[other] != g:
                by_rank = {r: describe.brief(per_rank[r]), other: describe.brief(per_rank[other])}
                raise SequenceMismatchError(
                    f"event #{i}: rank {r} ran it on group {list(g)} but rank {other} on group "
                    f"{list(reported[other])}; the ranks disagree on who takes part",
                    i,
                    by_rank,
                )
    return tuple(sorted(set(reported.values())))


def _mesh_info(m: dict[str, Any]) -> _mesh.MeshInfo:
    names = m.get("mesh_dim_names")
    return (tuple(m["mesh_shape"]), tuple(names) if names else None, tuple(m["ranks"]))


def _union_meshes(meshes: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    seen: set[_mesh.MeshInfo] = set()
    out = []
    for m in meshes:
        key = _mesh_info(m)
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def common_prefix(events: Mapping[int, Sequence[Event]]) -> int:
    """How many leading events every rank recorded alike (the length of the SPMD prefix)."""
    ranks = sorted(events)
    shortest = min(len(events[r]) for r in ranks)
    for i in range(shortest):
        if len({repr(signature(events[r][i])) for r in ranks}) != 1:
            return i
    return shortest


def merge_partial(
    traces: Mapping[int, Trace],
    backend: str,
    values: str | int = DEFAULT_VALUE_BUDGET,
    world_size: int | None = None,
) -> Trace:
    """Merge what ranks recorded even when they did not all get as far, or took different paths.

    For a job's folder of per-rank traces, where a rank may have died, hung or diverged: the result
    holds the events every rank recorded alike (the common prefix), ``complete`` is False when
    anything is missing, and ``trace.notes`` says which rank stopped where and what the others did
    next. Ranks with no trace at all (``world_size`` larger than the ranks given) are named too.
    When every rank recorded the same whole sequence this is ``merge``.
    """
    if not traces:
        raise ValueError("merge_partial needs at least one rank's trace")
    ranks = sorted(traces)
    world_size = world_size or max(t.world_size for t in traces.values())
    absent = _absent_runs(ranks, world_size)
    events = {r: traces[r].events for r in ranks}
    n = common_prefix(events)
    same_length = len({len(e) for e in events.values()}) == 1
    whole = same_length and n == len(events[ranks[0]])
    while True:
        cut = {r: _truncated(traces[r], n) for r in ranks}
        try:
            out = merge(cut, backend, values)
            break
        except SequenceMismatchError as e:  # groups that disagree inside the common prefix
            if e.index >= n:
                raise
            n, whole = e.index, False
    out.world_size = world_size
    ended = [traces[r].meta.get("status") for r in ranks]
    troubled = any(
        isinstance(st, dict) and (st.get("how") != "finished" or "in_collective" in st) for st in ended
    )
    notes = _partial_report(traces, n, absent) if not whole or absent or troubled else []
    stopped = {str(r): traces[r].meta.get("status") for r in ranks if traces[r].meta.get("status")}
    out.meta = {"ranks": ranks, "common_prefix": n, **({"status": stopped} if stopped else {})}
    if notes:
        out.complete = False
        out.notes = notes
        if n:
            out.meta["start_event"] = n - 1
    if any(not traces[r].complete for r in ranks) or absent:
        out.complete = False
    return out


def _truncated(trace: Trace, n: int) -> Trace:
    if n >= len(trace.events):
        return trace
    t = Trace(trace.world_size, trace.backend, trace.values)
    t.events = trace.events[:n]  # parents come before their children: the prefix is closed
    t.meshes = trace.meshes
    t.complete = False
    vd = trace.values_dropped_from
    t.values_dropped_from = vd if vd is not None and vd < n else None
    return t


def _partial_report(traces: Mapping[int, Trace], n: int, absent: Sequence[tuple[int, int]]) -> list[str]:
    ranks = sorted(traces)
    events = {r: traces[r].events for r in ranks}
    last = f"event #{n - 1} ({describe.brief(events[ranks[0]][n - 1])})" if n else "no event"
    if all(len(events[r]) == n for r in ranks):
        lines = [f"every rank recorded the same {_events(n)}, but not every rank ended normally"]
    else:
        lines = [
            f"the ranks recorded the same first {_events(n)}; this trace holds those (up to {last}), "
            "not what came after"
        ]
    went_on: dict[str, list[int]] = {}
    for r in ranks:
        status = _status_text(traces[r])
        if len(events[r]) > n:
            went_on.setdefault(describe.brief(events[r][n]), []).append(r)
            continue
        st = traces[r].meta.get("status")
        ended_normally = isinstance(st, dict) and st.get("how") == "finished" and "in_collective" not in st
        if ended_normally and all(len(events[q]) == n for q in ranks):
            continue
        after = (
            f"after event #{n - 1} ({describe.brief(events[r][n - 1])})"
            if n
            else "before recording any event"
        )
        lines.append(f"rank {r} stopped {after}{status}")
    for d, rs in sorted(went_on.items(), key=lambda kv: kv[1]):
        counts = sorted({len(events[r]) for r in rs})
        lines.append(
            f"{_ranks_text(rs)} went on to #{n}: {d} ({'/'.join(map(str, counts))} "
            f"event{'s' if counts != [1] else ''} recorded)"
            + "".join(f"; rank {r}{_status_text(traces[r])}" for r in rs if _status_text(traces[r]))
        )
    if len(went_on) > 1:
        lines.append(f"the ranks that went on disagree at #{n}: code that branches on the rank")
    for lo, hi in absent:
        who = f"rank {lo}" if lo == hi else f"ranks {lo}-{hi}"
        lines.append(f"{who}: no trace (it died before shardviz wrote its file, or never started recording)")
    return lines


def _absent_runs(ranks: Sequence[int], world_size: int) -> list[tuple[int, int]]:
    """The ranks below ``world_size`` missing from the sorted ``ranks``, as (first, last) runs: one
    line per run however large the world."""
    out, start = [], 0
    for r in [*(r for r in ranks if r < world_size), world_size]:
        if r > start:
            out.append((start, r - 1))
        start = max(start, r + 1)
    return out


def _events(n: int) -> str:
    return f"{n} event{'s' if n != 1 else ''}"


def _status_text(trace: Trace) -> str:
    """A job rank's own account of how it ended (``trace.meta['status']``, see shardviz.job)."""
    st = trace.meta.get("status")
    if not isinstance(st, dict):
        return ""
    parts = []
    how = st.get("how")
    if how == "error":
        parts.append(f"it raised {str(st.get('error', 'an error'))[:200]}")
    elif how == "signal":
        parts.append(f"it was stopped by {st.get('signal', 'a signal')}")
    elif how == "running":
        parts.append(
            "its file was last written while it ran (then it was killed, or it still hangs): what "
            "it did after that is unknown"
        )
    elif how == "finished":
        parts.append("it finished normally")
    elif how == "exit":
        parts.append(f"it called sys.exit({st.get('exit_code')!r}) inside the recorded block")
    pending = st.get("in_collective")
    if isinstance(pending, dict):
        where = f" (line {pending['line']}: {pending.get('text', '')})" if pending.get("line") else ""
        group = ",".join(str(x) for x in pending.get("group", ()))
        parts.append(f"it was inside {pending.get('op')} on group [{group}]{where}, never finished")
    return ": " + "; ".join(parts) if parts else ""
