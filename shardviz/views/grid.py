"""A buffer as the player draws it: rows are dim 0, columns the other dims flattened; the parts
each transfer moves as boxes in that grid; and, for a large buffer, the cells kept so that every
chunk border stays readable (the rest become ellipsis bands). The widget and matplotlib read the
same grid, so both pictures agree."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Rows drawn per buffer (all its list slots together) and columns per buffer at most. A (8, 4, 64)
# buffer is a grid of 8 x 256 elements: drawn to scale it is a hairline; drawn with these budgets
# it keeps readable cells (each can print its value), every chunk border, and an ellipsis band
# where elements are left out.
ROW_CELLS = 10
# The player's data flow is about this many pixels wide; a column holds about 40 px per cell.
FLOW_WIDTH = 880

Runs = tuple[tuple[int, int], ...]

# Chunks along one axis whose borders are all kept; past this the first KEEP_STRETCHES and the last
# are kept (a picture of a group of more than 16 ranks draws its first 16).
MAX_STRETCHES = 32
KEEP_STRETCHES = 16


def col_cells(group_size: int) -> int:
    """Columns drawn per buffer when ``group_size`` ranks sit side by side (2 to 8)."""
    return max(2, min(8, (FLOW_WIDTH // max(group_size, 1) - 50) // 40))


def summarize_axis(n: int, cuts: Iterable[int], most: int) -> Runs:
    """The index runs drawn along one axis of ``n`` elements (the gaps between runs are drawn as
    one ellipsis band each).

    Every cut (a chunk or padding border) stays a border between drawn cells. A stretch between
    two cuts longer than its share of ``most`` keeps its first cells and its last one; with many
    short stretches more than ``most`` cells are drawn (then the cells get smaller, never merged).
    Past ``MAX_STRETCHES`` stretches only the first ``KEEP_STRETCHES`` and the last keep theirs.
    """
    if n <= most:
        return ((0, n),) if n > 0 else ()
    points = sorted({0, n, *(c for c in cuts if 0 < c < n)})
    if len(points) - 1 > MAX_STRETCHES:
        # hundreds of chunks (an all_to_all over 512 ranks): the first ones and the last stay, the
        # middle becomes one band, or every buffer is drawn hundreds of bands tall
        points = [*points[: KEEP_STRETCHES + 1], *points[-2:]]
    share = max(2, most // (len(points) - 1))
    runs: list[tuple[int, int]] = []

    def keep(a: int, b: int) -> None:
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))

    for a, b in itertools.pairwise(points):
        if b - a <= share + 1:
            keep(a, b)
        else:
            keep(a, a + share - 1)
            keep(b - 1, b)
    return tuple(runs)


def grid_shape(shape: Sequence[int]) -> tuple[int, int]:
    """How a buffer is drawn: rows = dim 0, columns = the other dims flattened (a 1-D buffer is a
    column, so chunks of dim 0 are always horizontal bands)."""
    if not shape:
        return 1, 1
    return shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1


@dataclass(frozen=True, slots=True)
class Part:
    """One piece of a buffer that a transfer names (a chunk of a tensor, or a list slot).

    ``box`` is (row0, row1, col0, col1) in the drawn grid of slot ``slot`` (None: a tensor);
    ``origin`` is the rank whose data the piece holds (after the op), None when it is a reduction
    (``reduced``) or unknown; ``pad`` are the padding rectangles inside the piece.
    """

    index: int
    slot: int | None
    box: tuple[int, int, int, int]
    origin: int | None = None
    reduced: bool = False
    pad: tuple[tuple[int, int, int, int], ...] = ()

    def as_json(self) -> dict[str, Any]:
        """Defaults left out: a step of a 1,000-event trace's export is a few hundred bytes."""
        out: dict[str, Any] = {"box": list(self.box)}
        if self.slot is not None:
            out["slot"] = self.slot
        if self.origin is not None:
            out["origin"] = self.origin
        if self.reduced:
            out["reduced"] = True
        if self.pad:
            out["pad"] = [list(b) for b in self.pad]
        return out


@dataclass(frozen=True, slots=True)
class Buffer:
    """One rank's buffer on one side of a step, as drawn: its shape(s) and the parts."""

    shape: tuple[int, ...]
    dtype: str
    slots: tuple[tuple[int, ...], ...] | None  # list-valued buffers: one shape per slot
    values: bool
    parts: tuple[Part, ...] = ()
    origin: int | None = None  # whose data the whole buffer holds (None: reduced / unknown)
    reduced: bool = False
    role: str = ""  # "ignored" (an input the op does not read) / "undefined" (an output it leaves)
    pad: tuple[tuple[int, int, int, int], ...] = ()  # padding of a whole (unsplit) buffer

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"shape": list(self.shape), "dtype": self.dtype, "values": self.values}
        if self.slots is not None:
            out["slots"] = [list(s) for s in self.slots]
        if self.parts:
            out["parts"] = [p.as_json() for p in self.parts]
        if self.origin is not None:
            out["origin"] = self.origin
        if self.reduced:
            out["reduced"] = True
        if self.role:
            out["role"] = self.role
        if self.pad:
            out["pad"] = [list(b) for b in self.pad]
        return out


def drawn_grid(buf: Buffer, group_size: int) -> list[tuple[Runs, Runs]]:
    """Per slot of ``buf``, the (row runs, column runs) the views draw (see ``summarize_axis``)."""
    shapes = list(buf.slots) if buf.slots is not None else [buf.shape]
    rows_most = max(2, ROW_CELLS // max(len(shapes), 1))
    out = []
    for k, shape in enumerate(shapes):
        rows, cols = grid_shape(shape)
        boxes = [p.box for p in buf.parts if (p.slot or 0) == k]
        boxes += [b for p in buf.parts if (p.slot or 0) == k for b in p.pad]
        if k == 0:
            boxes += list(buf.pad)
        rcuts = [x for b in boxes for x in b[:2]]
        ccuts = [x for b in boxes for x in b[2:]]
        out.append(
            (summarize_axis(rows, rcuts, rows_most), summarize_axis(cols, ccuts, col_cells(group_size)))
        )
    return out


def grid_json(buf: Buffer, group_size: int) -> list[list[list[list[int]]]] | None:
    """``drawn_grid`` as JSON, or None when every element is drawn (the common small case)."""
    grid = drawn_grid(buf, group_size)
    shapes = list(buf.slots) if buf.slots is not None else [buf.shape]
    full = all(
        rr == (((0, r),) if r else ()) and cc == (((0, c),) if c else ())
        for (rr, cc), (r, c) in zip(grid, (grid_shape(s) for s in shapes), strict=True)
    )
    if full:
        return None
    return [[[list(x) for x in rr], [list(x) for x in cc]] for rr, cc in grid]
