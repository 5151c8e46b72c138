"""When two values of a row count as equal: per-dtype tolerances, element-wise closeness with NaN
and infinities handled, and how far one tensor is from another in units of its tolerance.

Used by the assembler (replicas that should agree) and by the comparison of two runs alike, so
both hold copies to the same rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Tolerance:
    """When two values of one row count as equal: ``|a - b| <= atol * S + rtol * |b| + floor``,
    where ``b`` is the reference and ``S`` the largest ``|b|`` in the tensor, or ``scale`` when
    that is larger. ``atol`` is relative to the tensor's scale so that a gradient of size 1e-4 and
    an activation of size 10 are held to the same relative precision; zero for both means exact
    (integers, booleans).

    Built by ``sv.diff`` for each row (``comparison.row_tolerance``): ``dtype`` is the least
    precise dtype the value was computed from, ``scale`` the magnitude of what produced it (the
    inputs of a reduction, whose rounding grows with them, not with its result), ``floor`` a
    multiple of the reference's own rounding error, measured against a float64 run."""

    rtol: float
    atol: float
    scale: float | None = None
    floor: float = 0.0
    dtype: str | None = None  # the dtype of computation, when it is not the row's own

    def __str__(self) -> str:
        if not self.rtol and not self.atol and not self.floor:
            return "exact"
        of = "max|ref|" if self.scale is None else f"{self.scale:.3g} (the scale of its inputs)"
        text = f"rtol {self.rtol:g}, atol {self.atol:g} x {of}"
        if self.floor:
            text += f" + {self.floor:.2g} (the reference's own rounding, x{ROUNDING_MARGIN:g})"
        return text

    def bound_scale(self, b: np.ndarray) -> float:
        """What ``atol`` is relative to: the tensor's largest finite ``|b|``, or ``scale``."""
        own = _scale(b)
        return own if self.scale is None else max(own, self.scale)


# The reference's rounding error (against float64) is allowed this many times over: the parallel
# run rounds as often, in another order.
ROUNDING_MARGIN = 4.0


# Float reductions reordered across ranks (a sharded matmul, a reduce-scatter) differ from a
# single device's in the last bits; these leave room for that and catch anything larger.
TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-9, 1e-9),
    "complex128": Tolerance(1e-9, 1e-9),
    "float32": Tolerance(1e-5, 1e-5),
    "complex64": Tolerance(1e-5, 1e-5),
    "float16": Tolerance(1e-3, 1e-3),
    "complex32": Tolerance(1e-3, 1e-3),
    "bfloat16": Tolerance(1e-2, 1e-2),
}
_LOW_PRECISION = Tolerance(1e-1, 1e-1)  # float8 variants
EXACT = Tolerance(0.0, 0.0)

ToleranceSpec = float | tuple[float, float] | Tolerance | Mapping[str, Any] | None


def _one_tolerance(value: Any, what: str) -> Tolerance:
    if isinstance(value, Tolerance):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
        return Tolerance(float(value), float(value))
    if (
        isinstance(value, tuple)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        return Tolerance(float(value[0]), float(value[1]))
    raise TypeError(
        f"tolerance {what}{value!r}: give a number (rtol = atol), a (rtol, atol) pair, a Tolerance, or a "
        'dict by dtype name such as {"float32": 1e-4, "bfloat16": (2e-2, 1e-2)}'
    )


def tolerance_for(dtype: str, spec: ToleranceSpec = None) -> Tolerance:
    """The tolerance of a dtype: the default table, overridden by ``spec`` (a number or pair for
    every float dtype, or a dict by dtype name). Integers and booleans compare exactly."""
    exact = not (dtype.startswith(("float", "complex", "bfloat")))
    if isinstance(spec, Mapping):
        if dtype in spec:
            return _one_tolerance(spec[dtype], f"for {dtype}: ")
        spec = None
    if exact:
        return EXACT
    if spec is not None:
        return _one_tolerance(spec, "")
    return TOLERANCES.get(dtype, _LOW_PRECISION if dtype.startswith("float8") else TOLERANCES["float32"])


def check_tolerance(spec: ToleranceSpec) -> None:
    """Refuse a malformed tolerance before any run starts (a typo found after minutes is costly)."""
    if spec is None:
        return
    if isinstance(spec, Mapping):
        for k, v in spec.items():
            if not isinstance(k, str):
                raise TypeError(f"tolerance dict keys are dtype names such as 'float32', not {k!r}")
            _one_tolerance(v, f"for {k}: ")
        return
    _one_tolerance(spec, "")


def looser(a: Tolerance | None, b: Tolerance | None) -> Tolerance:
    if a is None or b is None:
        return a or b or EXACT
    scales = [s for s in (a.scale, b.scale) if s is not None]
    return Tolerance(
        max(a.rtol, b.rtol),
        max(a.atol, b.atol),
        max(scales) if scales else None,
        max(a.floor, b.floor),
        a.dtype or b.dtype,
    )


# Significand bits: which of two float dtypes is less precise.
_PRECISION = {
    "float64": 52,
    "complex128": 52,
    "float32": 23,
    "complex64": 23,
    "float16": 10,
    "complex32": 10,
    "bfloat16": 7,
}


def precision(dtype: str) -> int | None:
    """The significand bits of a float dtype (None for integers and booleans)."""
    if dtype in _PRECISION:
        return _PRECISION[dtype]
    return 3 if dtype.startswith("float8") else None


def widened(a: np.ndarray) -> np.ndarray:
    """Values as compared: float64 (complex128 for complex), integers and booleans as they are."""
    if a.dtype.kind == "c":
        return a.astype(np.complex128, copy=False)
    if a.dtype.kind in "biu":
        return a
    return a.astype(np.float64, copy=False)


def close(a: np.ndarray, b: np.ndarray, tol: Tolerance) -> np.ndarray:
    """Element-wise: is ``a`` within ``tol`` of the reference ``b`` (NaN equals NaN, an infinity
    the same infinity)."""
    if (a.dtype.kind in "biu" and b.dtype.kind in "biu") or (not tol.rtol and not tol.atol):
        with np.errstate(invalid="ignore"):
            return (a == b) | (_isnan(a) & _isnan(b))
    diff = absdiff(a, b)
    scale = tol.bound_scale(b)
    with np.errstate(invalid="ignore"):
        # diff == 0 where both hold NaN or the same infinity (whose bound is NaN or inf).
        return (diff <= tol.atol * scale + tol.rtol * np.abs(widened(b)) + tol.floor) | (diff == 0)


def _isnan(a: np.ndarray) -> np.ndarray:
    return np.isnan(a) if a.dtype.kind in "fc" else np.zeros(a.shape, dtype=bool)


def absdiff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """|a - b| in float64, 0 where both are NaN or the same infinity, inf where one is NaN."""
    x, y = widened(a), widened(b)
    with np.errstate(invalid="ignore", over="ignore"):
        d = np.abs(x.astype(np.result_type(x, np.float64)) - y.astype(np.result_type(y, np.float64)))
    d = np.asarray(d, dtype=np.float64)
    if x.dtype.kind in "fc" or y.dtype.kind in "fc":
        nx, ny = _isnan(x), _isnan(y)
        same_inf = np.isinf(x) & np.isinf(y) & (x == y) if x.dtype.kind in "fc" else np.zeros(d.shape, bool)
        d = np.where(nx & ny, 0.0, d)
        d = np.where(nx ^ ny, np.inf, d)
        d = np.where(same_inf, 0.0, d)
    return d


def _scale(b: np.ndarray) -> float:
    """The tensor's largest finite magnitude (what ``atol`` is relative to)."""
    if b.size == 0:
        return 0.0
    m = np.abs(widened(b))
    finite = m[np.isfinite(m)] if m.dtype.kind in "fc" else m
    return float(finite.max()) if finite.size else 0.0


def _runs(idx: np.ndarray) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for i in idx.tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return tuple(out)


def error_stats(got: np.ndarray, want: np.ndarray, tol: Tolerance) -> dict[str, Any]:
    """The numbers of a comparison: max abs / rel error, the worst element, which differ."""
    diff = absdiff(got, want)
    scale = tol.bound_scale(want)
    absw = np.abs(widened(want)).astype(np.float64)
    bound = tol.atol * scale + tol.rtol * absw + tol.floor
    with np.errstate(divide="ignore", invalid="ignore"):
        units = np.where(bound > 0, diff / np.where(bound > 0, bound, 1), np.where(diff > 0, np.inf, 0.0))
        rel = diff / np.maximum(absw, max(tol.atol * scale, np.finfo(np.float64).tiny))
    bad = units > 1
    out: dict[str, Any] = {
        "max_abs": float(diff.max()) if diff.size else 0.0,
        "max_rel": float(rel.max()) if rel.size else 0.0,
        "count": int(bad.sum()),
        "numel": int(diff.size),
        "error": units.astype(np.float32),
    }
    if diff.size:
        k = int(np.argmax(units))
        index = tuple(int(i) for i in np.unravel_index(k, diff.shape))
        out["worst"] = float(units.flat[k])
        out["index"] = index
        out["values"] = (_item(got, index), _item(want, index))
    if bad.any():
        nd = bad.ndim
        out["spans"] = tuple(
            _runs(np.flatnonzero(bad.any(axis=tuple(a for a in range(nd) if a != d)))) for d in range(nd)
        )
    return out


def _item(a: np.ndarray, index: tuple[int, ...]) -> Any:
    v = a[index] if index else a[()]
    return v.item() if hasattr(v, "item") else v


def same(a: Any, b: Any) -> bool:
    """Equal as saved and loaded: arrays by shape, dtype and values (NaN equal to NaN), floats with
    NaN equal to NaN, containers and dataclasses field by field."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return bool(np.array_equal(a, b, equal_nan=a.dtype.kind in "fc"))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if type(a) is not type(b):
            return False
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a) if f.compare)
    return bool(a == b)
