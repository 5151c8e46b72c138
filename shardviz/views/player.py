"""The collective player widget: a trace's collectives and redistributes, one step at a time.

The trace reaches the browser as a compact timeline synced once (traits ``timeline`` and
``info``); everything per step comes on demand through anywidget commands: ``fetch_step``,
``fetch_values`` and ``fetch_ring``. Their replies are plain data computed by ``steps.Model``
(views/steps.py), which the matplotlib picture reads too, without importing anywidget.
The offline HTML export answers the same commands from replies computed at export time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anywidget
import traitlets
from anywidget.experimental import command

from ..data import cost as _cost
from ..data import describe
from ..data.events import Event
from ..data.trace import Trace
from . import html
from .steps import FILTER_KEYS, PHASES, Model, event_trace
from .widgets import EXPORT_VALUES_BUDGET, STATIC, StaticFallback, esm_source

# event_trace is re-exported: show.py makes a one-event trace for the player from here.
__all__ = ["PlayerWidget", "event_trace"]

# The traits the ESM reads; an HTML export embeds exactly these.
SYNCED = ("step", "link", "filter", "timeline", "info")


def _check_request(msg: Any, keys: Sequence[str]) -> str | None:
    if not isinstance(msg, Mapping):
        return f"bad request {msg!r}: expected a dict with {list(keys)}"
    for key in keys:
        v = msg.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            return f"bad request {msg!r}: {key!r} must be an int"
    return None


class PlayerWidget(StaticFallback, anywidget.AnyWidget):
    """Steps through a trace's collectives and redistributes: timeline, each rank's buffers before
    and after, the data flow, the ring algorithm, and the communication cost."""

    _esm = esm_source("player")
    # layout.css styles the redistribute's before / after layouts (drawn by the layout view's code)
    _css = "\n".join((STATIC / f).read_text(encoding="utf-8") for f in ("layout.css", "player.css"))

    step = traitlets.Int(0).tag(sync=True)
    link = traitlets.Unicode(_cost.DEFAULT_LINK).tag(sync=True)
    timeline = traitlets.Dict().tag(sync=True)
    info = traitlets.Dict().tag(sync=True)
    # Which steps and timeline rows show (steps.FILTER_KEYS): {"phase": "backward",
    # "module": "layers.0", "mesh_dim": "tp", "all_ops": True}; prev / next move between the
    # steps it keeps. Operators that move no data (views, detach) are folded unless all_ops.
    filter = traitlets.Dict().tag(sync=True)

    def __init__(
        self,
        trace: Trace,
        *,
        step: int | None = None,
        link: str | None = None,
        local_steps: bool = False,
        title: str | None = None,
        filter: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(trace, Trace):
            raise TypeError(
                f"the collective player needs a shardviz Trace (from sv.record, sv.run or sv.load), "
                f"not {type(trace).__name__}"
            )
        self._model = Model(trace, local_steps=local_steps)
        self._details: dict[int, dict[str, Any]] = {}
        link = link or _cost.DEFAULT_LINK
        _cost.link(link)  # a clear error for an unknown preset
        super().__init__(
            timeline=self._model.timeline(),
            info=self._model.info(title),
            link=link,
            filter=dict(filter or {}),
        )
        if step is None:
            step = self._first_step()
        self.step = step

    def _first_step(self) -> int:
        """Where the trace says to look first (a desync, where a rank stopped), else the first
        collective of the training step (``steps.Model.step_start``: past the setup's scatters),
        else the first step."""
        trace = self._model.trace
        start = trace.meta.get("start_event") if isinstance(getattr(trace, "meta", None), dict) else None
        at = [k for k, e in enumerate(self._model.steps) if isinstance(start, int) and e.id <= start]
        if at:
            return at[-1]
        begin = self._model.step_start()
        return begin if begin is not None else 0

    @property
    def step_start(self) -> int | None:
        """The step of the training step's first collective (``steps.Model.step_start``)."""
        return self._model.step_start()

    @traitlets.validate("filter")
    def _valid_filter(self, proposal: Any) -> dict[str, Any]:
        flt = dict(proposal["value"])
        for key, value in flt.items():
            if key not in FILTER_KEYS:
                raise traitlets.TraitError(f"unknown filter key {key!r}: use {list(FILTER_KEYS)}")
            if key == "all_ops":
                if not isinstance(value, bool):
                    raise traitlets.TraitError(f"filter all_ops must be True or False, not {value!r}")
            elif value is not None and not isinstance(value, str):
                raise traitlets.TraitError(f"filter {key} must be a string, not {value!r}")
        if flt.get("phase") not in (None, "", *PHASES):
            raise traitlets.TraitError(f"filter phase {flt['phase']!r}: use one of {list(PHASES)}")
        return flt

    @property
    def steps_shown(self) -> list[int]:
        """The steps the current filter keeps (all of them with no filter)."""
        return self._model.steps_matching(self.filter)

    @traitlets.validate("step")
    def _valid_step(self, proposal: Any) -> int:
        k = proposal["value"]
        n = len(self._model.steps)
        if not (0 <= k < max(n, 1)):
            raise traitlets.TraitError(
                f"step {k} is out of range: this trace has {n} step(s) (0..{max(n - 1, 0)})"
            )
        return k

    @traitlets.validate("link")
    def _valid_link(self, proposal: Any) -> str:
        name = proposal["value"]
        if name not in _cost.PRESETS:
            raise traitlets.TraitError(f"unknown link {name!r}: use one of {sorted(_cost.PRESETS)}")
        return name

    # ---- plain data out, for other code ----

    @property
    def trace(self) -> Trace:
        return self._model.trace

    @property
    def steps(self) -> list[Event]:
        """The events the player steps through, in order."""
        return list(self._model.steps)

    @property
    def event(self) -> Event | None:
        """The event of the current step (None for a trace with nothing to step through)."""
        return self._model.steps[self.step] if self._model.steps else None

    def detail(self, step: int | None = None) -> dict[str, Any]:
        """What the view draws for a step (the current one by default): ``fetch_step``'s reply."""
        k = self.step if step is None else step
        if not 0 <= k < len(self._model.steps):
            return {"error": f"no step {k}: this trace has {len(self._model.steps)} step(s)"}
        if k not in self._details:
            self._details[k] = self._model.detail(k)
        return self._details[k]

    def cost(self, step: int | None = None) -> dict[str, Any]:
        """Bus bytes per rank and the alpha-beta time of a step on the selected link."""
        k = self.step if step is None else step
        e = self._model.steps[k]
        bus, hops = self._model.cost(e)
        lk = _cost.link(self.link)
        return {"bus_bytes": bus, "steps": hops, "seconds": lk.seconds(hops, bus), "link": lk.name}

    # ---- commands ----

    @command
    def fetch_step(self, msg: Any, buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """``{"step": k}`` → the step's detail (JSON, no buffers)."""
        err = _check_request(msg, ("step",))
        if err:
            return {"error": err}, []
        return self.detail(msg["step"]), []

    def values_reply(self, step: int, group: int = 0) -> tuple[dict[str, Any], list[bytes]]:
        if not 0 <= step < len(self._model.steps):
            return {"error": f"no step {step}: this trace has {len(self._model.steps)} step(s)"}, []
        return self._model.values(step, group)

    @command
    def fetch_values(self, msg: Any, buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """``{"step": k, "group": i}`` → metadata and one buffer per tensor of that group."""
        err = _check_request(msg, ("step", "group"))
        if err:
            return {"error": err}, []
        return self.values_reply(msg["step"], msg["group"])

    def ring_reply(self, step: int, group: int = 0) -> tuple[dict[str, Any], list[bytes]]:
        if not 0 <= step < len(self._model.steps):
            return {"error": f"no step {step}: this trace has {len(self._model.steps)} step(s)"}, []
        return self._model.ring(step, group)

    @command
    def fetch_ring(self, msg: Any, buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """``{"step": k, "group": i}`` → the ring's states and one float64 buffer of values."""
        err = _check_request(msg, ("step", "group"))
        if err:
            return {"error": err}, []
        return self.ring_reply(msg["step"], msg["group"])

    # ---- static renderings ----

    def __repr__(self) -> str:
        e = self.event
        cur = f"#{e.id} {describe.short(e)}" if e is not None else "none"
        return f"PlayerWidget({self.trace!r}, steps={len(self._model.steps)}, step={self.step}, event={cur})"

    def text(self) -> str:
        """The trace as text with the current step marked, then the step's cost on the link."""
        lines = str(self.trace).split("\n")
        e = self.event
        n = len(self._model.steps)
        if e is None:
            return "\n".join([*lines, "player: no collectives or redistributes to step through"])
        out = []
        for line in lines:
            if line.lstrip().startswith(f"#{e.id} "):
                out.append("> " + line)
            else:
                out.append("  " + line if line.startswith(("#", " ")) else line)
        c = self.cost()
        out.append(
            f"player: step {self.step + 1} of {n}, event #{e.id}; "
            f"{describe.bytes_text(c['bus_bytes'])} bus bytes per rank, "
            f"{_cost.human_seconds(c['seconds'])} on {c['link']}"
        )
        return "\n".join(out)

    def figure(self) -> Any:
        """The current step as a matplotlib Figure (before → after with arrows)."""
        from .trace_mpl import plot_event, plot_message

        e = self.event
        if e is None:
            return plot_message("no collectives or redistributes to step through", str(self.trace))
        return plot_event(e, self.trace)

    # ---- offline HTML ----

    def responses(self, budget: int = EXPORT_VALUES_BUDGET) -> tuple[list[html.Response], int]:
        """Every step's detail, then values and rings while they fit in ``budget`` bytes."""
        out: list[html.Response] = []
        for k in range(len(self._model.steps)):
            out.append(("fetch_step", {"step": k}, self.detail(k), []))
        used = 0
        for k in range(len(self._model.steps)):
            d = self.detail(k)
            for gi in range(len(d.get("groups") or [])):
                for name, fn in (("fetch_values", self.values_reply), ("fetch_ring", self.ring_reply)):
                    if name == "fetch_ring" and not (d.get("ring") or {}).get("available"):
                        continue
                    meta, bufs = fn(k, gi)
                    if "error" in meta:
                        continue
                    size = sum(len(b) for b in bufs)
                    if used + size > budget:
                        return out, used
                    used += size
                    out.append((name, {"step": k, "group": gi}, meta, bufs))
        return out, used

    def state_for_export(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in SYNCED}

    def export_html(self, path: str | Path, *, values_budget: int = EXPORT_VALUES_BUDGET) -> Path:
        """One self-contained HTML file of the player (values embedded up to ``values_budget``)."""
        responses, _ = self.responses(values_budget)
        state = self.state_for_export()
        t = self.trace
        return html.export(
            "player",
            state,
            None,
            esm_source("player"),
            self._css,
            path,
            responses=responses,
            title=f"shardviz player: {t.backend}, {t.world_size} ranks, {len(t.events)} events",
        )
