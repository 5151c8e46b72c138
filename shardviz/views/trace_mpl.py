"""The collective player's static pictures as matplotlib Figures: one event before -> after (each
rank's buffers with arrows for what moves, or a redistribute's layouts and plan) and a whole
trace's timeline, read from the same step data as the widget (``steps.Model``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.patches import Patch, Rectangle

from ..data import describe
from . import geometry as g
from .mpl import Figure, draw_tensor, literal_text

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
        draw_tensor(fig, ax, layout, None, rd, cd, g.view_index(layout.global_shape), False)
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
    from ..data import cost as _cost
    from ..data.events import CollectiveEvent

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
        f"{len(rows)} collectives: {describe.bytes_text(total)} bus bytes per rank, "
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
