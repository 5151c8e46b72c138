"""The layout view and the collective player's steps as matplotlib Figures: the same pictures as
the widgets, for papers and saved notebooks.

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

from .. import describe
from ..layout import Layout
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
        _draw_tensor(fig, tax, layout, values, rd, cd, idx, heatmap)
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
        _draw_tensor(fig, tax, sub, values, rd, cd, idx, heatmap, colorbar=k == 0)
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


def _draw_tensor(
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


# ---- events and traces (the collective player's static pictures) -------------------------------

# Groups drawn in one event figure before the rest are only counted.
PLOT_GROUPS = 4
_OP_COLORS = {
    "all_reduce": "#CC6677",
    "all_gather": "#332288",
    "reduce_scatter": "#117733",
    "all_to_all": "#882255",
    "broadcast": "#88CCEE",
    "scatter": "#44AA99",
    "gather": "#DDCC77",
    "reduce": "#AA4499",
    "barrier": "#999999",
    "send": "#999933",
    "recv": "#999933",
}


@literal_text
def plot_message(head: str, body: str = "") -> Figure:
    """A figure that only says something (an empty trace, an event with nothing to draw)."""
    fig = Figure(figsize=(8.0, 2.4), dpi=100)
    FigureCanvasAgg(fig)
    fig.text(0.01, 0.94, head, fontsize=11, weight="bold", va="top")
    lines = body.split("\n")[:10]
    fig.text(
        0.01, 0.78, "\n".join(x if len(x) <= 130 else x[:127] + "..." for x in lines), fontsize=8, va="top"
    )
    return fig


@literal_text
def plot_event(event: Any, trace: Any = None, *, title: str | None = None) -> Figure:
    """One event before → after: each rank's buffers with arrows for what moves (a collective or
    local compute), or the layouts before and after with the plan (a redistribute)."""
    from ..trace import CollectiveEvent, LocalEvent, OpEvent, RedistributeEvent, Trace
    from .steps import Model, event_trace

    if trace is None or all(e is not event for e in trace.events):
        trace = event_trace(event)
    if isinstance(event, OpEvent):
        ins = " ".join("[" + ", ".join(p) + "]" for p in event.input_placements) or "-"
        outs = " ".join("[" + ", ".join(p) + "]" for p in event.output_placements) or "-"
        src = f"\nline {event.source.line}: {event.source.text}" if event.source else ""
        return plot_message(title or f"#{event.id} {event.name}", f"inputs {ins}\noutput {outs}{src}")
    if not isinstance(event, CollectiveEvent | LocalEvent | RedistributeEvent):
        raise TypeError(
            f"sv.plot draws a collective, redistribute, local or op event, not {type(event).__name__}"
        )
    assert isinstance(trace, Trace)
    model = Model(trace, local_steps=isinstance(event, LocalEvent))
    k = next(i for i, e in enumerate(model.steps) if e is event)
    d = model.detail(k)
    head = title or f"#{event.id} {describe.short(event)}"
    sub = describe.line(event)
    if event.source is not None:
        sub += f"\nline {event.source.line}: {event.source.text}"
    if isinstance(event, RedistributeEvent):
        return _plot_redistribute(event, d, head, sub)
    return _plot_flow(d, head, sub, event)


def _plot_flow(d: Mapping[str, Any], head: str, sub: str, event: Any) -> Figure:
    """The player's data flow of one step (views/flow_mpl.py), with its head line, source and notes,
    at 1 px per unit so that text keeps the player's sizes."""
    from .flow_mpl import DPI, PT, plot_flow

    fig = Figure(figsize=(8.0, 6.0), dpi=DPI)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.0, 0.0, 1.0, 1.0), gid="flow")
    ax.set_axis_off()
    sub_lines = [x if len(x) <= 140 else x[:137] + "..." for x in sub.split("\n")][:3]
    top = 26 + 14 * len(sub_lines)
    width, height = plot_flow(fig, ax, d, event, top=top)
    notes = list(d.get("notes") or [])
    groups = d["groups"]
    drawn_groups = len(groups) if sum(len(x) for x in groups) <= 16 else min(PLOT_GROUPS, len(groups))
    if drawn_groups < len(groups):
        notes.insert(0, f"{len(groups) - drawn_groups} more groups ran the same step (not drawn)")
    check = d.get("check")
    if check and check.get("checked") and not check.get("ok"):
        notes.insert(0, f"WARNING: {check.get('note')}")
    notes = [x if len(x) <= 150 else x[:147] + "..." for x in notes[:4]]
    width = max(width, 560.0)
    total = top + height + 6 + 14 * len(notes)

    def say(y: float, text: str, px: float, **kw: Any) -> None:  # figure text at pixel (6, y)
        fig.text(6 / width, 1 - y / total, text, fontsize=px * PT, va="baseline", **kw)

    say(18, head, 13, weight="bold")
    for i, line in enumerate(sub_lines):
        say(36 + 14 * i, line, 10, color="#444444")
    for i, line in enumerate(notes):
        say(top + height + 14 + 14 * i, line, 10, color="#333333")
    ax.set_xlim(0, width)
    ax.set_ylim(total, 0)
    fig.set_size_inches(width / DPI, total / DPI)
    return fig


def _plot_redistribute(event: Any, d: Mapping[str, Any], head: str, sub: str) -> Figure:
    fig = Figure(figsize=(11.0, 5.6), dpi=100)
    FigureCanvasAgg(fig)
    fig.text(0.01, 0.985, head, fontsize=11, weight="bold", va="top")
    fig.text(0.01, 0.94, sub, fontsize=7.5, va="top", color="#444444")
    for layout, box, name in (
        (event.before, (0.05, 0.33, 0.38, 0.45), "before"),
        (event.after, (0.57, 0.33, 0.38, 0.45), "after"),
    ):
        ax = fig.add_axes(box, gid=f"layout-{name}")
        if layout is None:
            ax.set_axis_off()
            ax.text(0.5, 0.5, "layout not recorded", ha="center", va="center")
            continue
        rd, cd = g.view_dims(len(layout.global_shape))
        _draw_tensor(fig, ax, layout, None, rd, cd, g.view_index(layout.global_shape), False)
        ax.set_title(
            f"{name}: [{', '.join(layout.placements)}] on mesh {layout.mesh_shape}", fontsize=9, loc="left"
        )
    fig.text(0.5, 0.56, "→", fontsize=30, ha="center", va="center", color="#555555")
    lines = [f"plan {d.get('plan') or '-'}"]
    for i, p in enumerate(d.get("plan_steps") or []):
        what = p["op"] or "local: no communication"
        ev = f" (event #{p['event']})" if p.get("event") is not None else ""
        lines.append(f"  {i + 1}. mesh {p['dim_label']}: {p['src']} -> {p['dst']}: {what}{ev}")
    lines += list(d.get("notes") or [])
    fig.text(0.01, 0.24, "\n".join(lines[:8]), fontsize=8, va="top", family="monospace", gid="plan")
    return fig


@literal_text
def plot_trace(trace: Any, *, link: Any = None, title: str | None = None) -> Figure:
    """Where the communication time goes: each collective as a bar of its alpha-beta time on
    ``link``, one after another, one lane per mesh dim (cost.py's model)."""
    from .. import cost as _cost
    from ..trace import CollectiveEvent

    lk = _cost.link(link)
    cols = [e for e in trace.events if isinstance(e, CollectiveEvent)]
    if not cols:
        return plot_message(title or "no collectives in this trace", str(trace))
    rows = [_cost.event_cost(e, lk) for e in cols]
    lanes = list(dict.fromkeys(r.mesh_dim for r in rows))
    fig = Figure(figsize=(11.0, 1.6 + 0.45 * len(lanes)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.1, 0.32, 0.86, 0.5), gid="timeline")
    t = 0.0
    for r in rows:
        lane = lanes.index(r.mesh_dim)
        ax.add_patch(
            Rectangle(
                (t * 1e6, lane - 0.35),
                max(r.seconds * 1e6, 1e-9),
                0.7,
                facecolor=_OP_COLORS.get(r.op, "#777777"),
                edgecolor="white",
                lw=0.3,
                gid="collective",
            )
        )
        t += r.seconds
    ax.set_xlim(0, max(t * 1e6, 1e-6))
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    ax.set_yticks(range(len(lanes)), [f"mesh {x}" if x != "-" else "no mesh dim" for x in lanes], fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_xlabel(f"estimated time on {lk.name} (us, collectives one after another)", fontsize=8)
    total = sum(r.bus_bytes_per_rank for r in rows)
    head = title or (
        f"{len(rows)} collectives: {_cost.human_bytes(total)} bus bytes per rank, "
        f"{_cost.human_seconds(t)} on {lk.name}"
    )
    fig.text(0.01, 0.96, head, fontsize=11, weight="bold", va="top")
    used = list(dict.fromkeys(r.op for r in rows))
    fig.legend(
        handles=[Patch(facecolor=_OP_COLORS.get(op, "#777777"), label=op) for op in used],
        loc="lower right",
        ncol=min(6, len(used)),
        fontsize=7,
        frameon=False,
        bbox_to_anchor=(0.99, 0.0),
    )
    return fig


# ---- the model map -----------------------------------------------------------------------------

_KIND_COLORS = {"param": "#4c78a8", "buffer": "#72b7b2", "grad": "#f58518", "optimizer": "#e45756"}
_STACK_COLORS = ["#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB", "#332288"]
MODEL_STACKS = ("kind", "module", "tensor", "mesh_dim")


def _model_stacks(m: Any, stack: str, most: int = 7) -> list[tuple[str, np.ndarray, str]]:
    """(label, bytes per rank, colour) per stacked part, largest first, the rest as "other"."""
    if stack == "kind":
        return [(k, v, _KIND_COLORS[k]) for k, v in m.totals_by_kind().items()]
    if stack == "mesh_dim":
        # A tensor's bytes go to the mesh dims that shard it (all of them: named together), plain
        # and fully replicated tensors to "replicated".
        keys = []
        for r in m.rows:
            lay = m.layouts[r.layout]
            dims = [lay.dim_name(i) for i, p in enumerate(lay.placements) if p.startswith(("S", "_S"))]
            keys.append(("sharded over " + "+".join(dims)) if r.distributed and dims else "not sharded")
    elif stack == "module":
        keys = [r.module.split(".")[0] if r.module else "(root)" for r in m.rows]
    elif stack == "tensor":
        keys = [r.name for r in m.rows]
    else:
        raise ValueError(f"stack={stack!r}: one of {', '.join(MODEL_STACKS)}")
    sums: dict[str, np.ndarray] = {}
    for key, row in zip(keys, m.nbytes, strict=True):
        sums[key] = sums[key] + row if key in sums else row.astype(np.int64)
    order = sorted(sums, key=lambda k: (-int(sums[k].max()) if len(sums[k]) else 0, k))
    out = [(k, sums[k], _STACK_COLORS[i % len(_STACK_COLORS)]) for i, k in enumerate(order[:most])]
    rest = order[most:]
    if rest:
        other = np.asarray(np.sum([sums[k] for k in rest], axis=0, dtype=np.int64))  # one row per rank
        out.append((f"other ({len(rest)})", other, "#dddddd"))
    return out


@literal_text
def plot_model_map(m: Any, *, stack: str = "kind", title: str | None = None) -> Figure:
    """Bytes each rank holds, one bar per rank, stacked by kind (param, buffer, grad, optimizer
    state), by top-level module, by tensor (the largest few) or by the mesh dims that shard them."""
    fig = Figure(figsize=(FIGSIZE[0], 4.2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.08, 0.14, 0.68, 0.72), gid="bytes")
    world = m.world_size
    parts = _model_stacks(m, stack)
    scale, unit = 1.0, "B"
    top = int(m.totals().max()) if world and len(m.rows) else 0
    for s, u in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= s:
            scale, unit = float(s), u
            break
    x = np.arange(world)
    bottom = np.zeros(world)
    width = 0.8 if world <= 64 else 1.0
    for label, vals, color in parts:
        v = vals / scale
        bars = ax.bar(x, v, bottom=bottom, width=width, color=color, label=label, linewidth=0)
        for b in bars.patches:
            b.set_gid(f"stack-{label}")
        bottom = bottom + v
    ax.set_xlim(-0.5, world - 0.5)
    ax.set_xlabel("rank")
    ax.set_ylabel(f"bytes per rank ({unit})")
    if world <= 32:
        ax.set_xticks(x)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False, title=f"by {stack}")
    from ..model import short_bytes

    lo = int(m.totals().min()) if world and len(m.rows) else 0
    fig.text(0.01, 0.97, title or f"model map: {m.name}", fontsize=11, weight="bold", va="top")
    fig.text(
        0.01,
        0.91,
        f"{len(m.rows)} tensors on {world} ranks · per rank {short_bytes(lo)}"
        + (f" – {short_bytes(top)}" if top != lo else "")
        + f" · unsharded {short_bytes(m.global_bytes)}",
        fontsize=9,
        va="top",
        color="#444",
    )
    return fig
