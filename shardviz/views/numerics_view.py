"""The numerics report widget: the module tree coloured by error; a row opens its tensor's layout
with a per-element error heat-map and the collectives that ran just before it.

Synced traits stay few and small: ``summary`` (the report's header lines and one list per column,
one entry per line of the module tree), ``selected`` (the row whose detail is open; -1: none)
and ``title``. A row's detail comes on demand through the ``detail`` command ({"row": i} → its
description, its layout's geometry payload, the trace events before it, and its per-element
error as one binary buffer).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import traitlets
from anywidget.experimental import command

from ..data.numerics import DiffRow, NumericsReport, describe_row
from . import geometry as g
from . import html
from .numerics_agreement import row_agreement
from .widgets import EXPORT_VALUES_BUDGET, STATIC, StaticFallback, esm_source

SYNCED = ("summary", "selected", "title")

# Worst status first: a module line shows the worst of the rows under it.
_SEVERITY = {"ok": 0, "missing": 1, "unassembled": 2, "replicas": 3, "shape": 4, "differs": 5}


def css() -> str:
    """The layout view's CSS (for the layout drawn inline) and the report's own."""
    return "\n".join((STATIC / f).read_text(encoding="utf-8") for f in ("layout.css", "numerics.css"))


def _finite(x: float | None) -> float | None:
    """A number JSON can carry: None for NaN, a large finite number for infinity."""
    if x is None or math.isnan(x):
        return None
    if math.isinf(x):
        return 1e300 if x > 0 else -1e300
    return float(x)


def summary(report: NumericsReport) -> dict[str, Any]:
    """The synced payload: the module tree as lines, each a module (with the worst error and
    status under it) or a row of the report (an index into ``report.rows``)."""
    index = {id(r): i for i, r in enumerate(report.rows)}
    tree = report.tree()
    lines: dict[str, list[Any]] = {"depth": [], "name": [], "row": [], "worst": [], "status": []}
    first = report.first
    # The worst error and status of each module line: over the rows until the next line of the
    # same or a lower depth.
    for k, (depth, name, row) in enumerate(tree):
        lines["depth"].append(depth)
        lines["name"].append(name or "")
        if row is not None:
            lines["row"].append(index[id(row)])
            lines["worst"].append(_finite(row.worst))
            lines["status"].append(row.status)
            continue
        worst: float | None = None
        status = "ok"
        for d, _, r in tree[k + 1 :]:
            if d <= depth and r is None:
                break
            if r is None:
                continue
            if r.worst is not None and (worst is None or r.worst > worst):
                worst = r.worst
            if _SEVERITY[r.status] > _SEVERITY[status]:
                status = r.status
        lines["row"].append(-1)
        lines["worst"].append(_finite(worst))
        lines["status"].append(status)
    rows = report.rows
    return {
        "head": head_lines(report),
        "reference": report.reference,
        "parallel": report.parallel,
        "first": index[id(first)] if first is not None else -1,
        "differ": len(report.differences),
        "lines": lines,
        "rows": {
            "module": [r.module for r in rows],
            "what": [r.what for r in rows],
            "call": [r.key.call for r in rows],
            "phase": [r.phase for r in rows],
            "shape": [list(r.shape) if r.shape is not None else None for r in rows],
            "dtype": [r.dtype for r in rows],
            "max_abs": [_finite(r.max_abs) for r in rows],
            "max_rel": [_finite(r.max_rel) for r in rows],
            "worst": [_finite(r.worst) for r in rows],
            "status": [r.status for r in rows],
            "tolerance": [str(r.tolerance) for r in rows],
        },
    }


def head_lines(report: NumericsReport) -> list[str]:
    """The summary without the first difference's description: the widget opens that row, whose
    detail says it once."""
    lines = report.summary().splitlines()
    first = report.first
    if first is None:
        return lines
    own = set(describe_row(first, "first difference: "))
    return [line for line in lines if line not in own]


def row_lines(row: DiffRow) -> list[str]:
    """A row in words, less the events (the detail lists them once, each with its id)."""
    lines = describe_row(row)
    for k, line in enumerate(lines):
        if line.startswith("  collectives and redistributes "):
            return lines[:k]
    return lines


def heat_range(err: np.ndarray) -> tuple[float, float]:
    """log10 of the smallest and largest error the heat-map spans: the row's own nonzero finite
    errors (so a wrong block shows its structure rather than one saturated colour), and always
    the tolerance (1) inside it."""
    finite = err[np.isfinite(err) & (err > 0)]
    if not finite.size:
        return -1.0, 1.0
    lo = math.floor(math.log10(max(float(finite.min()), 1e-6)))
    hi = math.ceil(math.log10(float(finite.max())))
    lo, hi = min(lo, -1), max(hi, 1)
    return float(lo), float(hi if hi > lo else lo + 1)


def detail(report: NumericsReport, i: int) -> tuple[dict[str, Any], list[bytes]]:
    """What the ``detail`` command answers for row ``i``: its description, layout geometry,
    events, and its per-element error (in units of the tolerance) as one buffer."""
    if not 0 <= i < len(report.rows):
        return {"error": f"no row {i} (this report has {len(report.rows)})"}, []
    row = report.rows[i]
    out: dict[str, Any] = {
        "row": i,
        "lines": row_lines(row),
        "agreement": row_agreement(row),
        "geometry": g.payload(row.layout) if row.layout is not None else None,
        "inferred": row.inferred,
        "index": list(row.index) if row.index is not None else None,
        "ranks": list(row.ranks),
        "events": [{"id": e.id, "kind": e.kind, "text": e.text} for e in row.events],
        "events_during": row.events_during,
    }
    if row.error is None:
        return out, []
    err = np.asarray(row.error, dtype=np.float64)
    lo, hi = heat_range(err)
    out["heat_range"] = [lo, hi]
    out["nonfinite"] = int(np.count_nonzero(~np.isfinite(err)))
    err = np.where(np.isfinite(err), err, 3e38).astype(np.float32)
    meta, data = g.encode(err, "float32")
    out["heat"] = meta
    return out, [data]


class NumericsWidget(StaticFallback, anywidget.AnyWidget):
    """A NumericsReport: its module tree coloured by error; click a row for its tensor."""

    _esm = esm_source("numerics")
    _css = css()

    summary = traitlets.Dict().tag(sync=True)
    selected = traitlets.Int(-1).tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self, report: NumericsReport, *, selected: int | None = None, title: str | None = None
    ) -> None:
        if not isinstance(report, NumericsReport):
            raise TypeError(f"NumericsWidget needs a shardviz NumericsReport, not {type(report).__name__}")
        if selected is None:
            first = report.first
            sel = report.rows.index(first) if first is not None else -1
        elif (
            isinstance(selected, bool)
            or not isinstance(selected, int)
            or not -1 <= selected < len(report.rows)
        ):
            raise ValueError(f"selected={selected!r}: a row index (0-{len(report.rows) - 1}) or -1 for none")
        else:
            sel = selected
        self._report = report
        super().__init__(summary=summary(report), selected=sel, title=title or "")

    @property
    def report(self) -> NumericsReport:
        return self._report

    @command
    def detail(self, msg: Any, buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """``{"row": i}`` → row i's description, layout, events and per-element error."""
        i = msg.get("row") if isinstance(msg, dict) else None
        if isinstance(i, bool) or not isinstance(i, int):
            return {"error": f"bad request {msg!r}: expected {{'row': <int>}}"}, []
        return detail(self._report, i)

    def __repr__(self) -> str:
        r = self._report
        first = r.first
        where = f", first={first.module} {first.phase} {first.what}" if first is not None else ""
        return (
            f"NumericsWidget({r.parallel!r} vs {r.reference!r}, rows={len(r.rows)}, "
            f"differ={len(r.differences)}{where})"
        )

    def text(self) -> str:
        return str(self._report)

    def figure(self) -> Any:
        from .numerics_mpl import plot_numerics

        return plot_numerics(self._report, title=self.title or None)

    def export_html(self, path: str | Path, *, values_budget: int = EXPORT_VALUES_BUDGET) -> Path:
        """One self-contained HTML file: the tree, and each row's detail while they fit in
        ``values_budget`` bytes (the first difference first, then rows in order)."""
        responses: list[html.Response] = []
        used = 0
        order = list(range(len(self._report.rows)))
        if self.selected >= 0:
            order.remove(self.selected)
            order.insert(0, self.selected)
        for i in order:
            reply, bufs = detail(self._report, i)
            used += len(json.dumps(reply)) + sum(len(b) for b in bufs)
            if used > values_budget:
                break
            responses.append(("detail", {"row": i}, reply, bufs))
        state = {k: getattr(self, k) for k in SYNCED}
        r = self._report
        return html.export(
            "numerics",
            state,
            None,
            esm_source("numerics"),
            css(),
            path,
            responses=responses,
            title=f"shardviz numerics: {r.parallel} against {r.reference}",
        )
