"""A numerics report written to disk (``report.save(path)``): a trace file's container (a zip of
one JSON document, ``report.json`` of format ``shardviz-numerics``, and ``.npy`` arrays; never
pickle), with the parallel run's trace embedded as a trace file holds it. ``report_file`` reads
it back."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..trace_file import Writer, write
from .assembly import Disagreement
from .tolerance import Tolerance, ToleranceSpec

FORMAT = "shardviz-numerics"
VERSION = 1
MEMBER = "report.json"


def save_report(report: Any, path: str | Path) -> Path:
    """Write ``report`` (a NumericsReport, and the parallel run's trace when it has one) to ``path``."""
    w = Writer()
    doc: dict[str, Any] = {
        "reference": report.reference,
        "parallel": report.parallel,
        "root": report.root,
        "modules": [list(m) for m in report.modules],
        "world_size": report.world_size,
        "tolerance": _spec_json(report.tolerance),
        "notes": list(report.notes),
        "rows": [_row_json(r, w) for r in report.rows],
        "trace": report.trace._document(w, results=False) if report.trace is not None else None,
    }
    return write(path, doc, w.arrays, member=MEMBER, fmt=FORMAT, version=VERSION)


def _num(x: float | None) -> Any:
    if x is None:
        return None
    x = float(x)
    return repr(x) if math.isnan(x) or math.isinf(x) else x  # JSON has no NaN or infinity


def _value_json(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, int):
        return {"v": v}
    if isinstance(v, complex):
        return {"complex": [_num(v.real), _num(v.imag)]}
    return {"float": _num(v)}


def _tol_json(t: Tolerance) -> dict[str, Any]:
    return {"rtol": t.rtol, "atol": t.atol, "scale": _num(t.scale), "floor": t.floor, "dtype": t.dtype}


def _spec_json(spec: ToleranceSpec) -> Any:
    if spec is None:
        return None
    if isinstance(spec, Tolerance):
        return {"tolerance": _tol_json(spec)}
    if isinstance(spec, Mapping):
        return {"by_dtype": {str(k): _spec_json(v) for k, v in spec.items()}}
    if isinstance(spec, tuple):
        return {"pair": [float(spec[0]), float(spec[1])]}
    return {"number": float(spec)}


def _row_json(r: Any, w: Writer) -> dict[str, Any]:
    return {
        "key": [r.key.module, r.key.call, r.key.kind, r.key.slot],
        "module": r.module,
        "status": r.status,
        "dtype": r.dtype,
        "shape": list(r.shape) if r.shape is not None else None,
        "tolerance": _tol_json(r.tolerance),
        "order": r.order,
        "max_abs": _num(r.max_abs),
        "max_rel": _num(r.max_rel),
        "worst": _num(r.worst),
        "index": list(r.index) if r.index is not None else None,
        "values": [_value_json(v) for v in r.values] if r.values is not None else None,
        "count": r.count,
        "numel": r.numel,
        "spans": [[list(run) for run in runs] for runs in r.spans],
        "ranks": list(r.ranks),
        "disagreements": [_disagreement_json(d, w) for d in r.disagreements],
        "reference_disagreements": [_disagreement_json(d, w) for d in r.reference_disagreements],
        "events": [
            {
                "id": e.id,
                "kind": e.kind,
                "text": e.text,
                "module": e.module,
                "phase": e.phase,
                "parent": e.parent,
            }
            for e in r.events
        ],
        "events_during": r.events_during,
        "notes": list(r.notes),
        "layout": r.layout.to_dict() if r.layout is not None else None,
        "inferred": r.inferred,
        "error": _array_json(r.error, w),
    }


def _array_json(a: np.ndarray | None, w: Writer) -> Any:
    if a is None:
        return None
    return {"array": w.array(a), "shape": list(a.shape), "dtype": str(a.dtype)}


def _disagreement_json(d: Disagreement, w: Writer) -> dict[str, Any]:
    return {
        "scope": d.scope,
        "groups": [list(g) for g in d.groups],
        "max_abs": _num(d.max_abs),
        "index": list(d.index),
        "values": [_array_json(v, w) for v in d.values],
    }
