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
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import traitlets
from anywidget.experimental import command

from ..data.numerics import NumericsReport
from . import geometry as g
from . import html
from .numerics_agreement import row_agreement
from .numerics_tree import heat_range, row_lines, summary
from .widgets import EXPORT_VALUES_BUDGET, STATIC, StaticFallback, esm_source

SYNCED = ("summary", "selected", "title")


def css() -> str:
    """The layout view's CSS (for the layout drawn inline) and the report's own."""
    return "\n".join((STATIC / f).read_text(encoding="utf-8") for f in ("layout.css", "numerics.css"))


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

        return plot_numerics(
            self._report, title=self.title or None, row=self.selected if self.selected >= 0 else None
        )

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
