"""How a numerics report writes numbers, rank sets, shapes and statuses: one rule for the
assembler's findings, the report's lines and its table."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from ..describe import rank_runs


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as compact ranges, each once: ``0-1,3``."""
    return ",".join(rank_runs(set(ranks)))


def number(x: float | None) -> str:
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if math.isinf(x) or math.isnan(x):
        return str(x)
    return f"{x:.2g}" if 1e-3 <= abs(x) < 1e4 else f"{x:.1e}"


STATUS_TEXT = {
    "ok": "ok",
    "differs": "DIFFERS",
    "replicas": "REPLICAS DISAGREE",
    "shape": "SHAPE DIFFERS",
    "unassembled": "not assembled",
    "missing": "in one run only",
}


def shape_text(shape: tuple[int, ...] | None) -> str:
    if shape is None:
        return "-"
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


def value_text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)
