"""Two runs side by side: every row of the parallel run against the reference's, with the
ranks holding the elements that differ, the collectives that ran just before, and a note when
copies that disagree add up to the reference (a Partial value read as replicated)."""

from __future__ import annotations

import dataclasses

import numpy as np

from ...geometry.layout import Layout
from .assembly import Disagreement, index_arrays
from .report import DiffRow, NumericsReport
from .run import Entry, EventNote, StepNumerics
from .text import rank_ranges
from .tolerance import Tolerance, ToleranceSpec, close, error_stats, looser, tolerance_for, widened


def _holding(layout: Layout | None, bad: np.ndarray) -> tuple[int, ...]:
    """Ranks whose local tensors hold any of the elements marked in ``bad``."""
    if layout is None or not bad.any():
        return ()
    out = []
    for s in layout.shards:
        if s.empty:
            continue
        if not bad.shape or bool(bad[np.ix_(*index_arrays(s.indices))].any()):
            out.append(s.rank)
    return tuple(sorted(out))


def compare(
    reference: StepNumerics,
    parallel: StepNumerics,
    tolerance: ToleranceSpec = None,
    *,
    context: int = 6,
) -> NumericsReport:
    """Every row of ``parallel`` against the same row of ``reference``; the report's first
    difference is the first row, in the parallel run's order, that differs. ``context`` is how
    many collectives and redistributes each row keeps from just before it."""
    keys = list(parallel.entries)
    keys += [k for k in reference.entries if k not in parallel.entries]
    last = max((e.order for e in parallel.entries.values()), default=0) + 1
    rows: list[DiffRow] = []
    for key in keys:
        p = parallel.entries.get(key)
        r = reference.entries.get(key)
        entry = p if p is not None else r
        assert entry is not None
        tol = looser(
            tolerance_for(p.dtype, tolerance) if p else None, tolerance_for(r.dtype, tolerance) if r else None
        )
        base = DiffRow(
            key=key,
            module=reference.name(key.module) if r is not None else parallel.name(key.module),
            status="ok",
            dtype=entry.dtype,
            shape=entry.shape,
            tolerance=tol,
            order=p.order if p is not None else last + (r.order if r is not None else 0),
        )
        if p is None or r is None:
            side = "the reference" if p is None else "the parallel run"
            rows.append(dataclasses.replace(base, status="missing", notes=(f"only in {side}",)))
            continue
        events, during = _events_for(p, parallel, context)
        notes = list(p.notes)
        if r.dtype != p.dtype:
            notes.append(f"dtype {p.dtype} here, {r.dtype} in the reference")
        row = dataclasses.replace(
            base,
            disagreements=p.disagreements,
            reference_disagreements=r.disagreements,
            events=events,
            events_during=during,
            layout=p.layout,
            inferred=p.inferred,
        )
        if p.full is None or r.full is None:
            why = p.problem if p.full is None else f"the reference: {r.problem}"
            rows.append(dataclasses.replace(row, status="unassembled", notes=(*notes, why or "no values")))
            continue
        if p.full.shape != r.full.shape:
            notes.append(f"shape {tuple(p.full.shape)} here, {tuple(r.full.shape)} in the reference")
            rows.append(dataclasses.replace(row, status="shape", notes=tuple(notes)))
            continue
        stats = error_stats(p.full, r.full, tol)
        ranks = _holding(p.layout, stats["error"] > 1)
        status = "differs" if stats["count"] else ("replicas" if p.disagreements else "ok")
        notes += [hint for d in p.disagreements if (hint := _partial_hint(d, r.full, tol))]
        rows.append(
            dataclasses.replace(
                row,
                status=status,
                max_abs=stats["max_abs"],
                max_rel=stats["max_rel"],
                worst=stats.get("worst"),
                index=stats.get("index"),
                values=stats.get("values"),
                count=stats["count"],
                numel=stats["numel"],
                spans=stats.get("spans", ()),
                ranks=ranks,
                notes=tuple(notes),
                error=stats["error"],
            )
        )
    rows.sort(key=lambda row: row.order)
    return NumericsReport(
        reference.label,
        parallel.label,
        reference.root,
        _tree(reference, parallel),
        tuple(rows),
        parallel.world_size,
        tolerance,
        parallel.trace,
    )


def _partial_hint(d: Disagreement, want: np.ndarray, tol: Tolerance) -> str | None:
    """A note when copies that should agree add up (or average) to the reference: the classic
    Partial value read as if it were replicated (an output left Partial, a missing all-reduce)."""
    values = [v for v in d.values if v.shape == want.shape]
    if len(values) < 2 or len(values) != len(d.values):
        return None
    total = np.add.reduce([widened(v).astype(np.result_type(v, np.float64)) for v in values])
    for op, candidate in (("sum", total), ("avg", total / len(values))):
        if bool(np.all(close(candidate, want, tol))):
            groups = "; ".join(rank_ranges(g) for g in d.groups)
            verb = "add up" if op == "sum" else "average"
            return (
                f"the {len(values)} differing copies (ranks {groups}) {verb} to the reference: a "
                f"Partial({op}) value used as if it were replicated (an output left Partial, or a missing "
                "all-reduce)"
            )
    return None


def _events_for(entry: Entry, run: StepNumerics, context: int) -> tuple[tuple[EventNote, ...], bool]:
    """The collectives and redistributes that ran while the row was computed (its module's own,
    for a gradient or a parameter), or else the last ones before it."""
    if entry.events is None or not run.events:
        return (), False
    start, end = entry.events
    notes = [run.events[i] for i in sorted(run.events) if i < end]
    if entry.key.kind in ("grad", "param", "weight"):
        mod = entry.key.module
        own = [
            n
            for n in notes
            if n.id >= start
            and n.module is not None
            and (n.module == "" or mod == n.module or mod.startswith(n.module + "."))
        ]
        if own:
            return tuple(own[-context:]), True
    during = [n for n in notes if n.id >= start]
    if during:
        return tuple(during[-context:]), True
    return tuple(notes[-min(context, 3) :]), False


def _tree(reference: StepNumerics, parallel: StepNumerics) -> tuple[tuple[str, str], ...]:
    mods = list(reference.modules)
    mods += [m for m in parallel.modules if m[0] not in {p for p, _ in mods}]
    return tuple(mods)
