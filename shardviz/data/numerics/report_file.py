"""A numerics report read back from disk (``sv.load``): ``report_write`` writes it, this reads it
back equal.

The file is a trace file's container (``trace_file.write``: a zip of one JSON document and
``.npy`` arrays, never pickle) holding ``report.json`` of format ``shardviz-numerics``, with the
parallel run's trace embedded as a trace file holds it. Reading a stranger's report goes through
the same bounded reader as a trace (``trace_read.open_document``: every size checked before it
is read, every array's header against the shape and dtype the document gives it) and checks each
field as it is decoded; a bad file is a ``TraceFileError`` naming the file and the field.
"""

from __future__ import annotations

import stat
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from ..layout_read import decode_layout
from ..limits import Bad, Limits, array, boolean, integer, mapping, opt_integer, opt_string, resolve, string
from ..trace_file import Arrays
from ..trace_read import TensorFromValues, decode_trace, open_document
from .assembly import Disagreement
from .report import STATUSES, DiffRow, NumericsReport
from .report_write import FORMAT, MEMBER, VERSION
from .run import KINDS, EventNote, RowKey
from .tolerance import Tolerance, ToleranceSpec

KIND = "shardviz numerics report"


# --- reading ---------------------------------------------------------------------------------


def load_report(
    path: str | Path, *, limits: Limits | None = None, tensor: TensorFromValues | None = None
) -> NumericsReport:
    """Read a report written by ``save_report`` (``limits``: as for a trace file)."""
    lim = limits if limits is not None else resolve()
    with open_document(path, lim, member=MEMBER, fmt=FORMAT, version=VERSION, kind=KIND) as (doc, arrays):
        try:
            return _decode(doc, arrays, lim, tensor)
        except Bad as e:
            raise e.error(str(path), MEMBER) from None


def is_report(path: Any) -> bool:
    """Whether ``path`` is a regular file, a zip holding a report (its directory read, nothing
    decompressed); anything else is left to the trace loaders and their errors."""
    try:
        p = Path(path)
        if not stat.S_ISREG(p.stat().st_mode):
            return False
        with zipfile.ZipFile(p) as z:
            return MEMBER in z.namelist()
    except (OSError, TypeError, ValueError, zipfile.BadZipFile, NotImplementedError, RuntimeError):
        return False


def _field(d: dict[str, Any], name: str, decode: Any, *args: Any) -> Any:
    if name not in d:
        raise Bad("a value (the field is missing)", None, name)
    try:
        return decode(d[name], *args)
    except Bad as e:
        raise e.at(name) from None


def _decode(
    doc: dict[str, Any], arrays: Arrays, lim: Limits, tensor: TensorFromValues | None
) -> NumericsReport:
    world = _field(doc, "world_size", integer, 1, lim.world_size + 1)
    trace = None
    if doc.get("trace") is not None:
        trace = _field(doc, "trace", lambda v: decode_trace(mapping(v), arrays, lim, tensor))
    rows = _field(doc, "rows", _items, _decode_row, arrays, world)
    return NumericsReport(
        reference=_field(doc, "reference", string),
        parallel=_field(doc, "parallel", string),
        root=_field(doc, "root", string),
        modules=_field(doc, "modules", _modules),
        rows=tuple(rows),
        world_size=world,
        tolerance=_field(doc, "tolerance", _spec),
        trace=trace,
        notes=_field(doc, "notes", _strings),
    )


def _items(v: Any, decode: Any, *args: Any) -> list[Any]:
    """A JSON list, each item decoded by ``decode(item, *args)``."""
    return [_at(i, decode, x, *args) for i, x in enumerate(array(v))]


def _at(part: str | int, decode: Any, *args: Any) -> Any:
    try:
        return decode(*args)
    except Bad as e:
        raise e.at(part) from None


def _strings(v: Any) -> tuple[str, ...]:
    return tuple(_at(i, string, x) for i, x in enumerate(array(v)))


def _modules(v: Any) -> tuple[tuple[str, str], ...]:
    out = []
    for i, m in enumerate(array(v)):
        if type(m) is not list or len(m) != 2 or any(type(x) is not str for x in m):
            raise Bad("a [path, class name] pair", m, i)
        out.append((m[0], m[1]))
    return tuple(out)


def _float(v: Any) -> float:
    if type(v) is str and v in ("nan", "inf", "-inf"):
        return float(v)
    if type(v) in (int, float):
        return float(v)
    raise Bad('a number (or "nan", "inf", "-inf")', v)


def _opt_float(v: Any) -> float | None:
    return None if v is None else _float(v)


def _tolerance(v: Any) -> Tolerance:
    d = mapping(v)
    t = Tolerance(
        _field(d, "rtol", _nonneg),
        _field(d, "atol", _nonneg),
        _field(d, "scale", _opt_float),
        _field(d, "floor", _nonneg),
        _field(d, "dtype", opt_string),
    )
    return t


def _nonneg(v: Any) -> float:
    x = _float(v)
    if not x >= 0:
        raise Bad("a number >= 0", v)
    return x


def _spec(v: Any, depth: int = 0) -> ToleranceSpec:
    if v is None:
        return None
    d = mapping(v)
    if len(d) != 1:
        raise Bad("one of number, pair, tolerance, by_dtype", v)
    ((kind, x),) = d.items()
    if kind == "number":
        return _at(kind, _nonneg, x)
    if kind == "pair":
        if type(x) is not list or len(x) != 2:
            raise Bad("[rtol, atol]", x, kind)
        return (_at(kind, _nonneg, x[0]), _at(kind, _nonneg, x[1]))
    if kind == "tolerance":
        return _at(kind, _tolerance, x)
    if kind == "by_dtype" and depth == 0:
        return {str(k): _at(k, _spec, y, 1) for k, y in mapping(x).items()}
    raise Bad("one of number, pair, tolerance, by_dtype", kind)


def _ints(v: Any, lo: int | None = 0) -> tuple[int, ...]:
    return tuple(_at(i, integer, x, lo) for i, x in enumerate(array(v)))


def _opt_shape(v: Any) -> tuple[int, ...] | None:
    return None if v is None else _ints(v)


def _ranks(v: Any, world: int) -> tuple[int, ...]:
    return tuple(_at(i, integer, x, 0, world) for i, x in enumerate(array(v)))


def _value(v: Any) -> Any:
    d = mapping(v)
    if "v" in d:
        x = d["v"]
        if x is not None and type(x) not in (bool, int):
            raise Bad("a whole number, a boolean or null", x, "v")
        return x
    if "complex" in d:
        x = d["complex"]
        if type(x) is not list or len(x) != 2:
            raise Bad("[real, imaginary]", x, "complex")
        return complex(_float(x[0]), _float(x[1]))
    return _field(d, "float", _float)


def _array(v: Any, arrays: Arrays, what: str) -> np.ndarray | None:
    if v is None:
        return None
    d = mapping(v)
    shp = _field(d, "shape", _ints)
    name = _field(d, "dtype", string)
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise Bad("a numpy dtype name", name, "dtype") from None
    try:
        return arrays.get(d.get("array"), shp, frozenset({dtype}), what)
    except Bad as e:
        raise e.at("array") from None


def _disagreement(v: Any, arrays: Arrays, world: int) -> Disagreement:
    d = mapping(v)
    groups = tuple(_field(d, "groups", _items, _ranks, world))
    values = _field(d, "values", _items, _array, arrays, "a copy's value")
    if any(a is None for a in values):
        raise Bad("an array per group", None, "values")
    return Disagreement(
        scope=_field(d, "scope", string),
        groups=groups,
        max_abs=_field(d, "max_abs", _float),
        index=_field(d, "index", _ints),
        values=tuple(values),
    )


def _event(v: Any, world: int) -> EventNote:
    d = mapping(v)
    return EventNote(
        id=_field(d, "id", integer),
        kind=_field(d, "kind", string),
        text=_field(d, "text", string),
        module=_field(d, "module", opt_string),
        phase=_field(d, "phase", opt_string),
        parent=_field(d, "parent", opt_integer),
    )


def _key(v: Any) -> RowKey:
    if type(v) is not list or len(v) != 4:
        raise Bad("[module, call, kind, slot]", v)
    module, call, kind, slot = v
    if type(module) is not str or type(slot) is not str or kind not in KINDS:
        raise Bad(f"[module, call, kind (one of {', '.join(KINDS)}), slot]", v)
    return RowKey(module, integer(call), kind, slot)


def _decode_row(v: Any, arrays: Arrays, world: int) -> DiffRow:
    d = mapping(v)
    status = _field(d, "status", string)
    if status not in STATUSES:
        raise Bad(f"one of {', '.join(STATUSES)}", status, "status")
    values = None if d.get("values") is None else _field(d, "values", _items, _value)
    if values is not None and len(values) != 2:
        raise Bad("[parallel value, reference value]", values, "values")
    spans = tuple(tuple(runs) for runs in _field(d, "spans", _items, _items, _span))
    error = _field(d, "error", _array, arrays, "the row's error")
    shp = _field(d, "shape", _opt_shape)
    if error is not None and shp is not None and error.shape != shp:
        raise Bad(f"an error array of the row's shape {list(shp)}", list(error.shape), "error")
    return DiffRow(
        key=_field(d, "key", _key),
        module=_field(d, "module", string),
        status=status,
        dtype=_field(d, "dtype", string),
        shape=shp,
        tolerance=_field(d, "tolerance", _tolerance),
        order=_field(d, "order", integer, None),
        max_abs=_field(d, "max_abs", _opt_float),
        max_rel=_field(d, "max_rel", _opt_float),
        worst=_field(d, "worst", _opt_float),
        index=_field(d, "index", _opt_shape),
        values=(values[0], values[1]) if values is not None else None,
        count=_field(d, "count", integer),
        numel=_field(d, "numel", integer),
        spans=spans,
        ranks=_field(d, "ranks", _ranks, world),
        disagreements=tuple(_field(d, "disagreements", _items, _disagreement, arrays, world)),
        reference_disagreements=tuple(
            _field(d, "reference_disagreements", _items, _disagreement, arrays, world)
        ),
        events=tuple(_field(d, "events", _items, _event, world)),
        events_during=_field(d, "events_during", boolean),
        notes=_field(d, "notes", _strings),
        layout=None if d.get("layout") is None else _field(d, "layout", decode_layout),
        inferred=_field(d, "inferred", boolean),
        error=error,
    )


def _span(v: Any) -> tuple[int, int]:
    if type(v) is not list or len(v) != 2:
        raise Bad("[start, stop]", v)
    a, b = integer(v[0]), integer(v[1])
    if b < a:
        raise Bad("[start, stop] with start <= stop", v)
    return (a, b)
