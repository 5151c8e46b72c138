"""Two runs side by side: every row of the parallel run against the reference's, with the
ranks holding the elements that differ, the collectives that ran just before, and a note when
copies that disagree add up to the reference (a Partial value read as replicated)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...geometry.layout import Layout
from .assembly import Disagreement, index_arrays
from .report import DiffRow, NumericsReport
from .run import Entry, EventNote, RowKey, StepNumerics
from .text import rank_ranges
from .tolerance import (
    ROUNDING_MARGIN,
    Tolerance,
    ToleranceSpec,
    close,
    error_stats,
    looser,
    precision,
    tolerance_for,
    widened,
)


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
    computed_in = _computation_dtypes(reference)
    loss_scale = _output_scale(reference)
    per_rank_loss = _per_rank_loss(reference, parallel, tolerance)
    rows: list[DiffRow] = []
    for key in keys:
        p = parallel.entries.get(key)
        r = reference.entries.get(key)
        entry = p if p is not None else r
        assert entry is not None
        tol = looser(
            tolerance_for(p.dtype, tolerance) if p else None, tolerance_for(r.dtype, tolerance) if r else None
        )
        if tolerance is None and p is not None and r is not None:
            tol = _by_construction(tol, key, r, p, parallel, computed_in, loss_scale, reference.rounding)
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
        got = p.full
        own_loss = per_rank_loss is not None and (key.kind == "loss" or key.kind == "grad_input")
        if per_rank_loss is not None and own_loss:
            got, note = per_rank_loss.apply(key, p)
            notes.append(note)
        stats = error_stats(got, r.full, tol)
        ranks = _holding(p.layout, stats["error"] > 1)
        agreed = own_loss and key.kind == "loss"  # copies that differ by design, combined as they should
        status = "differs" if stats["count"] else ("replicas" if p.disagreements and not agreed else "ok")
        if not agreed:
            notes += [hint for d in p.disagreements if (hint := _partial_hint(d, r.full, tol))]
        notes += _non_finite_notes(got, r.full)
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
        tuple(dict.fromkeys((*reference.notes, *parallel.notes))),
    )


def _computation_dtypes(run: StepNumerics) -> dict[RowKey, str]:
    """Each float row's dtype of computation: the least precise float dtype of the rows up to it,
    in the run's order (a float32 loss of a bfloat16 output carries bfloat16's rounding)."""
    out: dict[RowKey, str] = {}
    least: str | None = None
    for e in sorted(run.entries.values(), key=lambda e: e.order):
        bits = precision(e.dtype)
        if bits is None:
            continue
        if least is None or bits < (precision(least) or 99):
            least = e.dtype
        out[e.key] = least
    return out


def _output_scale(run: StepNumerics) -> float | None:
    """The largest magnitude in the root module's output: what the loss reduces."""
    scales = [
        v
        for k, e in run.entries.items()
        if k.module == ""
        and k.kind == "output"
        and e.full is not None
        and (v := _largest(e.full)) is not None
    ]
    return max(scales) if scales else None


def _largest(a: np.ndarray) -> float | None:
    a = np.asarray(a)
    if a.dtype.kind not in "fc" or not a.size:
        return None
    m = np.abs(widened(a))
    m = m[np.isfinite(m)]
    return float(m.max()) if m.size else None


_REDUCING = ("all_reduce", "reduce_scatter", "reduce")


def _reduction_scale(entry: Entry, run: StepNumerics) -> float | None:
    """The magnitude of the inputs of the sums over ranks that ran while the row was computed (a
    row-parallel matmul's partial sums): the rounding of a sum grows with what it adds up, not
    with the result, which may be far smaller. Per group, the sum of its ranks' largest input
    (divided by the group's size for a mean); the largest over groups and collectives."""
    trace = run.trace
    if entry.events is None or trace is None:
        return None
    start, end = entry.events
    events = getattr(trace, "events", ())
    best: float | None = None
    for i in range(max(start, 0), min(end, len(events))):
        e = events[i]
        if getattr(e, "kind", None) != "collective" or e.op not in _REDUCING:
            continue
        if e.reduce_op not in ("sum", "avg", "premul_sum", None):
            continue
        for g in e.groups:
            tops = [_snapshot_max(e.inputs.get(r)) for r in g]
            if any(t is None for t in tops):
                continue
            total = sum(t for t in tops if t is not None)
            if e.reduce_op == "avg":
                total /= len(g)
            best = total if best is None else max(best, total)
    return best


def _snapshot_max(snap: Any) -> float | None:
    snaps = snap if isinstance(snap, list | tuple) else [snap]
    out = 0.0
    for sn in snaps:
        summary = getattr(sn, "summary", None)
        if summary is None or summary.min is None or summary.max is None:
            return None
        out = max(out, abs(summary.min), abs(summary.max))
    return out


def _by_construction(
    tol: Tolerance,
    key: RowKey,
    ref: Entry,
    par: Entry,
    parallel: StepNumerics,
    computed_in: dict[RowKey, str],
    loss_scale: float | None,
    rounding: Mapping[RowKey, float],
) -> Tolerance:
    """A row's default tolerance, from how the value was made: the rule of its dtype of
    computation (not its own: a float32 loss of a bfloat16 output), relative to the magnitude of
    what produced it (the output a loss reduces, the partial sums a collective added up), plus a
    margin over the reference's own rounding error (measured in float64)."""
    if precision(ref.dtype) is None:
        return tol  # integers and booleans compare exactly
    comp = computed_in.get(key, ref.dtype)
    if (precision(comp) or 99) < (precision(ref.dtype) or 99):
        tol = looser(tol, tolerance_for(comp))
    scales = [s for s in (tol.scale, _reduction_scale(par, parallel)) if s is not None]
    if key.kind == "loss" and loss_scale is not None:
        scales.append(loss_scale)
    floor = ROUNDING_MARGIN * rounding.get(key, 0.0)
    return Tolerance(
        tol.rtol,
        tol.atol,
        max(scales) if scales else None,
        max(tol.floor, floor),
        comp if comp != ref.dtype else None,
    )


@dataclass(frozen=True)
class PerRankLoss:
    """A loss each rank computed over its own rows (hand-written data parallel): the copies differ
    by design and combine into the reference's loss with ``weights`` per rank (1 for a sum, 1/N
    for a mean, rows/total for a mean weighted by rows); the gradients of activations are each
    rank's own loss's, so they are compared times their rank's weight."""

    how: str
    weights: Mapping[int, float]
    combined: np.ndarray

    def apply(self, key: RowKey, entry: Entry) -> tuple[np.ndarray, str]:
        assert entry.full is not None
        if key.kind == "loss":
            return self.combined, (
                f"each rank computed the loss over its own rows; {self.how} is the reference's loss "
                "(compared as that)"
            )
        lay = entry.layout
        if lay is None or any(p.startswith("P") for p in lay.placements):
            return (
                entry.full,
                "the gradient of each rank's own loss, compared unscaled (its layout is unknown)",
            )
        scale = np.full(entry.full.shape, np.nan)
        for sh in lay.shards:
            if sh.empty:
                continue
            w = self.weights.get(sh.rank)
            if w is None:
                return entry.full, "the gradient of each rank's own loss, compared unscaled"
            idx = np.ix_(*index_arrays(sh.indices)) if entry.full.ndim else ()
            seen = scale[idx]
            if np.any(~np.isnan(seen) & (seen != w)):
                return entry.full, "the gradient of each rank's own loss, compared unscaled (ranks disagree)"
            scale[idx] = w
        scale = np.where(np.isnan(scale), 1.0, scale)
        return widened(entry.full) * scale, (
            "the gradient of each rank's own loss, times that rank's weight in the reference's loss "
            f"({self.how})"
        )


def _per_rank_loss(
    reference: StepNumerics, parallel: StepNumerics, tolerance: ToleranceSpec
) -> PerRankLoss | None:
    """The loss as copies per rank that combine into the reference's: only where the model's
    output is split by rows over the ranks (each rank's loss is over its own rows)."""
    key = RowKey("", 0, "loss", "")
    p, r = parallel.entries.get(key), reference.entries.get(key)
    if p is None or r is None or r.full is None or len(p.disagreements) != 1:
        return None
    (d,) = p.disagreements
    if len(d.values) != len(d.groups) or len(d.groups) < 2:
        return None
    rows = _rows_per_rank(parallel)
    if rows is None:
        return None
    tol = looser(tolerance_for(p.dtype, tolerance), tolerance_for(r.dtype, tolerance))
    tol = Tolerance(tol.rtol, tol.atol, _output_scale(reference), tol.floor)
    values = [widened(v).astype(np.float64) for v in d.values]
    n = len(values)
    total_rows = sum(rows[g[0]] for g in d.groups)
    candidates = [
        ("their sum", [1.0] * n),
        (f"their mean over the {n} copies", [1.0 / n] * n),
    ]
    if total_rows:
        candidates.append(
            ("their mean weighted by each rank's rows", [rows[g[0]] / total_rows for g in d.groups])
        )
    for how, ws in candidates:
        combined = np.add.reduce([w * v for w, v in zip(ws, values, strict=True)])
        if bool(np.all(close(combined, r.full, tol))):
            weights = {rank: w for g, w in zip(d.groups, ws, strict=True) for rank in g}
            return PerRankLoss(how, weights, combined)
    return None


def _rows_per_rank(run: StepNumerics) -> dict[int, int] | None:
    """How many rows (dim 0) of the root module's output each rank holds, when the output is
    split along dim 0 (data parallel); None otherwise."""
    for k, e in run.entries.items():
        if k.module != "" or k.kind != "output" or e.layout is None or not e.layout.global_shape:
            continue
        lay = e.layout
        if lay.global_shape[0] and all(s.shape and s.shape[0] < lay.global_shape[0] for s in lay.shards):
            return {s.rank: s.shape[0] for s in lay.shards}
    return None


def _non_finite_notes(got: np.ndarray, want: np.ndarray) -> list[str]:
    """NaN and infinities in one run only, where they are: the first row that has them is where
    they appeared (both runs holding them at the same places compare equal)."""
    if got.dtype.kind not in "fc" and want.dtype.kind not in "fc":
        return []
    g, w = widened(got), widened(want)
    out = []
    for what, bad_g, bad_w in (
        ("NaN", np.isnan(g), np.isnan(w)),
        ("inf", np.isinf(g) & ~np.isnan(w), np.isinf(w) & ~np.isnan(g)),
    ):
        for mask, here, there in (
            (bad_g & ~bad_w, "here", "the reference"),
            (bad_w & ~bad_g, "in the reference", "here"),
        ):
            n = int(mask.sum())
            if n:
                first = tuple(int(i) for i in np.argwhere(mask)[0]) if mask.ndim else ()
                at = f"first at {list(first)}" if first else "the scalar"
                out.append(f"{n} {what} {here} where {there} has a finite value ({at})")
    return out


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
