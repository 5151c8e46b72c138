"""A matplotlib figure laid out from its content: every part placed in inches from the top left,
measured as drawn (titles, tick labels and legends included), and the canvas sized to what the
parts need.

A fixed figure size with fixed axes fractions leaves half the canvas empty for a small tensor and
runs a title into its subtitle for a long one. Here each part is placed where the previous one
ended, by its measured extent; ``finish`` shrinks the figure to the parts plus a margin. Text sizes
are in points and axes sizes in inches, so a part's extent does not change when the figure does.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import matplotlib
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure as _MplFigure
from matplotlib.legend import Legend
from matplotlib.text import Text


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


def to_png(fig: _MplFigure, dpi: float | None = None) -> bytes:
    """PNG bytes of a figure (the static fallback of a widget in a saved notebook), at the
    figure's own dpi by default: the figures here are laid out for 100 dpi, where their smallest
    text is 9 px or more (at 72 dpi it shrank to about 7 px)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi or fig.dpi, metadata={"Software": None})
    return buf.getvalue()


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


# The provisional canvas: big enough for any part; ``finish`` shrinks it.
CANVAS = 60.0
MARGIN = 0.12  # inches around the content
GAP = 0.12  # inches between two parts placed one after another


@dataclass(frozen=True, slots=True)
class Box:
    """An extent in inches from the sheet's top left (y grows down)."""

    x0: float
    y0: float
    x1: float
    y1: float

    @property
    def w(self) -> float:
        return self.x1 - self.x0

    @property
    def h(self) -> float:
        return self.y1 - self.y0


def union(boxes: Sequence[Box]) -> Box:
    return Box(
        min(b.x0 for b in boxes), min(b.y0 for b in boxes), max(b.x1 for b in boxes), max(b.y1 for b in boxes)
    )


class Sheet:
    """Parts placed in inches (x right, y down from the top left); ``finish`` sizes the figure.

    ``axes(x, y, w, h)`` makes an axes whose drawing area is w x h inches at (x, y); ``place``
    moves it so that everything it draws (tick labels, title) starts at a given point. ``text``
    anchors a text at a point; ``legend`` puts a figure legend's top left at a point. ``extent``
    measures any of them as drawn.
    """

    def __init__(self, dpi: float = 100.0) -> None:
        self.fig = Figure(figsize=(CANVAS, CANVAS), dpi=dpi)
        FigureCanvasAgg(self.fig)
        self.renderer = self.fig.canvas.get_renderer()  # type: ignore[attr-defined]
        self._axes: dict[Axes, tuple[float, float, float, float]] = {}
        self._texts: dict[Text, tuple[float, float]] = {}
        self._legends: dict[Legend, tuple[float, float]] = {}

    # ---- placing ----

    def axes(self, x: float, y: float, w: float, h: float, **kw: Any) -> Axes:
        """An axes whose drawing area (not its labels) is ``w`` x ``h`` inches at (x, y)."""
        ax = self.fig.add_axes(self._rect(x, y, w, h), **kw)
        self._axes[ax] = (x, y, w, h)
        return ax

    def move(self, ax: Axes, x: float, y: float) -> None:
        """Move an axes' drawing area to (x, y), keeping its size."""
        _, _, w, h = self._axes[ax]
        self._axes[ax] = (x, y, w, h)
        ax.set_position(self._rect(x, y, w, h))

    def axes_resize(self, ax: Axes, w: float, h: float) -> None:
        """Give an axes' drawing area a new size in inches, keeping its top left."""
        x, y, _, _ = self._axes[ax]
        self._axes[ax] = (x, y, w, h)
        ax.set_position(self._rect(x, y, w, h))

    def place(self, ax: Axes, x: float, y: float) -> Box:
        """Move an axes so that everything it draws starts at (x, y); returns that extent."""
        box = self.extent(ax)
        ox, oy, _, _ = self._axes[ax]
        self.move(ax, ox + x - box.x0, oy + y - box.y0)
        return self.extent(ax)

    def text(self, x: float, y: float, s: str, **kw: Any) -> Text:
        """A text anchored at (x, y) inches (``ha``/``va`` say which point of it; default: its
        top left)."""
        kw.setdefault("va", "top")
        kw.setdefault("ha", "left")
        t = self.fig.text(*self._point(x, y), s, **kw)
        self._texts[t] = (x, y)
        return t

    def legend(self, x: float, y: float, handles: Sequence[Any], **kw: Any) -> Legend:
        """A figure legend whose top left is at (x, y) inches."""
        kw.setdefault("frameon", False)
        leg = self.fig.legend(
            handles=list(handles), loc="upper left", bbox_to_anchor=self._point(x, y), borderaxespad=0, **kw
        )
        self._legends[leg] = (x, y)
        return leg

    def shift(self, artist: Any, dx: float, dy: float) -> None:
        """Move a placed part by (dx, dy) inches."""
        if isinstance(artist, Axes):
            x, y, _, _ = self._axes[artist]
            self.move(artist, x + dx, y + dy)
        elif isinstance(artist, Legend):
            x, y = self._legends[artist]
            self._legends[artist] = (x + dx, y + dy)
            artist.set_bbox_to_anchor(self._point(x + dx, y + dy), transform=self.fig.transFigure)
        else:
            x, y = self._texts[artist]
            self._texts[artist] = (x + dx, y + dy)
            artist.set_position(self._point(x + dx, y + dy))

    # ---- measuring ----

    def extent(self, artist: Any) -> Box:
        """What a part covers as drawn, in inches from the top left (an axes with its labels)."""
        if isinstance(artist, Axes):
            bb = artist.get_tightbbox(self.renderer)
        else:
            bb = artist.get_window_extent(self.renderer)
        assert bb is not None
        dpi = self.fig.dpi
        height = self.fig.get_size_inches()[1]
        return Box(bb.x0 / dpi, height - bb.y1 / dpi, bb.x1 / dpi, height - bb.y0 / dpi)

    def extents(self) -> list[Box]:
        """The extent of every part placed so far."""
        parts: list[Any] = [*self._axes, *self._texts, *self._legends]
        return [self.extent(a) for a in parts if a.get_visible()]

    def bottom(self) -> float:
        """The lowest point reached so far (0 on an empty sheet)."""
        return max((b.y1 for b in self.extents()), default=0.0)

    def right(self) -> float:
        return max((b.x1 for b in self.extents()), default=0.0)

    # ---- finishing ----

    def finish(self, min_width: float = 0.0, margin: float = MARGIN) -> Figure:
        """Shrink the figure to its parts plus ``margin`` (at least ``min_width`` inches wide),
        every part keeping its place relative to the others."""
        boxes = self.extents()
        if not boxes:
            self.fig.set_size_inches(max(min_width, 1.0), 0.5)
            return self.fig
        u = union(boxes)
        dx, dy = margin - u.x0, margin - u.y0
        width = max(u.w + 2 * margin, min_width)
        height = u.h + 2 * margin
        place = [(a, self._axes[a]) for a in self._axes]
        texts = list(self._texts.items())
        legends = list(self._legends.items())
        self.fig.set_size_inches(width, height)
        for ax, (x, y, w, h) in place:
            self._axes[ax] = (x + dx, y + dy, w, h)
            ax.set_position(self._rect(x + dx, y + dy, w, h))
        for t, (x, y) in texts:
            self._texts[t] = (x + dx, y + dy)
            t.set_position(self._point(x + dx, y + dy))
        for leg, (x, y) in legends:
            self._legends[leg] = (x + dx, y + dy)
            leg.set_bbox_to_anchor(self._point(x + dx, y + dy), transform=self.fig.transFigure)
        return self.fig

    # ---- inches -> figure fractions ----

    def _rect(self, x: float, y: float, w: float, h: float) -> tuple[float, float, float, float]:
        W, H = self.fig.get_size_inches()
        return (x / W, 1 - (y + h) / H, w / W, h / H)

    def _point(self, x: float, y: float) -> tuple[float, float]:
        W, H = self.fig.get_size_inches()
        return (x / W, 1 - y / H)
