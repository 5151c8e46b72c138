"""The layout view as a matplotlib Figure, and what every matplotlib picture shares (``Figure``,
``literal_text``, ``to_png``): the same pictures as the widgets, for papers and saved notebooks.
The collective player's pictures are in ``trace_mpl``, the model map's in ``model_mpl``.

Deterministic: laid out from the content (views/sheet.py), no dates. It builds a bare
``matplotlib.figure.Figure`` (no pyplot), so it leaves no global figure state behind.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.patches import Patch, Polygon, Rectangle

from ..data import describe
from ..geometry.layout import Layout
from . import geometry as g
from .sheet import Figure, Sheet, literal_text, to_png

__all__ = ["Figure", "draw_tensor", "literal_text", "plot_layout", "to_png"]

_HATCH = {"solid": None, "diagonal": "///", "dots": "..", "cross": "++"}
_VIRIDIS = LinearSegmentedColormap.from_list(
    "shardviz-viridis",
    ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"],
)


def _fill(
    ax: Any,
    x: float,
    y: float,
    w: float,
    h: float,
    rank: int,
    gid: str,
    alpha: float = 1.0,
    edge: str = "none",
    pattern_ok: bool = True,
) -> None:
    """A rank's colour, with its pattern where colours repeat (past nine ranks) and the block is
    big enough to show it."""
    color, text, pattern = g.rank_style(rank)
    lw = 0.6 if edge != "none" else None
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, lw=lw, alpha=alpha, gid=gid))
    hatch = _HATCH[pattern]
    if hatch and alpha == 1.0 and pattern_ok:
        ink = "#ffffffb0" if text == "#FFFFFF" else "#00000080"
        ax.add_patch(Rectangle((x, y), w, h, fill=False, hatch=hatch, edgecolor=ink, lw=0, gid="pattern"))


def _value_cells(
    layout: Layout,
    values: Mapping[int, np.ndarray],
    rd: int | None,
    cd: int | None,
    idx: tuple[int, ...],
    nrows: int,
    ncols: int,
    px: float,
    py: float,
) -> tuple[list[tuple[int, int, str]], float] | None:
    """(row, column, text) of every drawn element and the font size (points) that fits them, or
    None when the cells are too small to print into (then the blocks keep their rank labels)."""
    from .flow_mpl import fmt_cell

    if nrows * ncols > 400 or px < 14 or py < 9:
        return None
    try:
        glob = np.asarray(g.global_values(layout, values))
    except (KeyError, ValueError, IndexError):
        return None
    shape = layout.global_shape
    sl = tuple(slice(None) if d in (rd, cd) else idx[d] for d in range(len(shape)))
    img = glob[sl] if shape else glob.reshape(1, 1)
    img = img.reshape(nrows, ncols) if (rd is None or cd is None) else img
    if rd is not None and cd is not None and rd > cd:
        img = img.T
    for digits in (4, 3, 2):
        texts = [(i, j, fmt_cell(img[i, j], digits)) for i in range(nrows) for j in range(ncols)]
        longest = max(len(t) for _, _, t in texts)
        size = min(9.0, py * 0.55, (px - 2) / (0.62 * longest))
        if size >= 6:
            return texts, size
    return None


def _stripes(w: float, h: float, k: int) -> list[tuple[int, list[tuple[float, float]]]]:
    """Diagonal stripes over a w x h block for k owners, in order: (owner index, polygon), the
    block cut by the lines u + v = const, stripe m going to owner m mod k (common.js
    diagonalStripes)."""
    width = (w + h) / max(6, 3 * k)
    out: list[tuple[int, list[tuple[float, float]]]] = []

    def clip(
        poly: list[tuple[float, float]], keep: Callable[[float, float], float]
    ) -> list[tuple[float, float]]:
        res = []
        for i, a in enumerate(poly):
            b = poly[(i + 1) % len(poly)]
            fa, fb = keep(*a), keep(*b)
            if fa >= 0:
                res.append(a)
            if (fa >= 0) != (fb >= 0):
                t = fa / (fa - fb)
                res.append((a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1])))
        return res

    m = 0
    c = 0.0
    while c < w + h - 1e-9:
        poly = [(0.0, 0.0), (w, 0.0), (w, h), (0.0, h)]
        lo, hi = c, c + width
        poly = clip(poly, lambda u, v: u + v - lo)  # noqa: B023 (used at once)
        poly = clip(poly, lambda u, v: hi - (u + v))  # noqa: B023
        if len(poly) >= 3:
            out.append((m % k, poly))
        c += width
        m += 1
    return out


def _partial(ax: Any, x: float, y: float, w: float, h: float) -> None:
    """The hatch that marks a pending reduction."""
    ink = "#00000070"
    ax.add_patch(Rectangle((x, y), w, h, fill=False, hatch="////", edgecolor=ink, lw=0, gid="partial"))


def _label_fits(text: str, w_pt: float, h_pt: float, size: float) -> bool:
    return size >= 5 and len(text) * size * 0.62 < w_pt - 2 and size * 1.2 < h_pt


# The tensor's drawing area at most (inches); a cell is at most CELL_IN on a side.
TENSOR_W, TENSOR_H, CELL_IN = 5.6, 4.2, 0.5
MESH_SIDE = 3.2  # the longest side of one mesh grid, inches
LEGEND_RANKS = 16  # a legend of rank swatches up to this many ranks (past it, the cells say)
NOTE_PT = 8.0


def tensor_size(
    nrows: int, ncols: int, max_w: float = TENSOR_W, max_h: float = TENSOR_H
) -> tuple[float, float]:
    """The drawing area of a nrows x ncols slice in inches: square cells where the shape allows,
    never thinner than a readable strip."""
    cell = min(max_w / max(ncols, 1), max_h / max(nrows, 1), CELL_IN)
    return max(ncols * cell, 1.0), max(nrows * cell, 0.45)


@literal_text
def plot_layout(
    layout: Layout,
    values: Mapping[int, np.ndarray] | None = None,
    *,
    dims: Sequence[int] | None = None,
    index: Sequence[int] | None = None,
    heatmap: bool = False,
    title: str | None = None,
    group: int | None = None,
) -> Figure:
    """Tensor (left) coloured by owning rank(s); mesh (right) with the rank legend under it; the
    placements' notes below: laid out from the content (views/sheet.py).

    A sub-mesh's groups are drawn side by side, each with its own values, up to 16 ranks in all;
    past that one group (``group``, default 0).
    """
    rd, cd = g.view_dims(len(layout.global_shape), dims)
    idx = g.view_index(layout.global_shape, index)
    if heatmap and not values:
        raise ValueError("heatmap=True needs values: this layout was given without any")
    shown = g.shown_groups(layout, group)
    sheet = Sheet()
    names = f" {layout.mesh_dim_names}" if layout.mesh_dim_names else ""
    head = title or f"DTensor {describe.extent(layout.global_shape)} {layout.dtype}"
    sheet.text(0, 0, head, fontsize=12, weight="bold")
    sub = (
        f"mesh {layout.mesh_shape}{names} · placements [{', '.join(layout.placements)}] · "
        f"{layout.world_size} ranks" + (f" in {len(layout.groups)} groups" if layout.groups else "")
    )
    sheet.text(0, sheet.bottom() + 0.04, sub, fontsize=9, color="#444444")
    if len(shown) < len(layout.groups):
        sheet.text(
            0,
            sheet.bottom() + 0.03,
            f"group {shown[0]} of {len(layout.groups)} shown (plot(..., group=k) draws another)",
            fontsize=8,
            color="#444444",
        )
    top = sheet.bottom() + 0.18
    subs = [(gi, layout.group_layout(gi)) for gi in shown] if layout.groups else [(None, layout)]
    # the tensor: one panel, or one per group of a sub-mesh (up to four a row)
    per_row = 1 if len(subs) == 1 else min(len(subs), 4 if len(subs) > 4 else 2)
    scale = 1.0 if len(subs) == 1 else 1.0 / per_row
    right = 0.0
    y = top
    mappable = None
    for row in range(math.ceil(len(subs) / per_row)):
        x = 0.0
        low = y
        for gi, sub_layout in subs[row * per_row : (row + 1) * per_row]:
            ax, im = draw_tensor(
                sheet,
                sub_layout,
                values,
                rd,
                cd,
                idx,
                heatmap,
                TENSOR_W * scale + 1.2 * (scale < 1),
                TENSOR_H * scale,
            )
            ax.set_gid("tensor" if gi is None else f"tensor-g{gi}")
            if gi is not None:
                ax.set_title(
                    f"group {gi}: ranks {g.rank_list(sub_layout.mesh_ranks)}", fontsize=8, loc="left"
                )
            mappable = mappable or im
            box = sheet.place(ax, x, y)
            x = box.x1 + 0.25
            low = max(low, box.y1)
            right = max(right, box.x1)
        y = low + 0.15
    tensor_bottom = y - 0.15
    if mappable is not None:
        cax = sheet.axes(0, 0, 2.2, 0.13, gid="colorbar")
        sheet.fig.colorbar(mappable, cax=cax, orientation="horizontal")
        cax.tick_params(labelsize=7)
        cax.set_title("values", fontsize=8, loc="left")
        nan = sum(int(np.isnan(a).sum()) for a in _nan_counts(layout, values))
        if nan:
            cax.set_xlabel(f"{nan} NaN (grey)", fontsize=7, loc="left")
        tensor_bottom = sheet.place(cax, 0, tensor_bottom + 0.12).y1
    # the mesh: one grid (or a stack of them), or one per group, right of the tensor
    mx = right + 0.45
    my = top
    for gi, sub_layout in subs:
        ax = sheet.axes(mx, my, 1, 1, gid="mesh" if gi is None else f"mesh-g{gi}")
        _draw_mesh(sheet, ax, sub_layout, scale=1.0 if len(subs) == 1 else 0.6)
        if gi is not None:
            ax.set_title(f"group {gi} mesh {layout.mesh_shape}", fontsize=8, loc="left")
        my = sheet.place(ax, mx, my).y1 + 0.15
    legend_bottom = my
    if layout.world_size <= LEGEND_RANKS:
        leg = _rank_legend(sheet, layout, mx, my + 0.05)
        legend_bottom = sheet.extent(leg).y1
    _notes(sheet, layout, max(tensor_bottom, legend_bottom) + 0.2)
    return sheet.finish()


def _nan_counts(layout: Layout, values: Mapping[int, np.ndarray] | None) -> list[np.ndarray]:
    if not values:
        return []
    try:
        return [np.asarray(g.heat(g.global_values(layout, values)))]
    except (KeyError, ValueError, IndexError):
        return []


def _rank_legend(sheet: Sheet, layout: Layout, x: float, y: float) -> Any:
    """Rank swatches with each local shape (empty shards dashed), beside the mesh they explain."""
    handles = []
    for s in layout.shards:
        color, _, pattern = g.rank_style(s.rank)
        handles.append(
            Patch(
                facecolor="white" if s.empty else color,
                edgecolor="#555555",
                hatch=_HATCH[pattern],
                ls="--" if s.empty else "-",
                label=f"r{s.rank} {describe.extent(s.shape)}",
            )
        )
    return sheet.legend(
        x,
        y,
        handles,
        ncols=min(4, max(1, math.ceil(len(handles) / 4))),
        fontsize=8,
        handlelength=1.2,
        handleheight=1.0,
        columnspacing=1.0,
        labelspacing=0.35,
        title="ranks (local shape)",
        title_fontsize=8,
        alignment="left",
    )


def _notes(sheet: Sheet, layout: Layout, y: float) -> None:
    """The placements in words, wrapped to the picture's width, under everything."""
    lines = g.notes(layout)
    if any(s.empty for s in layout.shards) and 0 not in layout.global_shape:
        lines.append("dashed white cell = empty shard (0 elements)")
    width = max(sheet.right(), 6.0)
    chars = int(width * 72 / (NOTE_PT * 0.6))
    out: list[str] = []
    for line in lines[:6]:
        out += textwrap.wrap(line, chars, subsequent_indent="    ")[:3]
    if out:
        sheet.text(0, y, "\n".join(out), fontsize=NOTE_PT, color="#333333", linespacing=1.35, gid="notes")


def draw_tensor(
    sheet: Sheet,
    layout: Layout,
    values: Mapping[int, np.ndarray] | None,
    rd: int | None,
    cd: int | None,
    idx: tuple[int, ...],
    heatmap: bool,
    max_w: float = TENSOR_W,
    max_h: float = TENSOR_H,
) -> tuple[Any, Any]:
    """The drawn slice of the global tensor, each block coloured by its owner(s), in a new axes of
    the sheet sized to the slice; returns the axes and the heat-map's image (None without one)."""
    shape = layout.global_shape
    nrows = shape[rd] if rd is not None else 1
    ncols = shape[cd] if cd is not None else 1
    w_in, h_in = tensor_size(nrows, ncols, max_w, max_h) if 0 not in shape else (2.4, 0.6)
    ax = sheet.axes(0, 0, w_in, h_in)
    sub = f" · rows dim {rd}, columns dim {cd} at {idx}" if len(shape) >= 3 else ""
    ax.set_title(f"global tensor {describe.extent(shape)}{sub}", fontsize=10, loc="left", pad=4)
    if 0 in shape:
        ax.set_axis_off()
        ax.text(
            0.0,
            0.5,
            f"empty tensor {describe.extent(shape)}: no elements",
            ha="left",
            va="center",
            fontsize=10,
        )
        return ax, None
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    blocks = g.blocks(layout, (rd, cd), idx)
    partial = g.partial_info(layout) is not None
    alpha = 0.15 if heatmap else 1.0
    im = None
    if heatmap and values:
        glob = g.heat(g.global_values(layout, values))
        sl = tuple(slice(None) if d in (rd, cd) else idx[d] for d in range(len(shape)))
        img = glob[sl] if shape else glob.reshape(1, 1)
        img = img.reshape(nrows, ncols) if (rd is None or cd is None) else img
        if rd is not None and cd is not None and rd > cd:
            img = img.T
        cmap = _VIRIDIS.with_extremes(bad="#bbbbbb")
        finite = img[np.isfinite(img)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        im = ax.imshow(
            np.ma.masked_invalid(np.clip(img, lo, hi) if finite.size else img),
            cmap=cmap,
            extent=(0, ncols, nrows, 0),
            interpolation="nearest",
            vmin=lo,
            vmax=hi if hi > lo else lo + 1,
            aspect="auto",
        )
    px, py = w_in * 72 / ncols, h_in * 72 / nrows  # points per element
    # Rank labels on every block or on none, so a dense picture does not look half-labelled.
    label_all = all(
        _label_fits(
            f"r{b.owners[0]}",
            (b.col1 - b.col0) * px,
            (b.row1 - b.row0) * py,
            min(10.0, (b.row1 - b.row0) * py * 0.35),
        )
        for b in blocks
        if len(b.owners) == 1
    )
    # Values in the cells where they fit (the colours and the legend still say who holds what).
    cells = (
        _value_cells(layout, values, rd, cd, idx, nrows, ncols, px, py) if values and not heatmap else None
    )
    for b in blocks:
        x, y, w, h = b.col0, b.row0, b.col1 - b.col0, b.row1 - b.row0
        if not b.owners:
            ax.add_patch(
                Rectangle((x, y), w, h, facecolor="#f4f4f4", edgecolor="#bbbbbb", ls="--", gid="unowned")
            )
            continue
        if len(b.owners) == 1:
            _fill(
                ax,
                x,
                y,
                w,
                h,
                b.owners[0],
                f"shard-r{b.owners[0]}",
                alpha,
                pattern_ok=min(w * px, h * py) >= 6,
            )
        elif len(b.owners) <= g.MAX_STRIPES:
            # diagonal stripes, one colour per owner in turn: shared, not split into columns
            for i, pts in _stripes(w * px, h * py, len(b.owners)):
                r = b.owners[i]
                color, _, _ = g.rank_style(r)
                ax.add_patch(
                    Polygon(
                        [(x + u / px, y + v / py) for u, v in pts],
                        closed=True,
                        facecolor=color,
                        edgecolor="none",
                        alpha=alpha,
                        gid=f"shard-r{r}",
                    )
                )
        else:
            ax.add_patch(
                Rectangle((x, y), w, h, facecolor="#d9d9d9", edgecolor="none", gid=f"shard-r{b.owners[0]}")
            )
        if partial and not heatmap:
            _partial(ax, x, y, w, h)
        if w * px >= 4 and h * py >= 4:  # a border on blocks big enough to keep their colour
            ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="white", lw=1.2, gid="edge"))
        if cells is not None or (len(b.owners) == 1 and not label_all):
            continue
        if len(b.owners) == 1:
            label = f"r{b.owners[0]}"
            s = layout.shard(b.owners[0])
            sub = describe.extent(s.shape)
            ink = g.rank_style(b.owners[0])[1]
        else:
            label = (
                f"r{g.rank_list(b.owners)}" if len(b.owners) <= g.MAX_STRIPES else f"{len(b.owners)} ranks"
            )
            sub = "partial" if partial else "shared"
            ink = "black"
        wpt, hpt = w * px, h * py
        size = min(10.0, hpt * 0.35)
        if _label_fits(label, wpt, hpt, size):
            two = hpt > size * 2.8 and _label_fits(sub, wpt, hpt / 2, size * 0.85)
            # over a heat-map or stripes the label sits on a white box, so it stays readable
            boxed = heatmap or len(b.owners) > 1
            ax.text(
                x + w / 2,
                y + h / 2,
                f"{label}\n{sub}" if two else label,
                ha="center",
                va="center",
                fontsize=size,
                color="black" if boxed else ink,
                family="monospace",
                gid="rank-label",
                bbox={"facecolor": "white", "alpha": 0.85, "lw": 0, "pad": 1} if boxed else None,
            )
    if cells is not None:
        texts, size = cells
        for i, j, t in texts:
            ax.text(
                j + 0.5,
                i + 0.5,
                t,
                ha="center",
                va="center",
                fontsize=size,
                family="monospace",
                gid="value",
                bbox={"facecolor": "white", "alpha": 0.55, "lw": 0, "pad": 0.6},
            )
    ax.add_patch(Rectangle((0, 0), ncols, nrows, fill=False, edgecolor="#333333", lw=1, gid="frame"))
    rcuts = sorted({b.row0 for b in blocks} | {nrows})
    ccuts = sorted({b.col0 for b in blocks} | {ncols})
    ax.set_yticks(_thin(rcuts, py, 9.0) if rd is not None else [])
    ax.set_xticks(_thin(ccuts, px, 7.0 * 0.62 * max(len(str(ncols)), 1) + 4) if cd is not None else [])
    ax.tick_params(labelsize=7, length=2, top=True, labeltop=True, bottom=False, labelbottom=False)
    if rd is not None:
        # read top to bottom, so the arrow points the way the row indices grow
        ax.set_ylabel(
            f"dim {rd} →", fontsize=8, rotation=-90, rotation_mode="default", ha="right", va="center"
        )
    if cd is not None:
        ax.set_xlabel(f"dim {cd} →", fontsize=8, labelpad=3)
        ax.xaxis.set_label_position("top")
    for side in ax.spines.values():
        side.set_visible(False)
    return ax, im


def _fit(name: str, tail: str, room: float, fontsize: float) -> str:
    """``name + tail`` cut to about ``room`` points of ``fontsize`` text, the name shortened with an
    ellipsis (a long mesh dim name along a short side would run over its neighbours)."""
    per_char = fontsize * 0.62
    fits = int(room / per_char) - len(tail)
    if len(name) <= max(fits, 1):
        return name + tail
    return name[: max(fits - 1, 1)] + "…" + tail


def _thin(cuts: list[int], per_unit: float, room: float) -> list[int]:
    """Tick positions at least ``room`` points apart (``per_unit`` points per element), the last
    always kept (the one before it goes instead)."""
    out: list[int] = []
    for c in cuts:
        if not out or (c - out[-1]) * per_unit >= room:
            out.append(c)
    if out[-1] != cuts[-1]:
        while len(out) > 1 and (cuts[-1] - out[-1]) * per_unit < room:
            out.pop()
        out.append(cuts[-1])
    return out


def _draw_mesh(sheet: Sheet, ax: Any, layout: Layout, scale: float = 1.0) -> None:
    """The mesh: 1-D a row (wrapped past 32), 2-D a grid, 3-D+ a grid of 2-D grids; each cell a
    rank in its colour with its number (and local shape where it fits). Resizes ``ax`` to fit."""
    ms = layout.mesh_shape
    labels = g.dim_labels(layout)
    ax.set_title(f"mesh {ms}", fontsize=10, loc="left", pad=4)
    ax.set_axis_off()
    if len(ms) == 1:
        cols = min(ms[0], 32)
        rows = math.ceil(ms[0] / cols)
        lead, per = 1, ms[0]
    else:
        rows, cols = ms[-2], ms[-1]
        lead, per = math.prod(ms[:-2]), rows * cols
    gcols = min(lead, 4)
    grows = math.ceil(lead / gcols)
    gap = 1.0
    head = 0.8 if len(ms) >= 3 else 0.0  # room for each grid's title
    width = gcols * cols + (gcols - 1) * gap
    height = grows * (rows + head) + (grows - 1) * gap * 0.5
    unit_in = max(0.16, min(0.62, MESH_SIDE * scale / max(width, height)))
    unit = unit_in * 72  # points per cell
    # bands inside the axes for the dim labels (7 pt text), in cells
    band = max(0.5, 12 / unit)
    left = band if len(ms) >= 2 else 0.0
    sheet.axes_resize(ax, (width + left) * unit_in, (height + band) * unit_in)
    ax.set_xlim(-left, width)
    ax.set_ylim(height, -band)
    partial = g.partial_info(layout) is not None
    size = min(9.0, unit * 0.3)
    for gi in range(lead):
        ox = (gi % gcols) * (cols + gap)
        oy = (gi // gcols) * (rows + head + gap * 0.5) + head
        if len(ms) >= 3:
            coord = layout.shards[gi * per].coord
            name = ", ".join(f"{labels[m]}={c}" for m, c in enumerate(coord[:-2]))
            ax.text(ox, oy - 0.12, name, fontsize=7, va="bottom")
        if gi == 0:
            top = oy - (head if head else 0.0) - 0.12
            if len(ms) >= 2:
                ax.text(ox, top, f"{labels[-1]} ({cols}) →", fontsize=7, va="bottom")
                # read top to bottom, so the arrow points the way the rows grow
                ax.text(
                    ox - 0.12,
                    oy + rows / 2,
                    _fit(labels[-2], f" ({rows}) →", rows * unit, 7),
                    fontsize=7,
                    rotation=-90,
                    va="center",
                    ha="right",
                )
            else:
                ax.text(ox, top, f"{labels[0]} ({ms[0]}) →", fontsize=7, va="bottom")
        for k in range(per):
            s = layout.shards[gi * per + k]
            x, y = ox + k % cols, oy + k // cols
            ink = g.rank_style(s.rank)[1]
            if s.empty:
                ax.add_patch(
                    Rectangle(
                        (x + 0.05, y + 0.05),
                        0.9,
                        0.9,
                        facecolor="white",
                        edgecolor="#777777",
                        ls="--",
                        gid=f"mesh-r{s.rank}",
                    )
                )
                ink = "#333333"
            else:
                _fill(ax, x + 0.05, y + 0.05, 0.9, 0.9, s.rank, f"mesh-r{s.rank}", edge="#555555")
                if partial:
                    _partial(ax, x + 0.05, y + 0.05, 0.9, 0.9)
            if size >= 5:
                text = str(s.rank)
                shape = "empty" if s.empty else describe.extent(s.shape)
                if unit >= 34 and len(shape) * size * 0.75 * 0.62 < unit * 0.85:
                    text += "\n" + shape
                ax.text(
                    x + 0.5,
                    y + 0.5,
                    text,
                    ha="center",
                    va="center",
                    fontsize=size if "\n" not in text else size * 0.85,
                    color=ink,
                    family="monospace",
                )
