"""The layout view as a matplotlib Figure, and what every matplotlib picture shares (``Figure``,
``literal_text``, ``to_png``): the same pictures as the widgets, for papers and saved notebooks.
The collective player's pictures are in ``trace_mpl``, the model map's in ``model_mpl``.

Deterministic: a fixed figure size, fixed axes positions, no dates. It builds a bare
``matplotlib.figure.Figure`` (no pyplot), so it leaves no global figure state behind.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure as _MplFigure
from matplotlib.patches import Patch, Polygon, Rectangle

from ..data import describe
from ..geometry.layout import Layout
from . import geometry as g

FIGSIZE = (11.0, 5.6)
_HATCH = {"solid": None, "diagonal": "///", "dots": "..", "cross": "++"}
_VIRIDIS = ListedColormap(
    ["#440154", "#472d7b", "#3b528b", "#2c728e", "#21918c", "#28ae80", "#5ec962", "#addc30", "#fde725"]
).resampled(256)


class Figure(_MplFigure):
    """A matplotlib Figure that shows itself as a PNG in a notebook.

    IPython draws a bare Figure as a picture only when the inline backend registered its
    formatter (``%matplotlib inline``, or importing pyplot); shardviz never imports pyplot, so
    without this ``sv.plot(...)`` as a cell's last expression showed only ``<Figure size ...>``.
    Where the inline formatter is registered it takes precedence (one picture either way), and a
    plain script's backend is left alone.
    """

    def _repr_png_(self) -> bytes:
        return to_png(self)


_P = ParamSpec("_P")
_R = TypeVar("_R")


def literal_text(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Every text the figure gets while ``fn`` builds it is drawn as written.

    matplotlib reads text between two "$" as mathtext: a module or mesh dim named "$x$" would draw
    as an italic x, and one holding "$\\frac$" would fail to draw at all (and with it the PNG in a
    widget's notebook output). Text objects keep the setting they were made with, so the figure
    stays literal wherever it is drawn later."""

    @functools.wraps(fn)
    def build(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with matplotlib.rc_context({"text.parse_math": False}):
            return fn(*args, **kwargs)

    return build


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
) -> None:
    """A rank's colour, with its pattern where colours repeat (past nine ranks)."""
    color, text, pattern = g.rank_style(rank)
    lw = 0.6 if edge != "none" else None
    ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor=edge, lw=lw, alpha=alpha, gid=gid))
    hatch = _HATCH[pattern]
    if hatch and alpha == 1.0:
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
    """Tensor (left) coloured by owning rank(s), mesh (right), notes and legend (below).

    A sub-mesh's groups are drawn side by side, each with its own values, up to 16 ranks in all;
    past that one group (``group``, default 0).
    """
    rd, cd = g.view_dims(len(layout.global_shape), dims)
    idx = g.view_index(layout.global_shape, index)
    if heatmap and not values:
        raise ValueError("heatmap=True needs values: this layout was given without any")
    shown = g.shown_groups(layout, group)
    fig = Figure(figsize=FIGSIZE, dpi=100)
    FigureCanvasAgg(fig)
    names = f" {layout.mesh_dim_names}" if layout.mesh_dim_names else ""
    head = title or f"DTensor {describe.extent(layout.global_shape)} {layout.dtype}"
    fig.text(0.01, 0.975, head, fontsize=12, weight="bold", va="top")
    fig.text(
        0.01,
        0.935,
        f"mesh {layout.mesh_shape}{names} · placements [{', '.join(layout.placements)}] · "
        f"{layout.world_size} ranks" + (f" in {len(layout.groups)} groups" if layout.groups else ""),
        fontsize=9,
        va="top",
        color="#444444",
    )
    if not layout.groups:
        tax = fig.add_axes((0.06, 0.30, 0.46, 0.52), gid="tensor")
        max_ = fig.add_axes((0.58, 0.30, 0.40, 0.52), gid="mesh")
        draw_tensor(fig, tax, layout, values, rd, cd, idx, heatmap)
        _draw_mesh(max_, layout)
        _draw_legend(fig, layout)
        return fig
    # A sub-mesh: one tensor and one mesh per group shown, in a grid of cells.
    n = len(shown)
    gcols = min(n, 4)
    grows = math.ceil(n / gcols)
    cw, ch = 0.52 / gcols, 0.58 / grows
    for k, gi in enumerate(shown):
        sub = layout.group_layout(gi)
        x0 = 0.06 + (k % gcols) * cw
        y0 = 0.30 + (grows - 1 - k // gcols) * ch
        tax = fig.add_axes((x0, y0, cw * 0.82, ch * 0.78), gid=f"tensor-g{gi}")
        draw_tensor(fig, tax, sub, values, rd, cd, idx, heatmap, colorbar=k == 0)
        tax.set_title(f"group {gi}: ranks {g.rank_list(sub.mesh_ranks)}", fontsize=8, loc="left")
    mcols = min(n, 2)
    mrows = math.ceil(n / mcols)
    mw, mh = 0.38 / mcols, 0.58 / mrows
    for k, gi in enumerate(shown):
        sub = layout.group_layout(gi)
        x0 = 0.60 + (k % mcols) * mw
        y0 = 0.30 + (mrows - 1 - k // mcols) * mh
        max_ = fig.add_axes((x0, y0, mw * 0.92, mh * 0.8), gid=f"mesh-g{gi}")
        _draw_mesh(max_, sub)
        max_.set_title(f"group {gi} mesh {layout.mesh_shape}", fontsize=8, loc="left")
    if len(shown) < len(layout.groups):
        fig.text(
            0.01,
            0.90,
            f"group {shown[0]} of {len(layout.groups)} shown (plot(..., group=k) draws another)",
            fontsize=8,
            va="top",
            color="#444444",
        )
    _draw_legend(fig, layout)
    return fig


def draw_tensor(
    fig: Figure,
    ax: Any,
    layout: Layout,
    values: Mapping[int, np.ndarray] | None,
    rd: int | None,
    cd: int | None,
    idx: tuple[int, ...],
    heatmap: bool,
    colorbar: bool = True,
) -> None:
    shape = layout.global_shape
    sub = f" · rows dim {rd}, columns dim {cd} at {idx}" if len(shape) >= 3 else ""
    ax.set_title(f"global tensor {describe.extent(shape)}{sub}", fontsize=10, loc="left")
    if 0 in shape:
        ax.set_axis_off()
        ax.text(
            0.5,
            0.5,
            f"empty tensor {describe.extent(shape)}: no elements",
            ha="center",
            va="center",
            fontsize=10,
        )
        return
    nrows = shape[rd] if rd is not None else 1
    ncols = shape[cd] if cd is not None else 1
    ax.set_xlim(0, ncols)
    ax.set_ylim(nrows, 0)
    ratio = max(nrows, ncols) / min(nrows, ncols)
    ax.set_aspect("equal" if ratio <= 6 else "auto", adjustable="box", anchor="NW")
    blocks = g.blocks(layout, (rd, cd), idx)
    partial = g.partial_info(layout) is not None
    alpha = 0.15 if heatmap else 1.0
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
            aspect=ax.get_aspect(),
        )
        if colorbar:
            cax = fig.add_axes((0.06, 0.215, 0.2, 0.018), gid="colorbar")
            fig.colorbar(im, cax=cax, orientation="horizontal")
            cax.tick_params(labelsize=7)
            nan = int(np.isnan(img).sum())
            if nan:
                cax.set_title(f"{nan} NaN (grey)", fontsize=7, loc="left")
    # points per data unit, for deciding which labels fit
    bbox = ax.get_position()
    w_in, h_in = FIGSIZE[0] * bbox.width, FIGSIZE[1] * bbox.height
    if ax.get_aspect() == 1.0:
        scale = min(w_in / ncols, h_in / nrows) * 72
        px, py = scale, scale
    else:
        px, py = w_in * 72 / ncols, h_in * 72 / nrows
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
            _fill(ax, x, y, w, h, b.owners[0], f"shard-r{b.owners[0]}", alpha)
        elif len(b.owners) <= g.MAX_STRIPES:
            # diagonal stripes, one colour per owner in turn: shared, not split into columns
            for i, pts in _stripes(w, h, len(b.owners)):
                r = b.owners[i]
                color, _, _ = g.rank_style(r)
                ax.add_patch(
                    Polygon(
                        [(x + u, y + v) for u, v in pts],
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
        ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="white", lw=1.2, gid="edge"))
        if heatmap or cells is not None or (len(b.owners) == 1 and not label_all):
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
            bbox_ = None if len(b.owners) == 1 else {"facecolor": "white", "alpha": 0.8, "lw": 0, "pad": 1}
            ax.text(
                x + w / 2,
                y + h / 2,
                f"{label}\n{sub}" if two else label,
                ha="center",
                va="center",
                fontsize=size,
                color=ink,
                family="monospace",
                bbox=bbox_,
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
    ax.set_yticks(_thin(rcuts) if rd is not None else [])
    ax.set_xticks(_thin(ccuts) if cd is not None else [])
    ax.tick_params(labelsize=7, length=2, top=True, labeltop=True, bottom=False, labelbottom=False)
    if rd is not None:
        ax.set_ylabel(f"dim {rd} →", fontsize=8)
    if cd is not None:
        ax.set_xlabel(f"dim {cd} →", fontsize=8)
        ax.xaxis.set_label_position("top")
    for side in ax.spines.values():
        side.set_visible(False)


def _thin(cuts: list[int], most: int = 12) -> list[int]:
    if len(cuts) <= most:
        return cuts
    step = math.ceil(len(cuts) / most)
    out = cuts[::step]
    return out if out[-1] == cuts[-1] else [*out, cuts[-1]]


def _draw_mesh(ax: Any, layout: Layout) -> None:
    ms = layout.mesh_shape
    labels = g.dim_labels(layout)
    ax.set_title(f"mesh {ms}", fontsize=10, loc="left")
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
    width = gcols * cols + (gcols - 1) * gap
    height = grows * (rows + 0.8) + (grows - 1) * gap * 0.5
    ax.set_xlim(-0.9, width + 0.1)
    ax.set_ylim(height + 0.1, -0.9)
    ax.set_aspect("equal", adjustable="box", anchor="NW")
    bbox = ax.get_position()
    unit = min(FIGSIZE[0] * bbox.width / (width + 1), FIGSIZE[1] * bbox.height / (height + 1)) * 72
    partial = g.partial_info(layout) is not None
    for gi in range(lead):
        ox = (gi % gcols) * (cols + gap)
        oy = (gi // gcols) * (rows + 0.8 + gap * 0.5)
        if len(ms) >= 3:
            coord = layout.shards[gi * per].coord
            name = ", ".join(f"{labels[m]}={c}" for m, c in enumerate(coord[:-2]))
            ax.text(ox, oy - 0.15, name, fontsize=7, va="bottom")
        if gi == 0:
            if len(ms) >= 2:
                ax.text(ox, oy - 0.55 if len(ms) == 2 else oy - 0.6, f"{labels[-1]} ({cols}) →", fontsize=7)
                ax.text(
                    ox - 0.2,
                    oy + rows / 2,
                    f"{labels[-2]} ({rows})",
                    fontsize=7,
                    rotation=90,
                    va="center",
                    ha="right",
                )
            else:
                ax.text(ox, oy - 0.3, f"{labels[0]} ({ms[0]}) →", fontsize=7)
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
            size = min(9.0, unit * 0.3)
            if size >= 4:
                text = str(s.rank)
                if unit >= 34:
                    text += "\n" + ("empty" if s.empty else describe.extent(s.shape))
                ax.text(
                    x + 0.5,
                    y + 0.5,
                    text,
                    ha="center",
                    va="center",
                    fontsize=size,
                    color=ink,
                    family="monospace",
                )


def _draw_legend(fig: Figure, layout: Layout) -> None:
    lines = g.notes(layout)
    if any(s.empty for s in layout.shards) and 0 not in layout.global_shape:
        lines.append("dashed white cell = empty shard (0 elements)")
    y = 0.155
    for line in lines[:6]:
        fig.text(
            0.01, y, line if len(line) <= 160 else line[:157] + "...", fontsize=8, va="top", color="#333333"
        )
        y -= 0.027
    if layout.world_size <= 16:
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
        fig.legend(
            handles=handles,
            loc="lower right",
            ncol=min(8, len(handles)),
            fontsize=7,
            frameon=False,
            bbox_to_anchor=(0.99, 0.0),
            handlelength=1.2,
            columnspacing=0.8,
        )


def to_png(fig: _MplFigure, dpi: float | None = None) -> bytes:
    """PNG bytes of a figure (the static fallback of a widget in a saved notebook), at the
    figure's own dpi by default: the figures here are laid out for 100 dpi, where their smallest
    text is 9 px or more (at 72 dpi it shrank to about 7 px)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi or fig.dpi, metadata={"Software": None})
    return buf.getvalue()
