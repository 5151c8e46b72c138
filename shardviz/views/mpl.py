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
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

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
        return to_png(self, dpi=int(self.dpi))


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
            k = len(b.owners)
            for i, r in enumerate(b.owners):
                _fill(ax, x + w * i / k, y, w / k, h, r, f"shard-r{r}", alpha)
        else:
            ax.add_patch(
                Rectangle((x, y), w, h, facecolor="#d9d9d9", edgecolor="none", gid=f"shard-r{b.owners[0]}")
            )
        if partial and not heatmap:
            _partial(ax, x, y, w, h)
        ax.add_patch(Rectangle((x, y), w, h, fill=False, edgecolor="white", lw=1.2, gid="edge"))
        if heatmap or (len(b.owners) == 1 and not label_all):
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


def to_png(fig: Figure, dpi: int = 72) -> bytes:
    """PNG bytes of a figure (the static fallback of a widget in a saved notebook)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
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
    return _plot_flow(d, head, sub)


def _buffer_rows(buf: Mapping[str, Any] | None) -> tuple[list[tuple[int, int, int]], int, int]:
    """(y offset, rows, cols) per slot, total rows and the widest cols of a buffer description."""
    if not buf:
        return [], 0, 0
    shapes = buf.get("slots") or [buf["shape"]]
    out, y = [], 0
    for shape in shapes:
        rows = shape[0] if shape else 1
        cols = math.prod(shape[1:]) if len(shape) > 1 else 1
        out.append((y, rows, cols))
        y += rows
    return out, y, max(c for _, _, c in out)


def _plot_flow(d: Mapping[str, Any], head: str, sub: str) -> Figure:
    groups = d["groups"]
    total = sum(len(x) for x in groups)
    shown = list(range(len(groups))) if total <= 16 else list(range(min(PLOT_GROUPS, len(groups))))
    cols: list[tuple[int, float]] = []  # (rank, x) of every drawn column
    x = 0.0
    for gi in shown:
        for r in groups[gi]:
            cols.append((r, x))
            x += 1.0
        x += 0.4
    ncols = max(len(cols), 1)
    fig = Figure(figsize=(max(6.5, min(1.25 * ncols + 1.2, 20.0)), 6.0), dpi=100)
    FigureCanvasAgg(fig)
    fig.text(0.01, 0.985, head, fontsize=11, weight="bold", va="top")
    fig.text(
        0.01, 0.94, sub if len(sub) <= 400 else sub[:397] + "...", fontsize=7.5, va="top", color="#444444"
    )
    ax = fig.add_axes((0.04, 0.08, 0.94, 0.74), gid="flow")
    ax.set_axis_off()
    ranks = d["ranks"]
    rows_in = [_buffer_rows(ranks.get(str(r), {}).get("in")) for r, _ in cols]
    rows_out = [_buffer_rows(ranks.get(str(r), {}).get("out")) for r, _ in cols]
    max_rows = max([1] + [b[1] for b in rows_in + rows_out])
    max_cols = max([1] + [b[2] for b in rows_in + rows_out])
    cell = min(0.62 / max_cols, 2.4 / max_rows)
    gap = 0.04
    h_in = max([0.1] + [b[1] * cell + gap * (len(b[0]) - 1) for b in rows_in])
    y_in, zone = 0.45, 1.3
    y_out = y_in + h_in + zone
    h_out = max([0.1] + [b[1] * cell + gap * (len(b[0]) - 1) for b in rows_out])
    ax.set_xlim(-0.55, x - 0.4 + 0.1)
    ax.set_ylim(y_out + h_out + 0.35, -0.1)
    anchors: dict[tuple[int, str], tuple[float, float, list[tuple[int, int, int]], Mapping[str, Any]]] = {}
    roots = set(d.get("roots") or [])
    for (r, cx), b_in, b_out in zip(cols, rows_in, rows_out, strict=True):
        color, ink, _ = g.rank_style(r)
        ax.add_patch(
            Rectangle((cx - 0.3, 0.0), 0.6, 0.28, facecolor=color, edgecolor="none", gid=f"rank-r{r}")
        )
        ax.text(
            cx, 0.14, f"r{r}{' root' if r in roots else ''}", ha="center", va="center", fontsize=8, color=ink
        )
        for side, y0, (slots, _, width) in (("in", y_in, b_in), ("out", y_out, b_out)):
            buf = ranks.get(str(r), {}).get(side)
            if not buf:
                continue
            x0 = cx - width * cell / 2
            anchors[(r, side)] = (x0, y0, slots, buf)
            _draw_buffer(ax, buf, slots, x0, y0, cell, gap, r if side == "in" else None)
    ax.text(-0.5, y_in - 0.08, "before", fontsize=8, color="#555555", va="bottom")
    ax.text(-0.5, y_out - 0.08, "after", fontsize=8, color="#555555", va="bottom")
    if d.get("op") == "barrier":
        mid = y_in + h_in + zone / 2
        ax.plot([-0.4, x - 0.5], [mid, mid], ls="--", color="#882255", lw=2, gid="barrier")
        ax.text(
            (x - 0.9) / 2,
            mid - 0.08,
            "barrier: every rank waits here",
            ha="center",
            fontsize=8,
            color="#882255",
        )

    def anchor(r: int, side: str, part: int | None) -> tuple[float, float] | None:
        a = anchors.get((r, side))
        if a is None:
            return None
        x0, y0, slots, buf = a
        parts = buf.get("parts") or []
        if part is not None and part < len(parts):
            p = parts[part]
            slot = p.get("slot") or 0
            oy = y0 + slots[slot][0] * cell + slot * gap
            r0, r1, c0, c1 = p["box"]
            px, py0, py1 = x0 + (c0 + c1) / 2 * cell, oy + r0 * cell, oy + r1 * cell
        else:
            total_h = sum(s[1] for s in slots) * cell + gap * (len(slots) - 1)
            px, py0, py1 = x0 + max(s[2] for s in slots) * cell / 2, y0, y0 + total_h
        return (px, py1) if side == "in" else (px, py0)

    drawn = {r for r, _ in cols}
    for key, style in (("stays", "stay"), ("transfers", "transfer")):
        for src, dst, sp, dp, red in d.get(key) or []:
            if src not in drawn or dst not in drawn:
                continue
            a, b = anchor(src, "in", sp), anchor(dst, "out", dp)
            if a is None or b is None:
                continue
            color = g.rank_style(src)[0]
            ax.add_patch(
                FancyArrowPatch(
                    a,
                    b,
                    arrowstyle="-|>",
                    mutation_scale=9,
                    color=color,
                    lw=0.9 if style == "transfer" else 0.8,
                    ls="-" if style == "transfer" else (0, (2, 2)),
                    alpha=0.8,
                    shrinkA=0,
                    shrinkB=1,
                    gid=style if not red else f"{style}-reduce",
                )
            )
    notes = list(d.get("notes") or [])
    if len(shown) < len(groups):
        notes.insert(0, f"{len(groups) - len(shown)} more groups ran the same step (not drawn)")
    check = d.get("check")
    if check and check.get("checked") and not check.get("ok"):
        notes.insert(0, f"WARNING: {check.get('note')}")
    y = 0.065
    for line in notes[:3]:
        fig.text(
            0.01, y, line if len(line) <= 170 else line[:167] + "...", fontsize=7.5, va="top", color="#333333"
        )
        y -= 0.022
    return fig


def _draw_buffer(
    ax: Any,
    buf: Mapping[str, Any],
    slots: list[tuple[int, int, int]],
    x0: float,
    y0: float,
    cell: float,
    gap: float,
    own: int | None,
) -> None:
    parts = buf.get("parts") or []
    faded = 0.3 if buf.get("role") else 1.0

    def tint(origin: int | None, reduced: bool) -> str:
        if reduced:
            return "#d9d9d9"
        return "#eeeeee" if origin is None else g.rank_style(origin)[0]

    for k, (sy, rows, cols) in enumerate(slots):
        oy = y0 + sy * cell + k * gap
        w, h = max(cols * cell, 0.03), max(rows * cell, 0.03)
        mine = [p for p in parts if (p.get("slot") or 0) == k]
        if not mine:
            origin = own if own is not None else buf.get("origin")
            ax.add_patch(
                Rectangle(
                    (x0, oy),
                    w,
                    h,
                    facecolor=tint(origin, bool(buf.get("reduced"))),
                    alpha=0.5 * faded,
                    edgecolor="none",
                    gid="part",
                )
            )
        for p in mine:
            r0, r1, c0, c1 = p["box"]
            origin = p.get("origin", own)
            ax.add_patch(
                Rectangle(
                    (x0 + c0 * cell, oy + r0 * cell),
                    (c1 - c0) * cell,
                    (r1 - r0) * cell,
                    facecolor=tint(origin, bool(p.get("reduced"))),
                    alpha=0.5 * faded,
                    edgecolor="#333333",
                    lw=0.6,
                    gid="part",
                )
            )
        pads = [b for p in mine for b in p.get("pad") or []] + (list(buf.get("pad") or []) if k == 0 else [])
        for a0, a1, b0, b1 in pads:
            ax.add_patch(
                Rectangle(
                    (x0 + b0 * cell, oy + a0 * cell),
                    (b1 - b0) * cell,
                    (a1 - a0) * cell,
                    facecolor="#e6e6e6",
                    hatch="////",
                    edgecolor="#888888",
                    lw=0,
                    gid="pad",
                )
            )
        ax.add_patch(Rectangle((x0, oy), w, h, fill=False, edgecolor="#333333", lw=0.9, gid="buffer"))
    if buf.get("role"):
        ax.text(
            x0,
            y0 - 0.02,
            "not read" if buf["role"] == "ignored" else "not defined",
            fontsize=6,
            color="#666666",
            va="bottom",
        )


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
