"""Text renderings: deterministic, one line per event, for terminals, tests and saved notebooks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..data import describe

if TYPE_CHECKING:
    from ..data.trace import Trace


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
        lines.append(f"{'  ' * d}#{e.id} {describe.line(e)}{where}{src}")
    if trace.values_dropped_from is not None:
        lines.append(f"(values kept until the budget ran out at event #{trace.values_dropped_from})")
    lines.extend(f"note: {n}" for n in getattr(trace, "notes", ()))
    return "\n".join(lines)
