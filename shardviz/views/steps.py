"""A trace's steps as plain data: what the collective player and its matplotlib picture draw.

``Model`` turns a ``Trace`` into the player's replies, computed on request:

- a compact **timeline** (columnar, strings deduplicated), so a 1,000-event trace costs tens of
  kilobytes of synced state;
- per step, ``detail`` (groups, each rank's buffers before and after cut into the parts the data
  flow moves, the transfers of ``flow.transfers``, padding, the flow check, cost, and for a
  redistribute its layouts and plan), ``values`` (each rank's buffers of one group as binary
  buffers, sampled when large) and ``ring`` (the ring algorithm's states from ``ring.py``,
  contributors and a few values).

No widget library is imported here: the widget (views/player.py) sends these replies to the
browser, and views/mpl.py draws the same part descriptions without anywidget, so both agree.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .. import cost as _cost
from .. import describe
from .. import flow as _flow
from .. import ring as _ring
from ..placement import parse as _parse_placement
from ..plan import PlanStep, plan_steps
from ..trace import (
    CollectiveEvent,
    Event,
    LocalEvent,
    OpEvent,
    RedistributeEvent,
    TensorSnapshot,
    Trace,
)
from . import geometry as g

# Elements per buffer in a values reply: the view prints numbers into small buffers and a
# summary for large ones, so a sample of this size is all it ever shows.
VALUES_LIMIT = 4096
# Values per ring chunk sent with a ring reply (the view prints a few per chunk).
RING_VALUES = 6
# Rings are drawn as a rank x chunk grid: beyond this many ranks it is no longer readable.
RING_MAX = 16
# Pad rectangles per part; past this the padding is only named in the notes.
PAD_RECTS = 64

KIND_CODES = {"collective": "c", "redistribute": "r", "op": "o", "local": "l", "module": "m"}
STEP_KINDS = ("collective", "redistribute")

# Operators that only change how a tensor is viewed (or detach it from autograd): no rank computes
# or sends anything. Their timeline rows are folded by default; a real model has hundreds.
VIEW_OPS = frozenset(
    {
        "alias", "as_strided", "detach", "expand", "expand_as", "flatten", "lift_fresh", "narrow",
        "permute", "_reshape_alias", "reshape", "select", "slice", "split", "split_with_sizes",
        "squeeze", "t", "transpose", "unbind", "unflatten", "unsqueeze", "_unsafe_view", "view",
        "view_as", "view_as_complex", "view_as_real",
    }
)  # fmt: skip
PHASES = ("forward", "backward", "none")
# The keys of a player's filter (PlayerWidget.filter): which steps and timeline rows it shows.
FILTER_KEYS = ("phase", "module", "mesh_dim", "all_ops")


# ---- the drawn grid: readable cells whatever the buffer's shape ----------------------------------

# Rows drawn per buffer (all its list slots together) and columns per buffer at most. A (8, 4, 64)
# buffer is a grid of 8 x 256 elements: drawn to scale it is a hairline; drawn with these budgets
# it keeps readable cells (each can print its value), every chunk border, and an ellipsis band
# where elements are left out.
ROW_CELLS = 10
# The player's data flow is about this many pixels wide; a column holds about 40 px per cell.
FLOW_WIDTH = 880

Runs = tuple[tuple[int, int], ...]


def col_cells(group_size: int) -> int:
    """Columns drawn per buffer when ``group_size`` ranks sit side by side (2 to 8)."""
    return max(2, min(8, (FLOW_WIDTH // max(group_size, 1) - 50) // 40))


def summarize_axis(n: int, cuts: Iterable[int], most: int) -> Runs:
    """The index runs drawn along one axis of ``n`` elements (the gaps between runs are drawn as
    one ellipsis band each).

    Every cut (a chunk or padding border) stays a border between drawn cells. A stretch between
    two cuts longer than its share of ``most`` keeps its first cells and its last one; with many
    short stretches more than ``most`` cells are drawn (then the cells get smaller, never merged).
    """
    if n <= most:
        return ((0, n),) if n > 0 else ()
    points = sorted({0, n, *(c for c in cuts if 0 < c < n)})
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


# ---- buffer parts: what each transfer moves, in grid coordinates ---------------------------------


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


def _snaps(s: TensorSnapshot | list[TensorSnapshot] | None) -> list[TensorSnapshot]:
    if s is None:
        return []
    return list(s) if isinstance(s, list) else [s]


def _band(shape: Sequence[int], dim: int, start: int, stop: int) -> tuple[int, int, int, int] | None:
    """Grid box of elements [start, stop) along ``dim``; None when that is not one band."""
    rows, cols = grid_shape(shape)
    if dim == 0 and shape:
        return (start, stop, 0, cols)
    if dim == 1 and len(shape) >= 2:
        inner = math.prod(shape[2:])
        return (0, rows, start * inner, stop * inner)
    return None


def _pad_rects(
    box: tuple[int, int, int, int], part_shape: Sequence[int], valid: Sequence[int] | None
) -> tuple[tuple[int, int, int, int], ...]:
    """The padding of a part whose sub-tensor has ``part_shape`` and real data ``valid`` (per dim,
    counted from the part's start), as grid rectangles: exact for padding along dims 0-2."""
    if valid is None or len(valid) != len(part_shape) or not part_shape:
        return ()
    v = [min(max(int(x), 0), n) for x, n in zip(valid, part_shape, strict=True)]
    if v == list(part_shape):
        return ()
    r0, r1, c0, c1 = box
    out: list[tuple[int, int, int, int]] = []
    if v[0] < part_shape[0]:
        out.append((r0 + v[0], r1, c0, c1))
    if len(part_shape) >= 2 and v[0] > 0:
        inner = math.prod(part_shape[2:])
        if v[1] < part_shape[1]:
            out.append((r0, r0 + v[0], c0 + v[1] * inner, c1))
        if len(part_shape) >= 3 and v[1] > 0:
            inner2 = math.prod(part_shape[3:])
            if v[2] < part_shape[2]:
                for j in range(v[1]):
                    if len(out) >= PAD_RECTS:
                        break
                    base = c0 + j * inner
                    out.append((r0, r0 + v[0], base + v[2] * inner2, base + inner))
    return tuple(out)


def _chunks(
    shape: Sequence[int],
    dim: int,
    n: int,
    sizes: Sequence[int] | None,
    origins: Sequence[int | None],
    reduced: bool,
    valid: Sequence[Sequence[int] | None] | None,
) -> tuple[Part, ...]:
    """n parts of a tensor cut along ``dim`` (equal, or ``sizes``); () if they are not bands."""
    if not shape or dim >= len(shape) or n <= 0:
        return ()
    if sizes:
        if len(sizes) != n or sum(sizes) != shape[dim]:
            return ()
        sz = list(sizes)
    else:
        step = shape[dim] // n
        if step * n != shape[dim]:
            return ()
        sz = [step] * n
    parts = []
    start = 0
    for k in range(n):
        box = _band(shape, dim, start, start + sz[k])
        if box is None:
            return ()
        sub = list(shape)
        sub[dim] = sz[k]
        pad = _pad_rects(box, sub, valid[k] if valid else None)
        parts.append(Part(k, None, box, origins[k], reduced, pad))
        start += sz[k]
    return tuple(parts)


def _slots(
    slots: Sequence[tuple[int, ...]], origins: Sequence[int | None], reduced: bool
) -> tuple[Part, ...]:
    parts = []
    for k, shape in enumerate(slots):
        rows, cols = grid_shape(shape)
        parts.append(Part(k, k, (0, rows, 0, cols), origins[k] if k < len(origins) else None, reduced))
    return tuple(parts)


# ---- padding: which elements of a buffer are real, from the redistribute's plan -----------------


def _valid_shapes(
    e: CollectiveEvent, step: PlanStep | None
) -> tuple[dict[int, list[tuple[int, ...]]], dict[int, list[tuple[int, ...]]]] | None:
    """Per rank, the real (unpadded) shape of each input / output part, from the layouts around
    the plan step this collective ran; None when the step or its layouts are unknown."""
    if step is None or step.before is None or step.after is None or step.mesh_dim is None:
        return None
    lb, la = step.before, step.after
    try:
        src, dst = _parse_placement(step.src), _parse_placement(step.dst)
    except ValueError:
        return None
    ins: dict[int, list[tuple[int, ...]]] = {}
    outs: dict[int, list[tuple[int, ...]]] = {}
    try:
        for grp in e.groups:
            before = [lb.shard(r).shape for r in grp]
            after = [la.shard(r).shape for r in grp]
            for i, r in enumerate(grp):
                if e.op == "all_gather":
                    ins[r] = [before[i]]
                    outs[r] = list(before)
                elif e.op == "reduce_scatter":
                    ins[r] = list(after)
                    outs[r] = [after[i]]
                elif e.op == "all_to_all" and src.dim is not None and dst.dim is not None:
                    a, b = src.dim, dst.dim  # gather along a, split along b

                    def mix(
                        x: tuple[int, ...], y: tuple[int, ...], a: int = a, b: int = b
                    ) -> tuple[int, ...]:
                        out = list(x)
                        out[b] = y[b]
                        out[a] = x[a]
                        return tuple(out)

                    ins[r] = [mix(before[i], after[k]) for k in range(len(grp))]
                    outs[r] = [mix(before[k], after[i]) for k in range(len(grp))]
                else:
                    return None
    except KeyError:
        return None
    return ins, outs


# ---- one step as plain data ---------------------------------------------------------------------


def _buffers(
    e: CollectiveEvent | LocalEvent, valid: tuple[dict, dict] | None = None
) -> dict[int, dict[str, Buffer | None]]:
    """Every rank's input and output buffer with the parts the op moves."""
    out: dict[int, dict[str, Buffer | None]] = {}
    if isinstance(e, LocalEvent):
        for r in sorted(set(e.inputs) | set(e.outputs)):
            out[r] = {"in": _plain(e.inputs.get(r), (), r), "out": _plain(e.outputs.get(r), (), r)}
        return out
    op, p = e.op, e.params
    if op in ("send", "recv"):
        return _p2p_buffers(e)
    for grp in e.groups:
        n = len(grp)
        root = grp[e.root] if e.root is not None and e.root < n else None
        for r in grp:
            ins, outs = e.inputs.get(r), e.outputs.get(r)
            vin = valid[0].get(r) if valid else None
            vout = valid[1].get(r) if valid else None
            b_in = _plain(ins, (), r, whole_valid=vin[0] if vin and len(vin) == 1 else None)
            b_out = _plain(outs, (), None, whole_valid=vout[0] if vout and len(vout) == 1 else None)
            members: list[int | None] = list(grp)
            if op == "all_gather":
                b_out = _split(outs, 0, n, None, members, False, vout) or b_out
            elif op == "reduce_scatter":
                b_in = _split(ins, 0, n, None, [r] * n, False, vin) or b_in
                b_out = _plain(outs, (), None, reduced=True, whole_valid=vout[0] if vout else None)
            elif op == "all_reduce":
                b_out = _plain(outs, (), None, reduced=True)
            elif op == "all_to_all":
                if "gather_dim" in p and "shard_dim" in p:
                    b_in = _split(ins, p["shard_dim"], n, None, [r] * n, False, vin) or b_in
                    b_out = _split(outs, p["gather_dim"], n, None, members, False, vout) or b_out
                else:
                    b_in = _split(ins, 0, n, p.get("input_split_sizes"), [r] * n, False, None) or b_in
                    b_out = _split(outs, 0, n, p.get("output_split_sizes"), members, False, None) or b_out
            elif op == "broadcast":
                b_out = _plain(outs, (), root)
            elif op == "scatter":
                if r == root:
                    b_in = _split(ins, 0, n, None, [r] * n, False, None) or b_in
                else:
                    b_in = _with(b_in, role="ignored")
                b_out = _plain(outs, (), root)
            elif op == "gather":
                if r == root:
                    b_out = _split(outs, 0, n, None, members, False, None) or b_out
                else:
                    b_out = _with(b_out, role="undefined")
            elif op == "reduce":
                b_out = _plain(outs, (), None, reduced=True) if r == root else _with(b_out, role="undefined")
            else:  # barrier: no buffers
                b_out = _plain(outs, (), r)
            out[r] = {"in": b_in, "out": b_out}
    return out


def p2p_pairs(e: CollectiveEvent) -> list[tuple[int, int]]:
    """(source, destination) of each message of a send or recv. The recorded ``root`` is the index
    of the peer in each pair: the destination for a send, the source for a recv."""
    if e.op not in ("send", "recv") or e.root not in (0, 1):
        return []
    i = 1 - e.root if e.op == "send" else e.root
    return [(grp[i], grp[1 - i]) for grp in e.groups if len(grp) == 2]


def _p2p_buffers(e: CollectiveEvent) -> dict[int, dict[str, Buffer | None]]:
    """A send draws the source's buffer and, at the destination, what is on its way there (it lands
    in the matching recv); a recv draws what was sent and what arrived."""
    out: dict[int, dict[str, Buffer | None]] = {}
    for src, dst in p2p_pairs(e):
        sent = e.inputs.get(src)
        out.setdefault(src, {"in": None, "out": None})["in"] = _plain(sent, (), src)
        if e.op == "send":
            arrives = _with(_plain(sent, (), src), role="pending")
        else:
            arrives = _plain(e.outputs.get(dst), (), src)
        out.setdefault(dst, {"in": None, "out": None})["out"] = arrives
    return out


def _buffer_json(b: Buffer | None, group_size: int) -> dict[str, Any] | None:
    if b is None:
        return None
    out = b.as_json()
    grid = grid_json(b, group_size)
    if grid is not None:
        out["grid"] = grid
    return out


def _with(b: Buffer | None, **changes: Any) -> Buffer | None:
    if b is None:
        return None
    fields_ = {f: getattr(b, f) for f in Buffer.__slots__}
    fields_.update(changes)
    return Buffer(**fields_)


def _plain(
    s: TensorSnapshot | list[TensorSnapshot] | None,
    parts: tuple[Part, ...],
    origin: int | None,
    *,
    reduced: bool = False,
    whole_valid: Sequence[int] | None = None,
) -> Buffer | None:
    snaps = _snaps(s)
    if not snaps:
        return None
    listed = isinstance(s, list)
    shape = snaps[0].shape if not listed else (len(snaps),)
    pad: tuple[tuple[int, int, int, int], ...] = ()
    if not listed and whole_valid is not None:
        rows, cols = grid_shape(shape)
        pad = _pad_rects((0, rows, 0, cols), shape, whole_valid)
    return Buffer(
        shape=tuple(shape),
        dtype=snaps[0].dtype,
        slots=tuple(x.shape for x in snaps) if listed else None,
        values=all(x.values is not None for x in snaps),
        parts=parts,
        origin=origin,
        reduced=reduced,
        pad=pad,
    )


def _split(
    s: TensorSnapshot | list[TensorSnapshot] | None,
    dim: int,
    n: int,
    sizes: Sequence[int] | None,
    origins: Sequence[int | None],
    reduced: bool,
    valid: Sequence[Sequence[int]] | None,
) -> Buffer | None:
    """A buffer cut into n parts: list slots when it is a list, else chunks along ``dim``."""
    snaps = _snaps(s)
    if not snaps:
        return None
    if isinstance(s, list):
        if len(snaps) != n:
            return None
        return _plain(s, _slots([x.shape for x in snaps], origins, reduced), None, reduced=reduced)
    parts = _chunks(
        snaps[0].shape, dim, n, sizes, origins, reduced, valid if valid and len(valid) == n else None
    )
    if not parts:
        return None
    return _plain(s, parts, None, reduced=reduced)


def stays(e: CollectiveEvent) -> list[_flow.Transfer]:
    """What each rank keeps of its own input (drawn dashed): the transfers a rank makes to itself,
    which ``flow.transfers`` leaves out."""
    T = _flow.Transfer
    out: list[_flow.Transfer] = []
    for grp in e.groups:
        n = len(grp)
        root = e.root if e.root is not None and e.root < n else None
        for i, r in enumerate(grp):
            if e.op == "all_gather":
                out.append(T(r, r, None, i))
            elif e.op == "reduce_scatter":
                out.append(T(r, r, i, None, True))
            elif e.op == "all_reduce":
                out.append(T(r, r, None, None, True))
            elif e.op == "all_to_all":
                out.append(T(r, r, i, i))
            elif e.op == "broadcast" and i == root:
                out.append(T(r, r))
            elif e.op == "scatter" and i == root:
                out.append(T(r, r, i, None))
            elif e.op == "gather" and i == root:
                out.append(T(r, r, None, i))
            elif e.op == "reduce" and i == root:
                out.append(T(r, r, None, None, True))
    return out


def _transfer_json(t: _flow.Transfer) -> list[Any]:
    return [t.src, t.dst, t.src_part, t.dst_part, t.reduce]


def _check_json(c: _flow.FlowCheck) -> dict[str, Any]:
    errors = {str(r): (e if math.isfinite(e) else None) for r, e in sorted(c.max_error.items())}
    return {"ok": c.ok, "checked": c.checked, "max_error": errors, "note": c.note}


def _source_json(e: Event) -> dict[str, Any] | None:
    if e.source is None:
        return None
    return {"file": Path(e.source.file).name, "line": e.source.line, "text": e.source.text}


# ---- the whole trace ----------------------------------------------------------------------------


@dataclass
class Model:
    """The trace, its steps and the lookups every reply needs (built once per widget)."""

    trace: Trace
    local_steps: bool = False
    steps: list[Event] = field(init=False)
    by_id: dict[int, Event] = field(init=False)
    children: dict[int | None, list[Event]] = field(init=False)
    _plans: dict[int, list[PlanStep]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        kinds = (*STEP_KINDS, "local") if self.local_steps else STEP_KINDS
        self.steps = [e for e in self.trace.events if e.kind in kinds]
        self.by_id = {e.id: e for e in self.trace.events}
        self.children = {}
        for e in self.trace.events:
            self.children.setdefault(e.parent, []).append(e)

    def plan(self, e: RedistributeEvent) -> list[PlanStep]:
        if e.id not in self._plans:
            self._plans[e.id] = plan_steps(e, self.children.get(e.id, []))
        return self._plans[e.id]

    def plan_step_of(self, e: CollectiveEvent) -> PlanStep | None:
        parent = self.by_id.get(e.parent) if e.parent is not None else None
        if not isinstance(parent, RedistributeEvent):
            return None
        return next((s for s in self.plan(parent) if s.event == e.id), None)

    def step_of(self, event_id: int) -> int | None:
        for k, e in enumerate(self.steps):
            if e.id == event_id:
                return k
        return None

    def ancestors(self, e: Event) -> list[Event]:
        out: list[Event] = []
        p = e.parent
        while p is not None and p in self.by_id and len(out) < 32:
            out.append(self.by_id[p])
            p = self.by_id[p].parent
        return out[::-1]

    def collectives_under(self, e: Event) -> Iterator[CollectiveEvent]:
        for c in self.children.get(e.id, []):
            if isinstance(c, CollectiveEvent):
                yield c
            yield from self.collectives_under(c)

    def moves_no_data(self, e: Event) -> bool:
        """A DTensor operator that only views its input (``aten.detach``, ``aten.view``, ``aten.t``,
        ...) and redistributes nothing: folded in the timeline unless ``all_ops`` is asked for."""
        if not isinstance(e, OpEvent) or self.children.get(e.id):
            return False
        parts = e.name.split(".")
        base = parts[1] if len(parts) > 1 and parts[0] == "aten" else parts[0]
        return base in VIEW_OPS

    def mesh_dims(self, e: Event) -> list[str]:
        """The mesh dims an event's collectives ran on (itself, or those it encloses), by label;
        "-" for a collective on no mesh dim."""
        if isinstance(e, CollectiveEvent):
            return [describe.mesh_dim(e) or "-"]
        return sorted({describe.mesh_dim(c) or "-" for c in self.collectives_under(e)})

    def matches(self, e: Event, flt: dict[str, Any]) -> bool:
        """Does an event pass a filter (keys of FILTER_KEYS; a missing key passes everything)?

        ``phase``: "forward", "backward", or "none" (outside both: setup, optimizer steps);
        ``module``: part of the name of the ``nn.Module`` the event ran in; ``mesh_dim``: a mesh
        dim's label ("tp", "dim 0") or "-" for none; a redistribute or operator matches through
        the collectives it encloses."""
        phase = flt.get("phase")
        if phase and (e.phase or "none") != phase:
            return False
        module = flt.get("module")
        if module and (e.module is None or module not in e.module):
            return False
        dim = flt.get("mesh_dim")
        return not dim or dim in self.mesh_dims(e)

    def steps_matching(self, flt: dict[str, Any]) -> list[int]:
        """The steps a filter keeps: what prev / next / first / last move between."""
        return [k for k, e in enumerate(self.steps) if self.matches(e, flt)]

    def step_start(self) -> int | None:
        """The first step of the training step: the first collective recorded inside an
        ``nn.Module``'s forward or backward (so after model setup: ``distribute_tensor``,
        ``parallelize_module``, ``fully_shard``, which run outside any forward). None when no
        collective ran in one."""
        for k, e in enumerate(self.steps):
            if isinstance(e, CollectiveEvent) and e.phase in ("forward", "backward"):
                return k
        return None

    def cost(self, e: Event) -> tuple[float, int]:
        """(bus bytes per rank, sequential ring steps) of a step, summed over a redistribute's
        collectives: time on a link is alpha x steps + bytes / beta (cost.py's model)."""
        if isinstance(e, CollectiveEvent):
            row = _cost.event_cost(e)
            return row.bus_bytes_per_rank, _cost.ring_steps(e.op, e.group_size)
        if isinstance(e, RedistributeEvent):
            total, hops = 0.0, 0
            for c in self.collectives_under(e):
                b, h = self.cost(c)
                total, hops = total + b, hops + h
            return total, hops
        return 0.0, 0

    # ---- synced state ----

    def timeline(self) -> dict[str, Any]:
        """Columnar rows (event rows and module headers), strings and sources deduplicated."""
        strings: dict[str, int] = {}
        sources: dict[tuple[int, str], int] = {}

        def sid(text: str) -> int:
            return strings.setdefault(text, len(strings))

        ids: list[int] = []
        kinds: list[str] = []
        depth: list[int] = []
        label: list[int] = []
        source: list[int] = []
        phase: list[str] = []  # per row: f / b / - (outside a forward or backward)
        module: list[int] = []  # per row: the module's name (a string id), -1 for none (sent as rle)
        dims: list[int] = []  # per row: the mesh dims of its collectives, comma-joined (rle)
        quiet: list[int] = []  # rows folded by default (operators that move no data)
        codes = {"forward": "f", "backward": "b"}
        step_rows: list[int] = []
        step_ids = {e.id for e in self.steps}
        levels: dict[int, int] = {}
        open_: list[tuple[str, str | None]] = []  # the module headers of the rows above
        for e in self.trace.events:
            if e.parent is None or e.parent not in levels:
                # nn.Modules nest as headers: "Net · forward" > "block", one level per name
                parts = e.module.split(".") if e.module else []
                keys = [(".".join(parts[: i + 1]), e.phase) for i in range(len(parts))]
                if not keys and e.phase:
                    keys = [("", e.phase)]
                same = 0
                while same < min(len(keys), len(open_)) and keys[same] == open_[same]:
                    same += 1
                for i in range(same, len(keys)):
                    name = parts[i] if parts else ""
                    text = " · ".join(x for x in (name, e.phase if i == 0 else None) if x)
                    ids.append(-1)
                    kinds.append("m")
                    depth.append(i)
                    label.append(sid(text))
                    source.append(-1)
                    phase.append(codes.get(e.phase or "", "-"))
                    module.append(sid(keys[i][0]) if keys[i][0] else -1)
                    dims.append(-1)
                open_ = keys
                d = len(keys)
            else:
                d = levels[e.parent] + 1
            levels[e.id] = d
            if e.id in step_ids:
                step_rows.append(len(ids))
            if self.moves_no_data(e):
                quiet.append(len(ids))
            ids.append(e.id)
            kinds.append(KIND_CODES.get(e.kind, "?"))
            depth.append(d)
            label.append(sid(describe.short(e)))
            phase.append(codes.get(e.phase or "", "-"))
            module.append(sid(e.module) if e.module else -1)
            row_dims = self.mesh_dims(e) if e.kind in ("collective", "redistribute", "op") else []
            dims.append(sid(",".join(row_dims)) if row_dims else -1)
            if e.source is not None:
                source.append(sources.setdefault((e.source.line, e.source.text), len(sources)))
            else:
                source.append(-1)
        bus, hops = [], []
        for e in self.steps:
            b, h = self.cost(e)
            bus.append(round(b, 3))
            hops.append(h)
        return {
            "ids": ids,
            "kinds": "".join(kinds),
            "depth": depth,
            "label": label,
            "source": source,
            "steps": step_rows,
            "phase": "".join(phase),
            "module": rle(module),
            "dims": rle(dims),
            "quiet": quiet,
            "bus": bus,
            "hops": hops,
            "total_kinds": "".join(KIND_CODES.get(e.kind, "?") for e in self.steps),
            "strings": list(strings),
            "sources": [[line, text] for line, text in sources],
        }

    def info(self, title: str | None) -> dict[str, Any]:
        t = self.trace
        notes = []
        if not self.steps:
            notes.append("this trace has no collectives or redistributes: nothing to step through")
        if t.values_dropped_from is not None:
            notes.append(
                f"values were kept until the value budget ran out at event #{t.values_dropped_from}; "
                "later steps show shapes only"
            )
        if not t.complete:
            notes.append("this trace is incomplete (a rank failed): the last steps may be missing")
        notes.extend(getattr(t, "notes", ()))
        bus_total = sum(self.cost(e)[0] for e in t.events if isinstance(e, CollectiveEvent))
        hops_total = sum(self.cost(e)[1] for e in t.events if isinstance(e, CollectiveEvent))
        return {
            "title": title or f"Trace: {t.backend}, {t.world_size} ranks",
            "world_size": t.world_size,
            "backend": t.backend,
            "events": len(t.events),
            "collectives": sum(1 for e in t.events if isinstance(e, CollectiveEvent)),
            "steps": len(self.steps),
            "local_steps": self.local_steps,
            "total_bus": round(bus_total, 3),
            "total_hops": hops_total,
            "links": {
                k: {"name": lk.name, "alpha": lk.alpha, "beta": lk.beta} for k, lk in _cost.PRESETS.items()
            },
            "notes": notes,
            "step_start": self.step_start(),
            "palette": {"fill": list(g.PALETTE), "text": list(g.TEXT_ON), "patterns": list(g.PATTERNS)},
        }

    # ---- replies ----

    def detail(self, k: int) -> dict[str, Any]:
        """Everything the view draws for step ``k`` except values (fetch_step's reply)."""
        e = self.steps[k]
        out: dict[str, Any] = {
            "step": k,
            "id": e.id,
            "kind": e.kind,
            "label": describe.short(e),
            "line": describe.line(e),
            "source": _source_json(e),
            "module": e.module,
            "phase": e.phase,
            "context": [
                {"id": a.id, "label": describe.short(a), "step": self.step_of(a.id)}
                for a in self.ancestors(e)
            ],
            "notes": [],
        }
        bus, hops = self.cost(e)
        out["cost"] = {"bus": bus, "hops": hops}
        if isinstance(e, RedistributeEvent):
            out.update(self._redistribute(e))
        elif isinstance(e, CollectiveEvent):
            out.update(self._collective(e))
        elif isinstance(e, LocalEvent):
            out.update(self._local(e))
        return out

    def _groups_json(self, e: CollectiveEvent | LocalEvent) -> list[list[int]]:
        if isinstance(e, LocalEvent):
            ranks = sorted(set(e.inputs) | set(e.outputs))
            return [ranks] if ranks else []
        return [list(grp) for grp in e.groups]

    def _collective(self, e: CollectiveEvent) -> dict[str, Any]:
        step = self.plan_step_of(e)
        valid = _valid_shapes(e, step)
        bufs = _buffers(e, valid)
        n = e.group_size
        factor = _cost.bus_factor(e.op, n)
        ranks = {}
        for r, b in sorted(bufs.items()):
            nb = e.nbytes.get(r, 0)
            ranks[str(r)] = {
                "in": _buffer_json(b["in"], n),
                "out": _buffer_json(b["out"], n),
                "nbytes": nb,
                "bus": factor * nb,
            }
        notes = []
        padded = [
            r
            for r, b in bufs.items()
            if any(x and (x.pad or any(p.pad for p in x.parts)) for x in b.values())
        ]
        if padded:
            notes.append(
                f"uneven shards: hatched grey cells are padding (ranks {g.rank_list(padded)}); DTensor "
                "pads every shard to the same size before the collective and drops the padding after"
            )
        if e.op == "barrier":
            notes.append("barrier: no data moves; every rank of the group waits until all have arrived")
        pairs = p2p_pairs(e)
        if e.op in ("send", "recv"):
            peer = e.params.get("peer")
            peer_step = self.step_of(peer) if isinstance(peer, int) else None
            where = f" (step {peer_step + 1})" if peer_step is not None else ""
            for src, dst in pairs:
                if e.op == "send":
                    notes.append(
                        f"point-to-point send: rank {src} sends its whole buffer to rank {dst}; "
                        f"it lands in rank {dst}'s matching recv{where}"
                    )
                else:
                    notes.append(
                        f"point-to-point recv: rank {dst} receives the whole buffer rank {src} sent{where}"
                    )
            if not pairs:
                notes.append(
                    "point-to-point: the player shows each rank's buffer; the pairing is not recorded"
                )
        if e.op == "reduce":
            notes.append(
                "reduce: only the root's output is defined; other ranks' outputs are left as they were"
            )
        if e.op == "gather":
            notes.append("gather: only the root receives the list; other ranks' output lists are not used")
        if e.op == "scatter":
            notes.append("scatter: only the root's input list is read")
        drawn = [b for x in bufs.values() for b in x.values() if b]
        if drawn and not any(b.values for b in drawn):
            notes.append("values not kept for this step (value policy): shapes and bytes only")
        if "flight" in e.params:
            from ..flight import flight_notes

            notes.extend(flight_notes(e))
        check = _flow.check(e)
        ring_ok = e.op in _ring.RING_OPS and bool(e.groups)
        ring_note = ""
        if ring_ok and n > RING_MAX:
            ring_ok, ring_note = (
                False,
                f"the ring view draws groups of up to {RING_MAX} ranks (this one has {n})",
            )
        elif ring_ok and _ring.ring(e, 0) is None:
            ring_ok, ring_note = (
                False,
                "the ring view needs the buffers' values, which this trace did not keep",
            )
        return {
            "op": e.op,
            "impl": e.impl,
            "reduce_op": e.reduce_op,
            "root": e.root,
            "roots": e.roots(),
            "mesh_dim": e.mesh_dim,
            "mesh_dim_name": e.mesh_dim_name,
            "where": self.where(e),
            "pairs": [list(x) for x in pairs],
            "groups": self._groups_json(e),
            "ranks": ranks,
            "transfers": [_transfer_json(t) for t in _flow.transfers(e)],
            "stays": [_transfer_json(t) for t in stays(e)],
            "check": _check_json(check),
            "ring": {"available": ring_ok, "note": ring_note} if e.op in _ring.RING_OPS else None,
            "plan_step": step.index if step else None,
            "bus_factor": factor,
            "notes": notes,
        }

    def where(self, e: CollectiveEvent) -> str:
        """Which process groups ran a collective, in words: its mesh dim, the default group, or
        point-to-point pairs (raw ``dist.*`` calls on no mesh are not "unmatched")."""
        if e.op in ("send", "recv"):
            pairs = p2p_pairs(e)
            return f"point-to-point, {len(pairs)} pair{'s' if len(pairs) != 1 else ''}"
        dim = describe.mesh_dim(e)
        if dim:
            return f"mesh {dim}"
        ranks = sorted(r for grp in e.groups for r in grp)
        if len(e.groups) == 1 and ranks == list(range(self.trace.world_size)):
            return f"default process group (all {self.trace.world_size} ranks)"
        if not self.trace.meshes:
            return "process groups of their own (no device mesh in this trace)"
        return "groups that match no mesh dim"

    def _local(self, e: LocalEvent) -> dict[str, Any]:
        bufs = _buffers(e)
        n = len(bufs)
        ranks = {
            str(r): {
                "in": _buffer_json(b["in"], n),
                "out": _buffer_json(b["out"], n),
                "nbytes": 0,
                "bus": 0.0,
            }
            for r, b in sorted(bufs.items())
        }
        return {
            "op": "local",
            "name": e.name,
            "groups": self._groups_json(e),
            "ranks": ranks,
            "transfers": [],
            "stays": [[r, r, None, None, False] for r in sorted(bufs)],
            "check": None,
            "ring": None,
            "notes": [f"local compute ({e.name}) on each rank's own shard: no communication"],
        }

    def _redistribute(self, e: RedistributeEvent) -> dict[str, Any]:
        steps = self.plan(e)
        labels = e.before.mesh_dim_names if e.before is not None else None
        plan = []
        for s in steps:
            if s.mesh_dim is None:
                dim_label = "-"
            elif labels:
                dim_label = labels[s.mesh_dim]
            else:
                dim_label = f"dim {s.mesh_dim}"
            plan.append(
                {
                    "mesh_dim": s.mesh_dim,
                    "dim_label": dim_label,
                    "src": s.src,
                    "dst": s.dst,
                    "op": s.op,
                    "event": s.event,
                    "step": self.step_of(s.event) if s.event is not None else None,
                }
            )
        notes = []
        if not steps and e.plan:
            notes.append(f"plan {e.plan} (not split into steps)")
        if not e.explicit:
            notes.append("implicit: DTensor redistributed an operand to run the operator that encloses it")
        return {
            "src": list(e.src),
            "dst": list(e.dst),
            "plan": e.plan,
            "explicit": e.explicit,
            "before": g.payload(e.before) if e.before is not None else None,
            "after": g.payload(e.after) if e.after is not None else None,
            "plan_steps": plan,
            "children": [c.id for c in self.collectives_under(e)],
            "notes": notes,
        }

    def values(self, k: int, group: int) -> tuple[dict[str, Any], list[bytes]]:
        """Every rank's buffers of one group of step ``k``: one binary buffer per tensor."""
        e = self.steps[k]
        if not isinstance(e, CollectiveEvent | LocalEvent):
            return {"error": "a redistribute's values are in the steps of its collectives"}, []
        groups = self._groups_json(e)
        if not 0 <= group < len(groups):
            return {"error": f"step {k} has no group {group} (it has {len(groups)})"}, []
        entries: list[dict[str, Any]] = []
        buffers: list[bytes] = []
        missing = 0
        for r in groups[group]:
            for side, per_rank in (("in", e.inputs), ("out", e.outputs)):
                snap = per_rank.get(r)
                listed = isinstance(snap, list)
                for slot, s in enumerate(_snaps(snap)):
                    if s.values is None:
                        missing += 1
                        continue
                    meta, data = g.encode(s.values, s.dtype, VALUES_LIMIT)
                    meta.update({"rank": r, "side": side, "slot": slot if listed else None})
                    summary = s.summary
                    if summary is not None and summary.min is not None and summary.max is not None:
                        # exact, also when the values sent are a sample
                        meta.update({"min": summary.min, "max": summary.max})
                    entries.append(meta)
                    buffers.append(data)
        if not entries:
            return {"error": "values not kept for this step (value policy): shapes only"}, []
        return {"step": k, "group": group, "entries": entries, "missing": missing}, buffers

    def ring(self, k: int, group: int) -> tuple[dict[str, Any], list[bytes]]:
        """The ring algorithm's states for one group of step ``k`` (contributors as bit masks over
        the group's ranks, and the first values of every chunk in one float64 buffer)."""
        e = self.steps[k]
        if not isinstance(e, CollectiveEvent) or e.op not in _ring.RING_OPS:
            return {"error": "the ring view is for all_reduce, all_gather and reduce_scatter"}, []
        if not 0 <= group < len(e.groups):
            return {"error": f"step {k} has no group {group} (it has {len(e.groups)})"}, []
        n = len(e.groups[group])
        if n > RING_MAX:
            return {"error": f"the ring view draws groups of up to {RING_MAX} ranks (this one has {n})"}, []
        rg = _ring.ring(e, group)
        if rg is None:
            return {"error": "the ring view needs the buffers' values, which this trace did not keep"}, []
        return ring_reply(k, group, rg, e)


def rle(values: Sequence[int]) -> list[int]:
    """Run-length code: [value, count, value, count, ...] (rows of one module come in runs)."""
    out: list[int] = []
    for v in values:
        if out and out[-2] == v:
            out[-1] += 1
        else:
            out += [v, 1]
    return out


def contributors(rg: _ring.Ring, op: str) -> list[list[list[int]]]:
    """Per ring state (initial, then after each step), per rank, per chunk: the bit mask of the
    group's ranks whose data the chunk holds (0: not there yet)."""
    n = rg.n
    if op == "all_gather":
        cur = [[(1 << k) if c == k else 0 for c in range(n)] for k in range(n)]
    else:
        cur = [[1 << k for _ in range(n)] for k in range(n)]
    pos = {r: i for i, r in enumerate(rg.group)}
    states = [[list(row) for row in cur]]
    for st in rg.steps:
        sent = {pos[dst]: (c, cur[pos[src]][c]) for src, dst, c in st.sends}
        for d, (c, mask) in sent.items():
            cur[d][c] = (cur[d][c] | mask) if st.phase == "reduce-scatter" else mask
        states.append([list(row) for row in cur])
    return states


def _first(a: np.ndarray | None, k: int) -> np.ndarray | None:
    if a is None:
        return None
    flat = np.asarray(a).reshape(-1)[:k]
    return np.real(flat).astype(np.float64) if flat.dtype.kind == "c" else flat.astype(np.float64)


def ring_reply(k: int, group: int, rg: _ring.Ring, e: CollectiveEvent) -> tuple[dict[str, Any], list[bytes]]:
    """The ring reply: per state (initial, after each step, then the ring's final result and the
    recorded output), per rank, per chunk, how many leading values are sent (``counts``, -1: the
    chunk is not there yet) and, in one buffer, those values packed in that order."""
    n, kv = rg.n, RING_VALUES
    states = [rg.initial, *[s.chunks for s in rg.steps]]
    rows = len(states) + 2
    counts = np.full((rows, n, n), -1, dtype=np.int64)
    packed: list[np.ndarray] = []
    sizes = [[0] * n for _ in range(n)]

    def put(si: int, i: int, c: int, arr: np.ndarray | None) -> None:
        f = _first(arr, kv)
        if f is not None:
            counts[si, i, c] = f.size
            packed.append(f)

    for si, state in enumerate(states):
        for i, r in enumerate(rg.group):
            for c, chunk in enumerate(state[r]):
                if chunk is not None:
                    sizes[i][c] = max(sizes[i][c], int(np.asarray(chunk).size))
                put(si, i, c, chunk)
    for i, r in enumerate(rg.group):  # the ring's final result, then what was recorded
        put(len(states), i, 0, rg.final.get(r))
    for i, r in enumerate(rg.group):
        put(len(states) + 1, i, 0, _recorded(e, r))
    values = np.concatenate(packed) if packed else np.zeros(0)
    wide = any(
        x.dtype.kind != "f" or x.dtype.itemsize > 4
        for x in (rg.final.get(r) for r in rg.group)
        if x is not None
    )
    fmt = "f8" if wide or e_dtype(e) in ("float64", "int64", "int32", "uint32", "uint64") else "f4"
    meta = {
        "step": k,
        "group": group,
        "op": rg.op,
        "reduce_op": rg.reduce_op,
        "ranks": list(rg.group),
        "n": n,
        "states": len(states),
        "phases": [s.phase for s in rg.steps],
        "sends": [[x for send in s.sends for x in send] for s in rg.steps],
        "contributors": [m for state in contributors(rg, rg.op) for row in state for m in row],
        "chunk_sizes": sizes,
        "counts": counts.reshape(-1).tolist(),
        "format": fmt,
        "final_sizes": [int(np.asarray(rg.final[r]).size) if r in rg.final else 0 for r in rg.group],
        "check": _check_json(rg.check),
    }
    return meta, [np.ascontiguousarray(values, dtype="<f8" if fmt == "f8" else "<f4").tobytes()]


def e_dtype(e: CollectiveEvent) -> str:
    """The source dtype of a collective's buffers ("" when none is recorded)."""
    for per_rank in (e.inputs, e.outputs):
        for s in per_rank.values():
            snaps = _snaps(s)
            if snaps:
                return snaps[0].dtype
    return ""


def _recorded(e: CollectiveEvent, r: int) -> np.ndarray | None:
    s = e.outputs.get(r)
    snaps = _snaps(s)
    if not snaps or any(x.values is None for x in snaps):
        return None
    if len(snaps) == 1:
        return snaps[0].values
    return np.concatenate([np.asarray(x.values).reshape(-1) for x in snaps])


def event_trace(event: Event) -> Trace:
    """A one-event trace, so that an event alone can be played, plotted or exported."""
    ranks: set[int] = set()
    if isinstance(event, CollectiveEvent):
        ranks = {r for grp in event.groups for r in grp} | set(event.inputs) | set(event.outputs)
    elif isinstance(event, LocalEvent):
        ranks = set(event.inputs) | set(event.outputs)
    elif isinstance(event, RedistributeEvent) and event.before is not None:
        ranks = set(event.before.ranks)
    t = Trace(max(ranks, default=0) + 1, backend="event")
    t.events = [event]
    return t
