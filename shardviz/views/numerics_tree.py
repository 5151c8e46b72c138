"""The numerics report as plain data for its widget and its picture: the module tree with the
worst error and status of every line, the header without what the open row says, a row in words
without its events, and the span of a row's error heat-map."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..data.numerics import DiffRow, NumericsReport, describe_row

# Worst status first: a module line shows the worst of the rows under it.
_SEVERITY = {"ok": 0, "missing": 1, "unassembled": 2, "replicas": 3, "shape": 4, "differs": 5}


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
    errors, so that a tensor wrong everywhere still shows which elements are worse (a fixed scale
    drew it as one saturated block). At least one decade."""
    finite = err[np.isfinite(err) & (err > 0)]
    if not finite.size:
        return -1.0, 1.0
    lo = math.floor(math.log10(max(float(finite.min()), 1e-6)))
    hi = math.ceil(math.log10(float(finite.max())))
    return float(lo), float(hi if hi > lo else lo + 1)
