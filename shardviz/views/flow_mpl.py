"""A collective's data flow as a matplotlib Figure: the same picture as the player's (static/player/
flow.js and buffers.js), for saved notebooks and ``sv.plot(event)``.

The axes are in pixels (y down), laid out as the player lays them out: buffers drawn from
``grid.drawn_grid`` (readable cells, chunk borders kept, ellipsis bands where elements are left
out), values printed into the cells where they fit (else the buffer's value range), and arrows that
never cross a buffer (they leave through its bottom edge or a lane beside it, curve below every
input, and enter through the top edge or a lane).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.path import Path

from ..data import describe
from ..data.events import CollectiveEvent, Event, LocalEvent, TensorSnapshot
from . import geometry as g
from .buffers import p2p_pairs
from .grid import FLOW_WIDTH, Runs, grid_shape

DPI = 100
PT = 72 / DPI  # points per pixel
CELL_H = 16
CELL_W_MAX = 46
CELL_W_MIN = 6
MAX_BUF_H = 250
BAND = 10
SLOT_GAP = 6
LABEL_W = 20
LANE = 4
LINE = 13
COL_W_MAX = 220
VALUE_FONT = 10  # px
VALUE_FONT_MIN = 7
# Groups drawn in one figure before the rest are only counted.
PLOT_GROUPS = 4
# A group's ranks drawn side by side: past this a picture grows to hundreds of inches and minutes.
RANKS_DRAWN = 16
SHOW_GROUPS_UP_TO = 16


@dataclass
class Axis:
    """One axis of a slot as drawn (flow.js axisMap)."""

    runs: Runs
    cell: float
    starts: list[float] = field(default_factory=list)
    size: float = 0.0

    def __post_init__(self) -> None:
        px = 0.0
        for i, (a, b) in enumerate(self.runs):
            if i:
                px += BAND
            self.starts.append(px)
            px += (b - a) * self.cell
        self.size = px

    def at(self, k: int) -> float:
        for i, (a, b) in enumerate(self.runs):
            if k <= b:
                return self.starts[i] + (k - a) * self.cell if k >= a else self.starts[i] - BAND / 2
        return self.size

    def gaps(self) -> list[float]:
        return [s - BAND for s in self.starts[1:]]


@dataclass
class Slot:
    y: float
    rows: Axis
    cols: Axis
    nr: int
    nc: int

    @property
    def w(self) -> float:
        return max(self.cols.size, 4.0)

    @property
    def h(self) -> float:
        return max(self.rows.size, 6.0)


@dataclass
class Drawn:
    """One rank's buffer on one side, placed."""

    x: float
    y: float
    slots: list[Slot]
    buf: Mapping[str, Any]
    rank: int
    side: str
    ch: float

    @property
    def w(self) -> float:
        return max([4.0, *(s.w for s in self.slots)])

    @property
    def h(self) -> float:
        return max(sum(s.h for s in self.slots) + SLOT_GAP * (len(self.slots) - 1), 6.0)

    def part_box(self, part: Mapping[str, Any]) -> tuple[float, float, float, float]:
        """(x0, x1, y0, y1) of a part, relative to the buffer's top left."""
        sb = self.slots[part.get("slot") or 0]
        r0, r1, c0, c1 = part["box"]
        x0, x1 = sb.cols.at(c0), sb.cols.at(c1)
        y0, y1 = sb.y + sb.rows.at(r0), sb.y + sb.rows.at(r1)
        return x0, max(x1, x0 + 1), y0, max(y1, y0 + 1)


def _runs(buf: Mapping[str, Any], k: int, shape: Sequence[int]) -> tuple[Runs, Runs]:
    nr, nc = grid_shape(shape)
    grid = buf.get("grid")
    if grid:
        rr, cc = grid[k]
        return tuple((a, b) for a, b in rr), tuple((a, b) for a, b in cc)
    return ((0, nr),) if nr else (), ((0, nc),) if nc else ()


def _counts(buf: Mapping[str, Any]) -> tuple[int, int, float, int]:
    """(drawn rows, row bands, widest drawn columns in cells, slots)."""
    shapes = buf.get("slots") or [buf["shape"]]
    rows = bands = 0
    cols = 1.0
    for k, shape in enumerate(shapes):
        rr, cc = _runs(buf, k, shape)
        rows += max(sum(b - a for a, b in rr), 1)
        bands += max(len(rr) - 1, 0)
        cols = max(cols, sum(b - a for a, b in cc) + max(len(cc) - 1, 0) * BAND / CELL_W_MAX)
    return rows, bands, cols, len(shapes)


def _place(buf: Mapping[str, Any], cw: float, rank: int, side: str) -> Drawn:
    shapes = buf.get("slots") or [buf["shape"]]
    rows, bands, _, nslots = _counts(buf)
    ch = min(CELL_H, max(3.0, (MAX_BUF_H - bands * BAND - (nslots - 1) * SLOT_GAP) / max(rows, 1)))
    slots, y = [], 0.0
    for k, shape in enumerate(shapes):
        rr, cc = _runs(buf, k, shape)
        nr, nc = grid_shape(shape)
        s = Slot(y, Axis(rr, ch), Axis(cc, cw), nr, nc)
        slots.append(s)
        y += s.h + SLOT_GAP
    return Drawn(0.0, 0.0, slots, buf, rank, side, ch)


def fmt_cell(v: Any, digits: int) -> str:
    """A value with at most ``digits`` significant digits (flow.js fmtCell)."""
    if isinstance(v, bool | np.bool_):
        return "True" if v else "False"
    if isinstance(v, complex | np.complexfloating):
        return f"{complex(v):.{digits}g}".strip("()")
    x = float(v)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x.is_integer() and abs(x) < 1e7:
        return str(int(x))
    plain = f"{x:.{digits}g}"
    sci = f"{x:.{max(digits - 1, 0)}e}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")
    return sci if len(sci) < len(plain) else plain


def _snapshots(e: Event, rank: int, side: str) -> list[TensorSnapshot | None]:
    if isinstance(e, CollectiveEvent) and e.op in ("send", "recv"):
        pairs = p2p_pairs(e)
        src = next((a for a, b in pairs if b == rank), None)
        if side == "out" and e.op == "send" and src is not None:
            return []  # on its way: the values are the sender's, shown there
        per_rank = e.inputs if side == "in" else e.outputs
    elif isinstance(e, CollectiveEvent | LocalEvent):
        per_rank = e.inputs if side == "in" else e.outputs
    else:
        return []
    s = per_rank.get(rank)
    if s is None:
        return []
    return list(s) if isinstance(s, list) else [s]


class _Canvas:
    """Drawing helpers in pixel coordinates."""

    def __init__(self, ax: Any) -> None:
        self.ax = ax

    def rect(self, x: float, y: float, w: float, h: float, **kw: Any) -> None:
        # add_artist, not add_patch: the limits are set once at the end, and updating them per
        # patch was most of the time of a 64-rank step's picture
        self.ax.add_artist(Rectangle((x, y), w, h, **kw))

    def text(self, x: float, y: float, s: str, px: float, **kw: Any) -> None:
        self.ax.text(x, y, s, fontsize=px * PT, **kw)


def plot_flow(fig: Any, ax: Any, d: Mapping[str, Any], event: Event, top: float = 0.0) -> tuple[float, float]:
    """Draw the data flow of the detail ``d`` into ``ax`` from y = ``top`` (pixels); returns the
    (width, height) used. Groups are stacked one under another."""
    groups = d["groups"]
    total = sum(len(x) for x in groups)
    shown = (
        list(range(len(groups))) if total <= SHOW_GROUPS_UP_TO else list(range(min(PLOT_GROUPS, len(groups))))
    )
    c = _Canvas(ax)
    y = top
    width = 0.0
    for gi in shown:
        cut = len(groups[gi]) > RANKS_DRAWN
        if len(groups) > 1 or cut:
            members = g.rank_list(groups[gi])
            if len(members) > 48:  # 64 strided ranks: the first few, the last, and how many
                first = ", ".join(str(r) for r in groups[gi][:4])
                members = f"{first}, …, {groups[gi][-1]} ({len(groups[gi])} ranks)"
            head = f"group {gi}: ranks {members}" if len(groups) > 1 else "ranks"
            if cut:
                rest = groups[gi][RANKS_DRAWN:]
                head += f" · the first {RANKS_DRAWN} drawn, with what they send each other"
                head += f"; {len(rest)} more not drawn"
            c.text(2, y + 10, head, 11, color="#444444", va="baseline")
            y += 14
        w, h = _group(c, d, gi, event, y)
        width = max(width, w)
        y += h + 8
    return width, y - top


def _group(c: _Canvas, d: Mapping[str, Any], gi: int, event: Event, top: float) -> tuple[float, float]:
    ranks = list(d["groups"][gi])[:RANKS_DRAWN]
    n = len(ranks)
    members = set(ranks)
    arrows = [(*t, True) for t in d.get("stays") or []] + [(*t, False) for t in d.get("transfers") or []]
    arrows = [t for t in arrows if t[0] in members and t[1] in members]
    info = {r: d["ranks"].get(str(r), {}) for r in ranks}

    def lanes_of(r: int, side: str) -> list[int]:
        buf = info[r].get(side)
        if not buf or not buf.get("parts"):
            return []
        used = {t[2] if side == "in" else t[3] for t in arrows if (t[0] if side == "in" else t[1]) == r}
        return [i for i in range(len(buf["parts"])) if i in used]

    def lane_count(side: str) -> int:
        return max([0, *(len(lanes_of(r, side)) for r in ranks)])

    gl = max(LABEL_W, 10 + LANE * lane_count("out"))
    gr = max(LABEL_W, 10 + LANE * lane_count("in"))
    counts = [_counts(info[r][s]) for r in ranks for s in ("in", "out") if info[r].get(s)]
    max_cols = max([1.0, *(x[2] for x in counts)])
    per_col = max(60.0, (FLOW_WIDTH - 40) / n)
    cw = min(CELL_W_MAX, max(CELL_W_MIN, (per_col - gl - gr - 6) / max_cols))
    placed: dict[tuple[int, str], Drawn] = {}
    for r in ranks:
        for side in ("in", "out"):
            if info[r].get(side):
                placed[(r, side)] = _place(info[r][side], cw, r, side)
    buf_w = max([8.0, *(a.w for a in placed.values())])
    col_w = max(gl + buf_w + gr, min(per_col, COL_W_MAX))
    left = 20.0
    h_in = max([8.0, *(a.h for (_, s), a in placed.items() if s == "in")])
    h_out = max([8.0, *(a.h for (_, s), a in placed.items() if s == "out")])
    y_in = top + 24 + LINE
    exit_y = y_in + h_in + 8
    zone = 40 if d.get("op") == "barrier" else min(150, 56 + 8 * n)
    entry_y = exit_y + zone
    y_out = entry_y + 8
    width = left + n * col_w + 6
    height = y_out + h_out + 2 * LINE + 6 - top
    pairs = {tuple(x) for x in d.get("pairs") or []}
    roots = set(d.get("roots") or []) if not pairs else set()
    for i, r in enumerate(ranks):
        x0 = left + i * col_w
        inset = (col_w - gl - buf_w - gr) / 2
        cx = x0 + inset + gl + buf_w / 2
        fill, ink, _ = g.rank_style(r)
        c.rect(cx - 24, top + 4, 48, 16, facecolor=fill, edgecolor="none", gid=f"rank-r{r}")
        role = (
            " root"
            if r in roots
            else " src"
            if any(a == r for a, _ in pairs)
            else " dst"
            if any(b == r for _, b in pairs)
            else ""
        )
        c.text(cx, top + 12, f"r{r}{role}", 10, ha="center", va="center", color=ink, family="monospace")
        for side, y in (("in", y_in), ("out", y_out)):
            a = placed.get((r, side))
            if a is None:
                if d.get("op") != "barrier":
                    c.text(cx, y + 12, "—", 10, ha="center", color="#888888")
                continue
            a.x, a.y = x0 + inset + gl + (buf_w - a.w) / 2, y
            label_y = y - 4 if side == "in" else y + a.h + 11
            _draw_buffer(c, a)
            role_text = {"ignored": "not read", "undefined": "not defined", "pending": "→ its recv"}.get(
                a.buf.get("role") or ""
            )
            if role_text:
                c.text(a.x, label_y, role_text, 9, color="#666666", va="baseline")
            else:
                _values(c, a, _snapshots(event, r, side), label_y)
        if d.get("kind") != "local" and "nbytes" in info[r]:
            c.text(
                cx,
                top + height - 6,
                f"{_human(info[r].get('bus') or 0)} bus",
                9,
                ha="center",
                color="#666666",
            )
    for text, y, h in (("before", y_in, h_in), ("after", y_out, h_out)):
        c.text(9, y + h / 2, text, 10, rotation=90, ha="center", va="center", color="#666666")
    if d.get("op") == "barrier":
        mid = (exit_y + entry_y) / 2
        c.ax.plot([4, width - 4], [mid, mid], ls="--", color="#882255", lw=2, gid="barrier")
        c.text(width / 2, mid - 4, "barrier: all wait here", 10, ha="center", color="#882255")
    _draw_arrows(c, arrows, placed, exit_y, entry_y, lanes_of)
    return width, height


def _human(n: float) -> str:
    return describe.bytes_text(n)


def _tint(origin: int | None, reduced: bool) -> str:
    if reduced:
        return "#d9d9d9"
    return "#eeeeee" if origin is None else g.rank_style(origin)[0]


def _draw_buffer(c: _Canvas, a: Drawn) -> None:
    buf, x, y = a.buf, a.x, a.y
    parts = buf.get("parts") or []
    own = a.rank if a.side == "in" else buf.get("origin")
    faded = 0.35 if buf.get("role") else 1.0

    def pad(sb: Slot, box: Sequence[int]) -> None:
        a0, a1, b0, b1 = box
        py, px = y + sb.y + sb.rows.at(a0), x + sb.cols.at(b0)
        c.rect(
            px,
            py,
            max(sb.cols.at(b1) - sb.cols.at(b0), 1),
            max(sb.rows.at(a1) - sb.rows.at(a0), 1),
            facecolor="#e6e6e6",
            hatch="////",
            edgecolor="#888888",
            lw=0,
            gid="pad",
        )

    for k, sb in enumerate(a.slots):
        oy = y + sb.y
        if sb.nr * sb.nc == 0:
            c.rect(
                x, oy, max(sb.w, 10), max(sb.h, 6), facecolor="white", edgecolor="#888888", ls="--", lw=0.8
            )
            continue
        mine = [p for p in parts if (p.get("slot") or 0) == k]
        if not mine:
            c.rect(
                x,
                oy,
                sb.w,
                sb.h,
                facecolor=_tint(own, bool(buf.get("reduced"))),
                alpha=0.45 * faded,
                lw=0,
                gid="part",
            )
        for p in mine:
            x0, x1, y0, y1 = a.part_box(p)
            origin = p.get("origin", a.rank if a.side == "in" else None)
            c.rect(
                x + x0,
                y + y0,
                x1 - x0,
                y1 - y0,
                facecolor=_tint(origin, bool(p.get("reduced"))),
                alpha=0.45 * faded,
                lw=0,
                gid="part",
            )
            for box in p.get("pad") or []:
                pad(sb, box)
        if k == 0 and not buf.get("slots"):
            for box in buf.get("pad") or []:
                pad(sb, box)
        if a.ch >= 4 and sb.cols.cell >= 4:
            for r0, r1 in sb.rows.runs:
                for i in range(r0 + 1, r1):
                    yy = oy + sb.rows.at(i)
                    c.ax.plot([x, x + sb.w], [yy, yy], color="#000000", alpha=0.15 * faded, lw=0.5)
            for c0, c1 in sb.cols.runs:
                for j in range(c0 + 1, c1):
                    xx = x + sb.cols.at(j)
                    c.ax.plot([xx, xx], [oy, oy + sb.h], color="#000000", alpha=0.15 * faded, lw=0.5)
        for gy in sb.rows.gaps():
            c.rect(x, oy + gy, sb.w, BAND, facecolor="white", alpha=0.6, lw=0)
            c.text(x + sb.w / 2, oy + gy + BAND / 2, "⋮", 10, ha="center", va="center", color="#555555")
        row_marks = [oy + gy + BAND / 2 for gy in sb.rows.gaps()]
        for gx in sb.cols.gaps():
            c.rect(x + gx, oy, BAND, sb.h, facecolor="white", alpha=0.6, lw=0)
            mx, my = x + gx + BAND / 2, oy + min(sb.h, 16) / 2
            if abs(mx - (x + sb.w / 2)) < 10:
                # the column gap crosses the row gaps' "⋮": the "…" goes beside each, not over it
                while any(abs(my - ry) < 11 for ry in row_marks) and my + 11 < oy + sb.h:
                    my += 11
                if any(abs(my - ry) < 11 for ry in row_marks):
                    continue  # no room beside them: the white band alone says columns are elided
            c.text(mx, my, "…", 10, ha="center", va="center", color="#555555")
        c.rect(
            x,
            oy,
            sb.w,
            sb.h,
            fill=False,
            edgecolor="#333333",
            lw=1.0,
            ls="--" if buf.get("role") == "pending" else "-",
            alpha=faded,
            gid="buffer",
        )
    for i, p in enumerate(parts):
        x0, x1, y0, y1 = a.part_box(p)
        c.rect(x + x0, y + y0, x1 - x0, y1 - y0, fill=False, edgecolor="#333333", lw=0.8, alpha=faded)
        sb = a.slots[p.get("slot") or 0]
        if y1 - y0 >= 9 and p["box"][2] == 0 and p["box"][3] == sb.nc:
            ly = y + y0 + min(y1 - y0, CELL_H) / 2
            label = ("Σ" if p.get("reduced") else "") + str(i)
            if a.side == "in":
                c.text(x - 3, ly, label, 9, ha="right", va="center", family="monospace", color="#333333")
            else:
                c.text(x + a.w + 3, ly, label, 9, ha="left", va="center", family="monospace", color="#333333")
    if not parts and buf.get("reduced"):
        lx = x - 3 if a.side == "in" else x + a.w + 3
        c.text(lx, y + 8, "Σ", 9, ha="right" if a.side == "in" else "left", va="center", color="#333333")


def _values(c: _Canvas, a: Drawn, snaps: list[TensorSnapshot | None], label_y: float) -> None:
    """Values into the drawn cells when they fit, else the value range on the label line."""
    if not snaps or any(s is None or s.values is None for s in snaps) or len(snaps) != len(a.slots):
        return
    cells: list[tuple[int, int, int, Any]] = []
    for k, (sb, s) in enumerate(zip(a.slots, snaps, strict=True)):
        assert s is not None and s.values is not None
        if sb.nr * sb.nc == 0:
            continue
        flat = np.asarray(s.values).reshape(-1)
        for r0, r1 in sb.rows.runs:
            for i in range(r0, r1):
                for c0, c1 in sb.cols.runs:
                    for j in range(c0, c1):
                        cells.append((k, i, j, flat[i * sb.nc + j]))
    texts: list[tuple[int, int, int, str]] = []
    fs = 0.0
    for digits in (4, 3, 2):
        texts = [(k, i, j, fmt_cell(v, digits)) for k, i, j, v in cells]
        longest = max([1, *(len(t[3]) for t in texts)])
        fs = min(VALUE_FONT, a.ch - 4, (a.slots[0].cols.cell - 3) / (0.62 * longest))
        if fs >= VALUE_FONT_MIN:
            break
    if texts and fs >= VALUE_FONT_MIN:
        for k, i, j, t in texts:
            sb = a.slots[k]
            c.text(
                a.x + sb.cols.at(j) + sb.cols.cell / 2,
                a.y + sb.y + sb.rows.at(i) + a.ch / 2,
                t,
                fs,
                ha="center",
                va="center",
                family="monospace",
                gid="value",
            )
        return
    lows = [s.summary.min for s in snaps if s is not None and s.summary and s.summary.min is not None]
    highs = [s.summary.max for s in snaps if s is not None and s.summary and s.summary.max is not None]
    if lows and highs:
        c.text(
            a.x,
            label_y,
            f"{fmt_cell(min(lows), 4)} … {fmt_cell(max(highs), 4)}",
            9,
            color="#555555",
            va="baseline",
            gid="value-range",
        )


def _draw_arrows(
    c: _Canvas,
    arrows: list[tuple[Any, ...]],
    placed: dict[tuple[int, str], Drawn],
    exit_y: float,
    entry_y: float,
    lanes_of: Any,
) -> None:
    ends: dict[tuple[int, str, Any], dict[str, Any] | None] = {}

    def end_of(rank: int, side: str, part: int | None) -> dict[str, Any] | None:
        key = (rank, side, part)
        if key in ends:
            return ends[key]
        a = placed.get((rank, side))
        e: dict[str, Any] | None = None
        if a is not None:
            parts = a.buf.get("parts") or []
            if part is not None and part < len(parts):
                x0, x1, y0, y1 = a.part_box(parts[part])
            else:
                x0, x1, y0, y1 = 0.0, a.w, 0.0, a.h
            on_edge = abs(y1 - a.h) < 0.5 if side == "in" else abs(y0) < 0.5
            if on_edge:
                e = {
                    "edge": True,
                    "x0": a.x + x0,
                    "x1": a.x + x1,
                    "y": a.y + a.h if side == "in" else a.y,
                    "n": 0,
                }
            else:
                lanes = lanes_of(rank, side)
                order = lanes.index(part) if part in lanes else 0
                idx = len(lanes) - 1 - order if side == "in" else order
                e = {
                    "edge": False,
                    "lane": a.x + a.w + 6 + idx * LANE if side == "in" else a.x - 6 - idx * LANE,
                    "mid": a.y + (y0 + y1) / 2,
                    "at": a.x + x1 if side == "in" else a.x + x0 - 1,
                }
        ends[key] = e
        return e

    for src, dst, sp, dp, *_ in arrows:
        for e in (end_of(src, "in", sp), end_of(dst, "out", dp)):
            if e is not None and e["edge"]:
                e["n"] += 1

    def spread(e: dict[str, Any]) -> float:
        k = e.get("used", 0)
        e["used"] = k + 1
        step = min(5.0, (e["x1"] - e["x0"]) / (e["n"] + 1))
        return float((e["x0"] + e["x1"]) / 2 + (k - (e["n"] - 1) / 2) * step)

    for src, dst, sp, dp, reduce, stay in arrows:
        a, b = end_of(src, "in", sp), end_of(dst, "out", dp)
        if a is None or b is None:
            continue
        verts: list[tuple[float, float]]
        codes: list[Any]
        if a["edge"]:
            x1 = spread(a)
            verts, codes = [(x1, a["y"]), (x1, exit_y)], [Path.MOVETO, Path.LINETO]
        else:
            x1 = a["lane"]
            verts = [(a["at"], a["mid"]), (x1, a["mid"]), (x1, exit_y)]
            codes = [Path.MOVETO, Path.LINETO, Path.LINETO]
        x2 = spread(b) if b["edge"] else b["lane"]
        k = (entry_y - exit_y) * 0.5
        verts += [(x1, exit_y + k), (x2, entry_y - k), (x2, entry_y)]
        codes += [Path.CURVE4] * 3
        if b["edge"]:
            verts.append((x2, b["y"]))
            codes.append(Path.LINETO)
        else:
            verts += [(x2, b["mid"]), (b["at"], b["mid"])]
            codes += [Path.LINETO, Path.LINETO]
        color = g.rank_style(src)[0]
        gid = ("stay" if stay else "transfer") + ("-reduce" if reduce else "")
        c.ax.add_patch(
            FancyArrowPatch(
                path=Path(verts, codes),
                arrowstyle="-|>",
                mutation_scale=10,
                color=color,
                lw=1.1 if not stay else 0.9,
                ls="-" if not stay else (0, (3, 3)),
                alpha=0.85,
                gid=gid,
            )
        )
