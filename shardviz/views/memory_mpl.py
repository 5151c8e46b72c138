"""Live bytes per rank over a trace as a matplotlib Figure: one line per group of ranks with the
same curve, each peak marked."""

from __future__ import annotations

from ..data.describe import bytes_text
from ..data.memory import MemoryTimeline
from .geometry import rank_list
from .memory_svg import COLOURS, MAX_LINES, curves
from .sheet import Figure, Sheet, literal_text


@literal_text
def plot_memory(m: MemoryTimeline, *, title: str | None = None) -> Figure:
    sheet = Sheet()
    ax = sheet.axes(0, 0, 6.5, 2.4, gid="memory")
    xs = range(len(m.events))
    shown = curves(m)
    for k, (ranks, values) in enumerate(shown[:MAX_LINES]):
        color = COLOURS[k % len(COLOURS)]
        (line,) = ax.plot(xs, values, color=color, linewidth=1.2, label=f"rank {rank_list(ranks)}")
        line.set_gid(f"memory-{ranks[0]}")
        at = m.peak_event[ranks[0]]
        if at in m.events:
            ax.plot([m.events.index(at)], [int(m.peak[ranks[0]])], "o", color=color, markersize=4)
    top = int(m.peak.max(initial=0))
    ticks = [0, top // 2, top] if top else [0]
    ax.set_yticks(ticks, [bytes_text(t) for t in ticks])
    ax.set_xlabel("event (sampled as each starts)")
    ax.set_ylabel("live bytes")
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=8)
    box = sheet.place(ax, 0, 0.35)
    sheet.text(0, 0, title or f"memory per rank · {m.world_size} ranks · peak {bytes_text(top)}", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    sheet.legend(box.x1 + 0.15, box.y0, handles, labels=labels, fontsize=7)
    return sheet.finish()
