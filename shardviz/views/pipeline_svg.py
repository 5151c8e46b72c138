"""The pipeline timeline as SVG: one lane per rank, a box per forward / backward of a microbatch,
an arrow per message, the idle cells left blank (the bubble).

Static by design: a notebook shows it with no kernel and no widget runtime, and the same markup
is the offline HTML export. Boxes and arrows carry their details as SVG ``<title>`` tooltips and
as ``data-*`` attributes, so a test (or a reader's browser) can find them.
"""

from __future__ import annotations

from ..data.pipeline import Timeline
from .markup import Markup, element
from .svg import SvgView

STEP = 44  # pixels per step
LANE = 34  # pixels per lane
LEFT = 64  # room for the rank labels
TOP = 28  # room for the title
# Paul Tol's muted palette, one colour per microbatch (repeating); a backward box is lighter with a
# dashed outline. sv.plot (pipeline_mpl.py) draws with the same colours.
COLOURS = ("#88CCEE", "#44AA99", "#117733", "#999933", "#DDCC77", "#CC6677", "#882255", "#AA4499")
BACKWARD_OPACITY = 0.55
# Message lines by phase: activations, gradients, anything else.
ARROW_COLOURS = {"forward": "#333333", "backward": "#AA3377"}
ARROW_OTHER = "#999999"
LEGEND = (
    "F forward (solid), B backward (lighter, dashed); one colour per microbatch",
    "lines: activations (dark grey) and gradients (magenta); grey lane: idle",
)
CHAR_PX = 6.6  # width of a character of the 11 px legend, generously


def timeline_svg(tl: Timeline, title: str | None = None) -> Markup:
    """The timeline as one ``<svg>`` element."""
    # wide enough for the legend under short timelines too
    width = max(LEFT + max(tl.makespan, 1) * STEP + 16, LEFT + CHAR_PX * max(len(x) for x in LEGEND))
    height = TOP + len(tl.ranks) * LANE + 14 * len(LEGEND) + 12
    lane_of = {r: k for k, r in enumerate(tl.ranks)}
    head = title or (
        f"Pipeline timeline: {len(tl.ranks)} ranks, {_num(tl.makespan)} steps, bubble {tl.bubble:.1%}"
    )
    out = [element("text", {"x": 4, "y": 16, "font-size": 12}, head)]
    for r, k in lane_of.items():
        y = TOP + k * LANE
        lane = [
            element("text", {"x": 4, "y": f"{y + LANE / 2 + 4:.0f}"}, f"rank {r}"),
            element(
                "rect",
                {
                    "x": LEFT,
                    "y": y + 2,
                    "width": f"{tl.makespan * STEP:.0f}",
                    "height": LANE - 4,
                    "fill": "#f2f2f2",
                    "stroke": "#ddd",
                },
            ),
        ]
        for i in tl.lane(r):
            mb = i.microbatch if i.microbatch is not None else 0
            colour = COLOURS[mb % len(COLOURS)]
            backward = i.name != "forward"
            x = LEFT + i.start * STEP
            w = (i.end - i.start) * STEP
            steps = f"{_num(i.start)}-{_num(i.end)}"
            tip = f"rank {r}: {i.name}, stage {i.stage}, microbatch {i.microbatch}, steps {steps}"
            box = {
                "x": f"{x + 1:.0f}",
                "y": y + 4,
                "width": f"{w - 2:.0f}",
                "height": LANE - 8,
                "rx": 3,
                "fill": colour,
                "fill-opacity": BACKWARD_OPACITY if backward else 1,
                "stroke": "#333",
                "stroke-dasharray": "3,2" if backward else None,
            }
            label = {"x": f"{x + w / 2:.0f}", "y": f"{y + LANE / 2 + 4:.0f}", "text-anchor": "middle"}
            lane.append(
                element(
                    "g",
                    {"data-action-label": i.label, "data-microbatch": mb, "data-phase": i.name},
                    element("title", {}, tip),
                    element("rect", box),
                    element("text", label, i.label),
                )
            )
        out.append(element("g", {"data-rank": r}, *lane))
    for a in tl.arrows:
        if a.src not in lane_of or a.dst not in lane_of:
            continue
        y1 = TOP + lane_of[a.src] * LANE + (LANE - 4 if lane_of[a.dst] > lane_of[a.src] else 4)
        y2 = TOP + lane_of[a.dst] * LANE + (4 if lane_of[a.dst] > lane_of[a.src] else LANE - 4)
        x1, x2 = LEFT + a.start * STEP, LEFT + a.end * STEP
        colour = ARROW_COLOURS.get(a.phase or "", ARROW_OTHER)
        tip = f"{a.phase or 'message'} {a.src} -> {a.dst}, microbatch {a.microbatch}, step {_num(a.start)}"
        out.append(
            element(
                "g",
                {"data-src": a.src, "data-dst": a.dst, "data-phase": a.phase or ""},
                element("title", {}, tip),
                element(
                    "line",
                    {
                        "x1": f"{x1:.0f}",
                        "y1": y1,
                        "x2": f"{x2:.0f}",
                        "y2": y2,
                        "stroke": colour,
                        "stroke-width": 1.2,
                    },
                ),
                element("circle", {"cx": f"{x2:.0f}", "cy": y2, "r": 2.5, "fill": colour}),
            )
        )
    for k, line in enumerate(LEGEND):
        y = TOP + len(tl.ranks) * LANE + 16 + 14 * k
        out.append(element("text", {"x": LEFT, "y": y, "fill": "#555", "class": "sv-legend"}, line))
    return element(
        "svg",
        {
            "xmlns": "http://www.w3.org/2000/svg",
            "data-shardviz-view": "pipeline",
            "width": f"{width:.0f}",
            "height": f"{height:.0f}",
            "font-family": "sans-serif",
            "font-size": 11,
            "data-bubble": f"{tl.bubble:.4f}",
            "data-makespan": _num(tl.makespan),
        },
        *out,
    )


class TimelineView(SvgView):
    """What ``sv.show(timeline)`` returns: the SVG in a notebook, the text table elsewhere."""

    page_title = "shardviz pipeline timeline"

    def __init__(self, timeline: Timeline, title: str | None = None) -> None:
        if not isinstance(timeline, Timeline):
            raise TypeError(
                f"TimelineView needs a Timeline (sv.pipeline_timeline(trace)), got {type(timeline).__name__}"
            )
        super().__init__(timeline, title)
        self.timeline = timeline

    def svg(self) -> Markup:
        return timeline_svg(self.timeline, self.title)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"
