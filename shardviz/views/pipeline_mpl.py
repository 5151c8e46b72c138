"""The pipeline timeline as a matplotlib Figure: one lane per rank, a box per forward / backward
of a microbatch (coloured by microbatch, backward hatched), messages as arrows, idle time blank."""

from __future__ import annotations

from typing import Any

from matplotlib.colors import to_rgba
from matplotlib.patches import FancyArrowPatch, Rectangle

from .pipeline_svg import ARROW_COLOURS, ARROW_OTHER, BACKWARD_OPACITY, COLOURS, LEGEND
from .sheet import Figure, Sheet, literal_text


@literal_text
def plot_timeline(tl: Any, *, title: str | None = None) -> Figure:
    """``tl``: a ``shardviz.pipeline.Timeline``."""
    ranks = list(tl.ranks)
    lane = {r: i for i, r in enumerate(ranks)}
    width = max(3.5, min(14.0, 0.5 * float(tl.makespan or 1)))
    sheet = Sheet()
    head = title or "pipeline timeline"
    ax = sheet.axes(0, 0, width, 0.42 * max(len(ranks), 1), gid="lanes")
    ax.set_title(
        f"{head} · {len(ranks)} ranks · {float(tl.makespan):g} steps · bubble {tl.bubble:.1%}",
        fontsize=10,
        loc="left",
    )
    for i in tl.intervals:
        y = lane[i.rank]
        color = COLOURS[(i.microbatch or 0) % len(COLOURS)]
        back = i.name != "forward"
        box = Rectangle(
            (i.start, y - 0.4),
            i.end - i.start,
            0.8,
            facecolor=to_rgba(color, BACKWARD_OPACITY if back else 1.0),
            edgecolor="#333",
            linestyle=(0, (3, 2)) if back else "-",
            linewidth=0.8,
        )
        box.set_gid(f"interval-{i.rank}-{i.event}")
        ax.add_patch(box)
        ax.text((i.start + i.end) / 2, y, i.label, ha="center", va="center", fontsize=8)
    for a in tl.arrows:
        if a.src not in lane or a.dst not in lane:
            continue
        color = ARROW_COLOURS.get(a.phase or "", ARROW_OTHER)
        ax.add_patch(
            FancyArrowPatch(
                (a.start, lane[a.src]),
                (a.end, lane[a.dst]),
                arrowstyle="-|>",
                mutation_scale=8,
                color=color,
                linewidth=0.8,
                alpha=0.8,
                gid=f"arrow-{a.send}-{a.recv}",
            )
        )
    ax.set_xlim(0, max(float(tl.makespan), 1.0))
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.tick_params(labelsize=8)
    ax.set_xlabel("step", fontsize=9)
    ax.spines[["top", "right"]].set_visible(False)
    lanes = sheet.place(ax, 0, 0)
    sheet.text(0, lanes.y1 + 0.08, "\n".join(LEGEND), fontsize=8, color="#555555", gid="legend")
    return sheet.finish()
