"""What is wrong with a static picture, measured on the drawn figure: text that overprints text,
text or a legend outside the canvas, a legend over a drawing, figure text over a drawing.

Every extent is matplotlib's own, in pixels, after a full draw with the Agg renderer (the one
``sv.plot`` and the notebooks' PNGs use). A text with a box (a label boxed over a heat-map) counts
with its box.
"""

from __future__ import annotations

from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.transforms import Bbox

SLACK = 0.75  # pixels two extents may share before they count as overlapping


def _overlap(a: Bbox, b: Bbox, slack: float = SLACK) -> bool:
    return a.x0 < b.x1 - slack and b.x0 < a.x1 - slack and a.y0 < b.y1 - slack and b.y0 < a.y1 - slack


def _inside(a: Bbox, b: Bbox, slack: float = SLACK) -> bool:
    return a.x0 >= b.x0 - slack and a.y0 >= b.y0 - slack and a.x1 <= b.x1 + slack and a.y1 <= b.y1 + slack


def _drawn_tick_labels(ax: Axes) -> set[Text]:
    """Tick labels matplotlib draws: those of ticks inside the view (the others are not drawn)."""
    out: set[Text] = set()
    if not ax.axison:
        return out
    for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
        lo, hi = min(lo, hi), max(lo, hi)
        eps = (hi - lo) * 1e-9
        for tick in axis.get_major_ticks() + axis.get_minor_ticks():
            loc = tick.get_loc()
            if loc is None or not lo - eps <= loc <= hi + eps:
                continue
            for label in (tick.label1, tick.label2):
                if label.get_visible() and label.get_text():
                    out.add(label)
    return out


def texts(fig: Any) -> list[Text]:
    """Every text the figure draws: figure and axes texts, titles, axis labels, the tick labels
    drawn, legend texts."""
    found: list[Text] = []
    ticks: set[Text] = set()
    every_tick: set[Text] = set()
    for ax in fig.axes:
        if ax.get_visible():
            ticks |= _drawn_tick_labels(ax)
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                every_tick |= {tick.label1, tick.label2}
    for t in fig.findobj(Text):
        if not t.get_visible() or not t.get_text().strip():
            continue
        parent_axes = t.axes
        if parent_axes is not None and not parent_axes.get_visible():
            continue
        if (
            parent_axes is not None
            and not parent_axes.axison
            and t in (parent_axes.xaxis.label, parent_axes.yaxis.label)
        ):
            continue
        # a tick label matplotlib does not draw (axes off, tick outside the view) is no text
        if t in ticks or (t not in every_tick and not _is_tick_label(t)):
            found.append(t)
    return found


def _own_text(ax: Axes, t: Text) -> bool:
    titles = (ax.title, ax._left_title, ax._right_title)
    return t in ax.texts or any(t is x for x in titles)


def _is_tick_label(t: Text) -> bool:
    ax = t.axes
    if ax is None:
        return False
    return any(
        t is tick.label1 or t is tick.label2
        for axis in (ax.xaxis, ax.yaxis)
        for tick in axis.get_major_ticks()
    )


def _extent(t: Text, renderer: Any) -> Bbox:
    box = t.get_window_extent(renderer)
    patch = t.get_bbox_patch()
    if patch is not None:
        box = Bbox.union([box, patch.get_window_extent(renderer)])
    return box


def _name(t: Text) -> str:
    text = t.get_text().replace("\n", " / ")
    return repr(text if len(text) <= 40 else text[:37] + "...")


def problems(fig: Any) -> list[str]:
    """Every overprint and overflow of ``fig``, in words (empty when it is clean)."""
    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    page = Bbox.from_bounds(0, 0, *canvas.get_width_height())
    out: list[str] = []
    items = [(t, _extent(t, renderer)) for t in texts(fig)]
    for t, box in items:
        if not _inside(box, page):
            out.append(f"text {_name(t)} runs off the canvas")
    for i, (a, ba) in enumerate(items):
        for b, bb in items[i + 1 :]:
            if _overlap(ba, bb):
                out.append(f"text {_name(a)} overprints {_name(b)}")
    areas = [(ax, ax.patch.get_window_extent(renderer)) for ax in fig.axes if ax.get_visible() and ax.axison]
    legends = [leg for leg in fig.legends] + [
        ax.get_legend() for ax in fig.axes if ax.get_legend() is not None
    ]
    for leg in legends:
        assert isinstance(leg, Legend)
        box = leg.get_window_extent(renderer)
        if not _inside(box, page):
            out.append(f"a legend ({_name(leg.texts[0]) if leg.texts else ''}...) lies outside the canvas")
        for ax, area in areas:
            if _overlap(box, area, slack=2):
                out.append(f"a legend covers the drawing of axes {ax.get_gid() or ax.get_title()!r}")
    for t in fig.texts:
        if not t.get_visible() or not t.get_text().strip():
            continue
        box = _extent(t, renderer)
        for ax, area in areas:
            if _overlap(box, area, slack=2):
                out.append(
                    f"figure text {_name(t)} covers the drawing of axes {ax.get_gid() or ax.get_title()!r}"
                )
    return out


def blank_fraction(fig: Any, grid: int = 120) -> float:
    """The share of the canvas that no part covers (axes with their labels, texts, legends),
    counted on a grid: a picture sized to its content leaves little."""
    import numpy as np

    canvas = fig.canvas if isinstance(fig.canvas, FigureCanvasAgg) else FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    w, h = canvas.get_width_height()
    boxes = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible()]
    boxes += [t.get_window_extent(renderer) for t in fig.texts if t.get_visible() and t.get_text()]
    boxes += [leg.get_window_extent(renderer) for leg in fig.legends]
    covered = np.zeros((grid, grid), dtype=bool)
    for b in boxes:
        if b is None:
            continue
        x0, x1 = (int(np.clip(v / w * grid, 0, grid)) for v in (b.x0, b.x1))
        y0, y1 = (int(np.clip(v / h * grid, 0, grid)) for v in (b.y0, b.y1))
        covered[y0 : max(y1, y0 + 1), x0 : max(x1, x0 + 1)] = True
    return float(1 - covered.mean())
