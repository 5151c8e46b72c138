"""The placement playground: choose a shape, a mesh and two placements; see the redistribute.

A collective player (views/player.py) with a ``choice`` trait on top: each change of ``choice``
(made by the view's controls, with no cell to re-run) calls ``compute``, which a front end
supplies (shardviz/placement_playground.py runs the simulator there: views never import torch), and sends
the new trace to the player's traits plus a ``result`` with both layouts, the plan, its
collectives' bytes and alpha-beta time, and what is uneven or empty. A choice that cannot be
drawn sets ``result["error"]`` to the reason and keeps the last good picture.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import traitlets

from ..data import cost as _cost
from ..data import describe
from ..data.events import CollectiveEvent, RedistributeEvent
from ..data.trace import Trace
from ..geometry.layout import Layout
from . import geometry as g
from . import html
from .player import PlayerWidget
from .steps import Model
from .widgets import EXPORT_VALUES_BUDGET, STATIC, esm_source

# compute(choice) -> (checked choice, trace of the redistribute, "values" | "geometry", note)
Compute = Callable[[Mapping[str, Any]], tuple[dict[str, Any], Trace, str, str]]

SYNCED = ("step", "link", "filter", "timeline", "info", "choice", "result")


def _layouts(trace: Trace) -> tuple[Layout, Layout, str]:
    red = next(e for e in trace.events if isinstance(e, RedistributeEvent))
    assert red.before is not None and red.after is not None
    return red.before, red.after, red.plan or ""


def _shard_words(which: str, layout: Layout) -> list[str]:
    """Uneven and empty shards of one layout, in words (which ranks, what sizes)."""
    return [f"{which}: {line}" for line in g.notes(layout) if line.startswith(("uneven", "empty"))]


def summarize(choice: Mapping[str, Any], trace: Trace, mode: str, note: str, link: str) -> dict[str, Any]:
    """The ``result`` trait: plain data the view and the text rendering read."""
    before, after, plan = _layouts(trace)
    lk = _cost.link(link)
    model = Model(trace)
    rows = []
    for e in trace.events:
        if not isinstance(e, CollectiveEvent):
            continue
        bus, hops = model.cost(e)
        rows.append(
            {
                "event": e.id,
                "op": e.op,
                "mesh_dim": e.mesh_dim_name or (str(e.mesh_dim) if e.mesh_dim is not None else "?"),
                "groups": [list(grp) for grp in e.groups],
                "bytes": max(e.nbytes.values(), default=0),
                "bus_bytes": bus,
                "hops": hops,
                "seconds": lk.seconds(hops, bus),
            }
        )
    return {
        "ok": True,
        "error": "",
        "choice": dict(choice),
        "mode": mode,
        "mode_note": note,
        "before": g.payload(before),
        "after": g.payload(after),
        "plan": plan,
        "rows": rows,
        "total_seconds": sum(r["seconds"] for r in rows),
        "link": lk.name,
        "shards": _shard_words("source", before) + _shard_words("target", after),
    }


def _title(choice: Mapping[str, Any]) -> str:
    return f"redistribute [{', '.join(choice['src'])}] -> [{', '.join(choice['dst'])}]"


class PlaygroundWidget(PlayerWidget):
    """Controls for a tensor shape, a mesh and source / target placements; both layouts, the
    plan with bytes and time, and the player stepping through its collectives."""

    _esm = esm_source("playground")
    _css = "\n".join(
        (STATIC / f).read_text(encoding="utf-8") for f in ("layout.css", "player.css", "playground.css")
    )

    choice = traitlets.Dict().tag(sync=True)
    result = traitlets.Dict().tag(sync=True)

    def __init__(self, choice: Mapping[str, Any], compute: Compute, *, link: str | None = None) -> None:
        self._compute = compute
        checked, trace, mode, note = compute(choice)
        self._good = (checked, mode, note)  # the last choice drawn, with its mode and note
        self._revision = 0
        super().__init__(trace, link=link, step=0, title=_title(checked))
        self.result = summarize(checked, trace, mode, note, self.link)
        self.choice = checked
        self.observe(self._on_choice, "choice")
        self.observe(self._on_link, "link")

    def _on_link(self, change: Any) -> None:
        checked, mode, note = self._good
        error = {} if self.result.get("ok", True) else {"ok": False, "error": self.result["error"]}
        self.result = {**summarize(checked, self.trace, mode, note, self.link), **error}

    def _on_choice(self, change: Any) -> None:
        self.recompute(change["new"])

    def recompute(self, choice: Mapping[str, Any]) -> None:
        """Redraw for ``choice``; a choice that cannot be drawn leaves the last picture and says why."""
        try:
            checked, trace, mode, note = self._compute(choice)
            result = summarize(checked, trace, mode, note, self.link)
        except Exception as e:  # shown in the view, never only a traceback in the kernel's log
            # A ValueError / TypeError is the choice's fault and says so; anything else names its type.
            text = str(e) if isinstance(e, ValueError | TypeError) and str(e) else f"{type(e).__name__}: {e}"
            self.result = {**self.result, "ok": False, "error": text}
            return
        self._model = Model(trace)
        self._details = {}
        self._good = (checked, mode, note)
        self.step = 0
        self.timeline = self._model.timeline()
        # a new revision even when the timeline reads the same: the view drops its cached steps
        self._revision += 1
        self.info = {**self._model.info(_title(checked)), "revision": self._revision}
        self.result = result

    # ---- static renderings ----

    def __repr__(self) -> str:
        r = self.result
        c = r.get("choice", {})
        return (
            f"PlaygroundWidget(shape={c.get('shape')}, mesh_shape={c.get('mesh_shape')}, "
            f"src={c.get('src')}, dst={c.get('dst')}, mode={r.get('mode')!r})"
        )

    def text(self) -> str:
        """Both layouts, the plan, each collective's bytes and time, uneven / empty shards."""
        r = self.result
        before, after, _ = _layouts(self.trace)
        c = r["choice"]
        out = []
        if not r["ok"]:
            out.append(f"not drawn: {r['error']} (showing the last good choice)")
        out += [
            f"playground: {describe.extent(c['shape'])} on mesh {c['mesh_shape']} {c['mesh_dim_names']}: "
            f"{c['src']} -> {c['dst']}",
            r["mode_note"],
            "source layout:",
            str(before),
            "target layout:",
            str(after),
            f"plan: {r['plan'] or '(nothing to do)'}",
        ]
        if not r["rows"]:
            out.append("no collective: every step is local")
        for k, row in enumerate(r["rows"]):
            out.append(
                f"  {k + 1}. {row['op']} over {row['mesh_dim']} ({len(row['groups'])} group(s)): "
                f"{describe.bytes_text(row['bytes'])} in per rank, {describe.bytes_text(row['bus_bytes'])} "
                f"bus bytes per rank, {_cost.human_seconds(row['seconds'])} on {r['link']}"
            )
        out.append(f"total: {_cost.human_seconds(r['total_seconds'])} on {r['link']}")
        out += r["shards"]
        return "\n".join(out)

    def _repr_markdown_(self) -> str:
        return "```\n" + self.text() + "\n```"

    def figure(self) -> Any:
        """Both layouts side by side (each as ``sv.plot`` draws it), the plan and time below."""
        import matplotlib.image as mpimg
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        from .mpl import plot_layout, to_png

        before, after, _ = _layouts(self.trace)
        r = self.result
        pics = [
            mpimg.imread(
                io.BytesIO(to_png(plot_layout(lay, title=f"{which}: [{', '.join(lay.placements)}]")))
            )
            for which, lay in (("source", before), ("target", after))
        ]
        fig = Figure(figsize=(16, 5.4), dpi=100)
        FigureCanvasAgg(fig)
        for k, pic in enumerate(pics):
            ax = fig.add_axes((0.005 + k * 0.5, 0.12, 0.49, 0.86), gid=("source", "target")[k])
            ax.imshow(pic)
            ax.set_axis_off()
        steps = "; ".join(
            f"{row['op']} over {row['mesh_dim']}: {describe.bytes_text(row['bytes'])}/rank, "
            f"{_cost.human_seconds(row['seconds'])}"
            for row in r["rows"]
        )
        fig.text(0.01, 0.07, f"plan {r['plan']}  ·  {steps or 'no collective'}", fontsize=10, va="top")
        fig.text(0.01, 0.035, r["mode_note"], fontsize=9, va="top", color="#444444")
        return fig

    # ---- offline HTML ----

    def state_for_export(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SYNCED}

    def export_html(self, path: str | Path, *, values_budget: int = EXPORT_VALUES_BUDGET) -> Path:
        """One self-contained HTML file of the current state (controls shown; no kernel to recompute)."""
        responses, _ = self.responses(values_budget)
        state = self.state_for_export()
        state["result"] = {**state["result"], "offline": True}
        return html.export(
            "playground",
            state,
            None,
            esm_source("playground"),
            self._css,
            path,
            responses=responses,
            title="shardviz placement playground",
        )
