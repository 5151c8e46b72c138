"""The collective player's static pictures as matplotlib Figures: one event before -> after (each
rank's buffers with arrows for what moves, or a redistribute's layouts and plan) and a whole
trace's timeline, read from the same step data as the widget (``steps.Model``)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.patches import Patch, Rectangle

from ..data import describe
from . import geometry as g
from .mpl import draw_tensor
from .sheet import Figure, Sheet, literal_text

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
    sheet = Sheet()
    sheet.text(0, 0, head, fontsize=11, weight="bold")
    lines = body.split("\n")[:10]
    if any(lines):
        text = "\n".join(x if len(x) <= 130 else x[:127] + "..." for x in lines)
        sheet.text(0, sheet.bottom() + 0.08, text, fontsize=8)
    return sheet.finish(min_width=4.0)


@literal_text
def plot_event(event: Any, trace: Any = None, *, title: str | None = None) -> Figure:
    """One event before → after: each rank's buffers with arrows for what moves (a collective or
    local compute), or the layouts before and after with the plan (a redistribute)."""
    from ..data.events import CollectiveEvent, LocalEvent, OpEvent, RedistributeEvent
    from ..data.trace import Trace
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
    width = max(width, 560.0)
    # wrapped at the drawing's width (10 px text, about 6.2 px a character), never cut
    per_line = max(int((width - 12) / 6.2), 40)
    notes = [part for x in notes[:4] for part in textwrap.wrap(x, per_line) or [""]]
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
    """The layouts before and after side by side with an arrow between, and the plan under them."""
    sheet = Sheet()
    sheet.text(0, 0, head, fontsize=11, weight="bold")
    sheet.text(0, sheet.bottom() + 0.05, sub, fontsize=8, color="#444444")
    top = sheet.bottom() + 0.2
    x = 0.0
    boxes = []
    for layout, name in ((event.before, "before"), (event.after, "after")):
        if layout is None:
            t = sheet.text(x, top + 0.3, f"{name}: layout not recorded", fontsize=9)
            boxes.append(sheet.extent(t))
        else:
            rd, cd = g.view_dims(len(layout.global_shape))
            ax, _ = draw_tensor(
                sheet, layout, None, rd, cd, g.view_index(layout.global_shape), False, 4.0, 3.2
            )
            ax.set_gid(f"layout-{name}")
            ax.set_title(
                f"{name}: [{', '.join(layout.placements)}] on mesh {layout.mesh_shape}",
                fontsize=9,
                loc="left",
            )
            boxes.append(sheet.place(ax, x, top))
        if name == "before":
            mid = (boxes[0].y0 + boxes[0].y1) / 2
            arrow = sheet.text(boxes[0].x1 + 0.25, mid, "→", fontsize=26, va="center", color="#555555")
            x = sheet.extent(arrow).x1 + 0.25
    lines = [f"plan {d.get('plan') or '-'}"]
    for i, p in enumerate(d.get("plan_steps") or []):
        what = p["op"] or "local: no communication"
        ev = f" (event #{p['event']})" if p.get("event") is not None else ""
        lines.append(f"  {i + 1}. mesh {p['dim_label']}: {p['src']} -> {p['dst']}: {what}{ev}")
    lines += list(d.get("notes") or [])
    lines = [x if len(x) <= 150 else x[:147] + "..." for x in lines[:8]]
    sheet.text(0, sheet.bottom() + 0.2, "\n".join(lines), fontsize=8, family="monospace", gid="plan")
    return sheet.finish()


@literal_text
def plot_trace(trace: Any, *, link: Any = None, title: str | None = None) -> Figure:
    """Where the communication time goes: each collective as a bar of its alpha-beta time on
    ``link``, one after another, one lane per mesh dim (cost.py's model)."""
    from ..data import cost as _cost
    from ..data.events import CollectiveEvent

    lk = _cost.link(link)
    cols = [e for e in trace.events if isinstance(e, CollectiveEvent)]
    if not cols:
        return plot_message(title or "no collectives in this trace", str(trace))
    rows = [_cost.event_cost(e, lk) for e in cols]
    lanes = list(dict.fromkeys(r.mesh_dim for r in rows))
    total = sum(r.bus_bytes_per_rank for r in rows)
    t = sum(r.seconds for r in rows)
    sheet = Sheet()
    head = title or (
        f"{len(rows)} collectives: {describe.bytes_text(total)} bus bytes per rank, "
        f"{_cost.human_seconds(t)} on {lk.name}"
    )
    sheet.text(0, 0, head, fontsize=11, weight="bold")
    ax = sheet.axes(0, 0, 8.5, 0.32 * len(lanes) + 0.2, gid="timeline")
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
    box = sheet.place(ax, 0, sheet.bottom() + 0.15)
    used = list(dict.fromkeys(r.op for r in rows))
    sheet.legend(
        0,
        box.y1 + 0.08,
        [Patch(facecolor=_OP_COLORS.get(op, "#777777"), label=op) for op in used],
        ncols=min(6, len(used)),
        fontsize=7,
    )
    return sheet.finish()
