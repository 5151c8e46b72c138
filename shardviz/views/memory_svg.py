"""Live bytes per rank over a trace as SVG: one line per group of ranks with the same curve, the
peak marked, event ids along the bottom.

Static, like the pipeline timeline: it shows in a notebook with no kernel or widget runtime and
is the offline HTML export as it is. Lines carry ``data-ranks`` and ``<title>`` tooltips.
"""

from __future__ import annotations

import numpy as np

from ..data.describe import bytes_text
from ..data.memory import MemoryTimeline, event_label
from .geometry import rank_list
from .markup import Markup, element
from .svg import SvgView

WIDTH, HEIGHT = 640, 232
LEFT, RIGHT, TOP, BOTTOM = 72, 16, 40, 36
MAX_LINES = 16
# Paul Tol's muted palette, as the layout view uses.
COLOURS = ("#332288", "#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499")


def curves(m: MemoryTimeline) -> list[tuple[list[int], np.ndarray]]:
    """Ranks with the very same curve together, the highest peak first."""
    groups: dict[bytes, list[int]] = {}
    for r in range(m.world_size):
        groups.setdefault(m.bytes[:, r].tobytes(), []).append(r)
    out = [(ranks, m.bytes[:, ranks[0]]) for ranks in groups.values()]
    out.sort(key=lambda rc: (-int(m.peak[rc[0][0]]), rc[0][0]))
    return out


def memory_svg(m: MemoryTimeline, title: str | None = None) -> Markup:
    n = len(m.events)
    top = max(int(m.peak.max(initial=0)), 1)
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(i: float) -> float:
        return LEFT + (i / max(n - 1, 1)) * plot_w

    def y(b: float) -> float:
        return TOP + plot_h - (b / top) * plot_h

    head = title or f"Memory per rank: {m.world_size} ranks, peak {bytes_text(top)}"
    out = [
        element("text", {"x": 4, "y": 16, "font-size": 12}, head),
        element(
            "rect",
            {"x": LEFT, "y": TOP, "width": plot_w, "height": plot_h, "fill": "#fafafa", "stroke": "#ddd"},
        ),
    ]
    for frac in (0, 0.5, 1):
        yy = y(top * frac)
        out.append(
            element(
                "text",
                {"x": LEFT - 4, "y": f"{yy + 4:.0f}", "text-anchor": "end"},
                bytes_text(int(top * frac)),
            )
        )
        out.append(
            element(
                "line",
                {"x1": LEFT, "x2": LEFT + plot_w, "y1": f"{yy:.1f}", "y2": f"{yy:.1f}", "stroke": "#eee"},
            )
        )
    ticks = sorted({0, n // 2, n - 1}) if n else []
    for i in ticks:
        e = m.events[i]
        out.append(
            element(
                "text",
                {"x": f"{x(i):.0f}", "y": HEIGHT - BOTTOM + 14, "text-anchor": "middle"},
                "end" if e is None else f"#{e}",
            )
        )
    out.append(
        element(
            "text",
            {"x": f"{LEFT + plot_w / 2:.0f}", "y": HEIGHT - 6, "text-anchor": "middle", "fill": "#555"},
            "event (sampled as each starts)",
        )
    )
    shown = curves(m)
    for k, (ranks, values) in enumerate(shown[:MAX_LINES]):
        colour = COLOURS[k % len(COLOURS)]
        pts = " ".join(f"{x(i):.1f},{y(float(v)):.1f}" for i, v in enumerate(values))
        peak = int(m.peak[ranks[0]])
        tip = (
            f"rank{'s' if len(ranks) > 1 else ''} {rank_list(ranks)}: peak {bytes_text(peak)} during "
            f"{event_label(m, m.peak_event[ranks[0]])}; start {bytes_text(int(values[0]))}, "
            f"end {bytes_text(int(values[-1]))}"
        )
        at = m.peak_event[ranks[0]]
        px = x(m.events.index(at)) if at in m.events else LEFT
        out.append(
            element(
                "g",
                {"data-ranks": rank_list(ranks), "data-peak": peak},
                element("title", {}, tip),
                element("polyline", {"points": pts, "fill": "none", "stroke": colour, "stroke-width": 1.5}),
                element("circle", {"cx": f"{px:.1f}", "cy": f"{y(peak):.1f}", "r": 3, "fill": colour}),
            )
        )
    legend = [f"{rank_list(r)}" for r, _ in shown[:MAX_LINES]]
    more = f" (+{len(shown) - MAX_LINES} more curves)" if len(shown) > MAX_LINES else ""
    out.append(
        element(
            "text", {"x": LEFT, "y": TOP - 6, "fill": "#555"}, f"ranks: {' | '.join(legend)}{more}; dot: peak"
        )
    )
    return element(
        "svg",
        {
            "xmlns": "http://www.w3.org/2000/svg",
            "data-shardviz-view": "memory",
            "width": WIDTH,
            "height": HEIGHT,
            "font-family": "sans-serif",
            "font-size": 11,
            "data-peak": top,
            "data-samples": n,
        },
        *out,
    )


class MemoryView(SvgView):
    """What ``sv.show(trace.memory)`` returns: the SVG in a notebook, the text table elsewhere."""

    page_title = "shardviz memory per rank"

    def __init__(self, timeline: MemoryTimeline, title: str | None = None) -> None:
        if not isinstance(timeline, MemoryTimeline):
            raise TypeError(
                "MemoryView needs a MemoryTimeline (trace.memory of sv.record(memory=True)), "
                f"got {type(timeline).__name__}"
            )
        super().__init__(timeline, title)
        self.timeline = timeline

    def svg(self) -> Markup:
        return memory_svg(self.timeline, self.title)
