"""Text renderings: deterministic, one line per event, for terminals, tests and saved notebooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..trace import CollectiveEvent, Event, TensorSnapshot, Trace


def _shape(s: TensorSnapshot | list[TensorSnapshot] | None) -> str:
    if s is None:
        return "-"
    if isinstance(s, list):
        if not s:
            return "[]"
        first = s[0]
        same = all(x.shape == first.shape for x in s)
        return f"{len(s)}x{_dims(first.shape)}" if same else "[" + ", ".join(_dims(x.shape) for x in s) + "]"
    return _dims(s.shape)


def _dims(shape: tuple[int, ...]) -> str:
    return "(" + ",".join(str(d) for d in shape) + ")"


def _groups(e: CollectiveEvent) -> str:
    if not e.groups:
        return "groups []"
    if len(e.groups) <= 4:
        return "groups " + " ".join("[" + ",".join(str(r) for r in g) + "]" for g in e.groups)
    head = " ".join("[" + ",".join(str(r) for r in g) + "]" for g in e.groups[:2])
    return f"groups {head} ... ({len(e.groups)} groups of {len(e.groups[0])})"


def _dtype(e: CollectiveEvent) -> str:
    for snaps in (e.inputs, e.outputs):
        for v in snaps.values():
            s = v[0] if isinstance(v, list) and v else v
            if s is not None and not isinstance(s, list):
                return s.dtype
    return ""


def event_line(e: Event) -> str:
    """One event, without nesting or source."""
    from ..trace import CollectiveEvent, LocalEvent, OpEvent, RedistributeEvent

    if isinstance(e, CollectiveEvent):
        parts = [e.op]
        if e.reduce_op:
            parts.append(e.reduce_op)
        if e.root is not None:
            parts.append(f"root={e.root}")
        parts.append(_groups(e))
        if e.mesh_dim is not None or e.mesh_dim_name:
            where = e.mesh_dim_name if e.mesh_dim_name else f"dim {e.mesh_dim}"
            parts.append(f"mesh {where}")
        if e.inputs or e.outputs:
            first_in = next(iter(e.inputs.values()), None)
            first_out = next(iter(e.outputs.values()), None)
            parts.append(f"{_shape(first_in)}->{_shape(first_out)}")
        dtype = _dtype(e)
        if dtype:
            parts.append(dtype)
        return " ".join(parts)
    if isinstance(e, RedistributeEvent):
        kind = "redistribute" if e.explicit else "redistribute (implicit)"
        shape = f" {_dims(e.before.global_shape)}" if e.before is not None else ""
        return f"{kind}{shape} [{', '.join(e.src)}] -> [{', '.join(e.dst)}]" + (
            f" plan {e.plan}" if e.plan else ""
        )
    if isinstance(e, LocalEvent):
        first_in = next(iter(e.inputs.values()), None)
        first_out = next(iter(e.outputs.values()), None)
        return f"local {e.name} {_shape(first_in)}->{_shape(first_out)} on every rank"
    if isinstance(e, OpEvent):
        ins = " ".join("[" + ",".join(p) + "]" for p in e.input_placements)
        outs = " ".join("[" + ",".join(p) + "]" for p in e.output_placements)
        return f"op {e.name} {ins} -> {outs or '-'}"
    if e.kind == "compute":
        parts = [getattr(e, "name", "") or "compute"]
        if getattr(e, "stage", None) is not None:
            parts.append(f"stage {e.stage}")  # type: ignore[attr-defined]
        if getattr(e, "microbatch", None) is not None:
            parts.append(f"microbatch {e.microbatch}")  # type: ignore[attr-defined]
        return " ".join(parts) + f" on ranks {list(getattr(e, 'ranks', ()))}"
    return e.kind


def trace_text(trace: Trace) -> str:
    lines = [f"Trace: {trace.backend}, {trace.world_size} ranks, {len(trace.events)} events"]
    depth: dict[int, int] = {}
    for e in trace.events:
        d = depth[e.parent] + 1 if e.parent is not None and e.parent in depth else 0
        depth[e.id] = d
        ctx = []
        if e.module:
            ctx.append(e.module)
        if e.phase:
            ctx.append(e.phase)
        where = f" [{' '.join(ctx)}]" if ctx else ""
        src = f"  <- {e.source.text}" if e.source is not None and e.source.text else ""
        lines.append(f"{'  ' * d}#{e.id} {event_line(e)}{where}{src}")
    if trace.values_dropped_from is not None:
        lines.append(f"(values kept until the budget ran out at event #{trace.values_dropped_from})")
    lines.extend(f"note: {n}" for n in getattr(trace, "notes", ()))
    return "\n".join(lines)
