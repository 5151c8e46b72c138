"""Placements as plain data: parsed from strings, formatted back, no torch needed.

The string forms are the contract: ``"S(d)"``, ``"R"``, ``"P"``, ``"P(sum|avg|max|min)"`` and
``"_S(d,sf=k)"``. Keeping a torch-free model lets the pure geometry run for any mesh size without
a process group, and lets views and saved traces speak one vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

REDUCE_OPS = ("sum", "avg", "max", "min", "product")

Kind = Literal["shard", "replicate", "partial", "strided"]

_SHARD = re.compile(r"^S\((-?\d+)\)$")
_STRIDED = re.compile(r"^_S\((-?\d+),\s*(?:sf=)?(\d+)\)$")
_PARTIAL = re.compile(r"^P(?:\((\w+)\))?$")

_HELP = 'use "S(d)", "R", "P", "P(sum|avg|max|min)" or "_S(d,sf=k)"'


@dataclass(frozen=True, slots=True)
class Placement:
    """One mesh dimension's placement of a tensor."""

    kind: Kind
    dim: int | None = None
    reduce_op: str | None = None
    split_factor: int = 1

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"S({self.dim})"
        if self.kind == "strided":
            return f"_S({self.dim},sf={self.split_factor})"
        if self.kind == "partial":
            return f"P({self.reduce_op})"
        return "R"

    @property
    def is_shard(self) -> bool:
        """True for Shard and _StridedShard: the tensor dim is split over the mesh dim."""
        return self.kind in ("shard", "strided")


def parse(spec: str | Placement) -> Placement:
    """Parse one placement string (or pass a Placement through)."""
    if isinstance(spec, Placement):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"placement {spec!r} is a {type(spec).__name__}, not a string; {_HELP}")
    text = spec.strip().replace(" ", "")
    if text == "R":
        return Placement("replicate")
    if m := _SHARD.match(text):
        return Placement("shard", dim=int(m.group(1)))
    if m := _STRIDED.match(text):
        sf = int(m.group(2))
        if sf < 1:
            raise ValueError(f"placement {spec!r}: split factor must be >= 1")
        return Placement("strided", dim=int(m.group(1)), split_factor=sf)
    if m := _PARTIAL.match(text):
        op = (m.group(1) or "sum").lower()
        if op not in REDUCE_OPS:
            raise ValueError(f"placement {spec!r}: unknown reduce op {op!r}; use one of {REDUCE_OPS}")
        return Placement("partial", reduce_op=op)
    raise ValueError(f"unknown placement {spec!r}; {_HELP}")


def normalize(placements: object, ndim: int, mesh_ndim: int) -> tuple[Placement, ...]:
    """Parse a placement list and check it against the tensor rank and the mesh rank.

    Negative shard dims are resolved against ``ndim``, as DTensor does.
    """
    if isinstance(placements, str):
        placements = [placements]
    try:
        items = list(placements)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(
            f"placements must be a list of strings, one per mesh dim, not {type(placements).__name__}"
        ) from None
    if len(items) != mesh_ndim:
        raise ValueError(
            f"{len(items)} placement(s) {[str(p) for p in items]} for a {mesh_ndim}-D mesh: "
            "give exactly one placement per mesh dimension"
        )
    out = []
    for item in items:
        p = parse(item)
        if p.is_shard:
            assert p.dim is not None
            d = p.dim + ndim if p.dim < 0 else p.dim
            if not 0 <= d < ndim:
                raise ValueError(
                    f"placement {str(p)!r} shards dim {p.dim}, but the tensor has {ndim} dim(s) "
                    f"(valid: 0..{ndim - 1})"
                )
            p = Placement(p.kind, dim=d, split_factor=p.split_factor)
        out.append(p)
    partial_ops = {p.reduce_op for p in out if p.kind == "partial"}
    if len(partial_ops) > 1:
        # key=str: a Placement built by hand may leave reduce_op None
        raise ValueError(f"placements mix Partial reduce ops {sorted(partial_ops, key=str)}: use one")
    return tuple(out)
