"""``sv.show`` / ``sv.play`` / ``sv.plot`` / ``sv.export_html``: objects become plain data, then a view.

Views never touch torch. Torch objects are made plain data first (``capture.layouts``: a DTensor
becomes its ``Layout`` plus each rank's values, a LocalTensor a side-by-side layout; a module
becomes its model map); then one table, ``_views()``, says how each kind of plain data is drawn:
its widget (``sv.show``, ``sv.export_html``), its matplotlib picture (``sv.plot``) and the
options each takes. A backend hands what it wants drawn to ``session.draw``, which is ``show``.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .backends import session
from .capture import adapters, layouts
from .capture import torch as _torch
from .data.events import Event
from .data.memory import MemoryTimeline
from .data.model import ModelMap
from .data.numerics import NumericsReport
from .data.pipeline import Timeline
from .data.trace import Trace
from .geometry.layout import Layout

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .views.memory_svg import MemoryView
    from .views.model_view import ModelWidget
    from .views.numerics_view import NumericsWidget
    from .views.pipeline_svg import TimelineView
    from .views.player import PlayerWidget
    from .views.widgets import LayoutWidget

_ACCEPTS = "a DTensor, a LocalTensor, or a Layout (from sv.layout)"
_VIEW_OPTIONS = ("dims", "index", "heatmap", "title", "group")
_WIDGET_OPTIONS = (*_VIEW_OPTIONS, "selected")
_PLAYER_OPTIONS = ("step", "link", "local_steps", "title", "filter")
_MAP_OPTIONS = ("optimizer", "world_size", "grads", "buffers")
_MODEL_OPTIONS = (*_MAP_OPTIONS, "rank", "selected", "title")


@dataclass(frozen=True)
class _Views:
    """How one kind of plain data is drawn, and the options each view takes."""

    widget: Callable[..., Any]  # sv.show; sv.export_html writes its page
    widget_options: tuple[str, ...]
    figure: Callable[..., Figure]  # sv.plot
    figure_options: tuple[str, ...]
    values: bool = True  # the page embeds values, up to sv.export_html's values_budget


def _view(module: str, name: str) -> Callable[..., Any]:
    """``shardviz.views.<module>.<name>``, imported when first called: a picture loads matplotlib
    and its own module, not every widget's (anywidget, ipywidgets) with them."""

    def draw(*args: Any, **options: Any) -> Any:
        view: Callable[..., Any] = getattr(importlib.import_module(f".views.{module}", __package__), name)
        return view(*args, **options)

    return draw


@functools.cache
def _views() -> dict[type, _Views]:
    """The one table from a kind of plain data to its views (each imported when first drawn)."""

    def play_event(e: Event, **options: Any) -> PlayerWidget:
        from .views.player import PlayerWidget, event_trace

        return PlayerWidget(event_trace(e), **options)

    def layout_widget(layout: Layout, values: Any = None, **options: Any) -> LayoutWidget:
        return show_layout(layout, values, **options)  # looked up when called: tests stand in for it

    return {
        Layout: _Views(
            layout_widget, (*_WIDGET_OPTIONS, "values_note"), _view("mpl", "plot_layout"), _VIEW_OPTIONS
        ),
        Trace: _Views(
            _view("player", "PlayerWidget"),
            _PLAYER_OPTIONS,
            _view("trace_mpl", "plot_trace"),
            ("link", "title"),
        ),
        Event: _Views(play_event, _PLAYER_OPTIONS, _view("trace_mpl", "plot_event"), ("title", "trace")),
        ModelMap: _Views(
            _view("model_view", "ModelWidget"),
            _MODEL_OPTIONS,
            _view("model_mpl", "plot_model_map"),
            (*_MAP_OPTIONS, "stack", "title"),
        ),
        NumericsReport: _Views(
            _view("numerics_view", "NumericsWidget"),
            ("selected", "title"),
            _view("numerics_mpl", "plot_numerics"),
            ("title",),
        ),
        Timeline: _Views(
            _view("pipeline_svg", "TimelineView"),
            ("title",),
            _view("pipeline_mpl", "plot_timeline"),
            ("title",),
            values=False,
        ),
        MemoryTimeline: _Views(
            _view("memory_svg", "MemoryView"),
            ("title",),
            _view("memory_mpl", "plot_memory"),
            ("title",),
            values=False,
        ),
    }


def show(
    obj: Any, **options: Any
) -> LayoutWidget | PlayerWidget | ModelWidget | NumericsWidget | TimelineView | MemoryView:
    """The layout view of a DTensor, a LocalTensor or a Layout, or the collective player of a
    Trace (or of one event), as a notebook widget.

    Layout options: ``dims=(rows, cols)`` (tensors of 3+ dims), ``index`` (slider positions),
    ``heatmap``, ``title``, ``selected`` (a rank), ``group`` (which group of a sub-mesh is drawn
    when they are too many to draw side by side), and for a Layout ``values={rank: array}``.
    Player options: see :func:`play`. An ``nn.Module`` (or a ModelMap from ``sv.model_map``) is
    drawn as its model map: options ``optimizer``, ``world_size``, ``rank``, ``selected`` (a
    tensor's name: its layout opens), ``title``. A pipeline Timeline (``sv.pipeline_timeline``)
    is drawn as its lanes, and a MemoryTimeline (``trace.memory``) as live bytes per rank (SVG;
    option ``title``). A NumericsReport (``sv.diff``) is its module tree coloured by error, a
    row's layout with its per-element error (options ``selected``, a row index, and ``title``).
    """
    playground = _playground(obj, "sv.show", options)
    if playground is not None:  # already a widget: itself
        return playground
    plain, views, options = _plain(obj, "sv.show", options, figure=False)
    return views.widget(plain, **options)


def play(trace: Any, **options: Any) -> PlayerWidget:
    """The collective player: steps through a trace's collectives and redistributes.

    Options: ``step`` (start position, from 0; the widget's ``step`` trait follows the view; by
    default the training step's first collective), ``link`` (cost preset: "nvlink4", "pcie5",
    "ib-ndr", ...), ``local_steps=True`` (local compute on to_local() shards becomes a step too),
    ``title``, ``filter`` (``{"phase", "module", "mesh_dim", "all_ops"}``: the steps and timeline
    rows shown). An event alone plays as a one-step trace.
    """
    if not isinstance(trace, Trace | Event):
        hint = " (sv.record() returns one: `with sv.record() as trace: ...`)" if callable(trace) else ""
        raise TypeError(
            "sv.play plays a shardviz Trace (from sv.record, sv.run, sv.last_trace or sv.load) or one of "
            f"its events; got {type(trace).__name__}{hint}"
        )
    plain, views, options = _plain(trace, "sv.play", options, figure=False)
    widget: PlayerWidget = views.widget(plain, **options)
    return widget


def show_layout(
    layout: Layout, values: Mapping[int, np.ndarray] | None = None, **options: Any
) -> LayoutWidget:
    """The layout widget from plain data: a Layout and, optionally, each rank's local values.

    ``values[rank]`` must have that rank's local shape (``layout.shard(rank).shape``).
    """
    from .views.widgets import LayoutWidget  # ipywidgets only when a view is asked for

    _check_options("sv.show_layout", options, (*_WIDGET_OPTIONS, "values_note"))
    return LayoutWidget(layout, values, **options)


def plot(obj: Any, **options: Any) -> Figure:
    """The same picture as a matplotlib Figure: deterministic, for papers and saved notebooks.

    Options: ``dims``, ``index``, ``heatmap``, ``title``; for a Layout also ``values``. An event
    is drawn before → after with an arrow per transfer (``title``, and ``trace=`` the trace it
    came from, whose redistribute gives the padding of uneven shards); a trace as the estimated
    time of its collectives, one lane per mesh dim (``link``, ``title``).
    """
    playground = _playground(obj, "sv.plot", options)
    if playground is not None:
        fig: Figure = playground.figure()  # both layouts, the plan and its time
        return fig
    plain, views, options = _plain(obj, "sv.plot", options, figure=True)
    return views.figure(plain, **options)


def _playground(obj: Any, who: str, options: Mapping[str, Any]) -> Any:
    """``obj`` when it is the placement playground (``sv.playground()``), which takes no options."""
    playground = sys.modules.get(f"{__package__}.views.playground")  # a playground loaded it
    if playground is None or not isinstance(obj, playground.PlaygroundWidget):
        return None
    _check_options(who, options, ("values_budget",) if who == "sv.export_html" else ())
    return obj


def export_html(obj: Any, path: str | Path, **options: Any) -> Path:
    """One self-contained HTML file of the view ``sv.show`` draws (a layout, the player, a model
    map, a pipeline or memory timeline) that renders with no kernel and no network.

    Values are embedded up to ``values_budget`` bytes (default 16 MiB); past it the page keeps
    the geometry (the player: every step's shapes and flow) and says why values are missing.
    Every name in the data shows as text, and the page's Content-Security-Policy runs only its
    own script and loads nothing (views/markup.py), so a trace from a stranger is safe to open.
    """
    from .views.widgets import EXPORT_VALUES_BUDGET

    playground = _playground(obj, "sv.export_html", options)
    if playground is not None:  # the page shows the state drawn last
        out: Path = playground.export_html(
            path, values_budget=options.get("values_budget", EXPORT_VALUES_BUDGET)
        )
        return out
    kind = _kind(obj)
    budget = options.pop("values_budget", EXPORT_VALUES_BUDGET) if _views()[kind].values else None
    plain, views, options = _plain(obj, "sv.export_html", options, figure=False)
    view = views.widget(plain, **options)
    if budget is None:
        return view.export_html(path)
    try:
        return view.export_html(path, values_budget=budget)
    finally:
        view.close()


# ---- any object -> plain data and its views -------------------------------------------------------


def _kind(obj: Any) -> type:
    """The kind of plain data ``obj`` is drawn as (a key of the views table)."""
    for kind in type(obj).__mro__:
        if kind in _views():
            return kind
    if isinstance(obj, torch.nn.Module):
        return ModelMap
    return Layout  # tensors, or anything else: ``_layout_of`` says what it accepts


def _plain(
    obj: Any, who: str, options: dict[str, Any], *, figure: bool
) -> tuple[Any, _Views, dict[str, Any]]:
    """``obj`` as plain data, its views, and the options for its widget (or its ``figure``),
    checked against what that view takes."""
    kind = _kind(obj)
    views = _views()[kind]
    allowed = views.figure_options if figure else views.widget_options
    if kind is ModelMap:
        _check_options(who, options, allowed)
        return _model_map(obj, options), views, options
    if kind is Layout:
        layout, values, defaults = _layout_of(obj, who, options)
        if figure:
            defaults.pop("values_note", None)  # a picture says nothing of missing values
        options = {**defaults, **options}
        _check_options(who, options, allowed)
        return layout, views, {**options, "values": values}
    _check_options(who, options, allowed)
    return obj, views, options


def _model_map(obj: Any, options: dict[str, Any]) -> ModelMap:
    """A ModelMap as given, or built from a module with the map options (popped)."""
    from .capture.model_map import model_map

    opts = {k: options.pop(k) for k in _MAP_OPTIONS if k in options}
    if isinstance(obj, ModelMap):
        if opts:
            raise TypeError(f"{sorted(opts)} build a model map from a module; this ModelMap is already built")
        return obj
    return model_map(obj, **opts, backend_world=session.world_size())


def _layout_of(obj: Any, who: str, options: dict[str, Any]) -> layouts.Drawn:
    """(layout, per-rank values or None, default view options) for what a layout view draws."""
    if "of" in options:
        return layouts.of_chunks(obj, options.pop("of"), options.pop("offsets", None), who)
    if "offsets" in options:
        raise TypeError(f"{who}(..., offsets=...) goes with of=: the global tensor the chunks come from")
    if isinstance(obj, Layout):
        return obj, options.pop("values", None), {}
    if "values" in options:
        raise TypeError(f"{who}(..., values=...) is only for a Layout: a {type(obj).__name__} brings its own")
    if _torch.is_dtensor(obj):
        return layouts.of_dtensor(obj)
    adapter = adapters.for_object(obj)
    if adapter is not None:  # a framework's tensor with its own spec (PhysicsNeMo's ShardTensor)
        layout, values, extra = layouts.of_sharded(
            adapter.layout(obj), adapter.local(obj), type(obj).__name__
        )
        return layout, values, {"title": adapters.view_title(obj, layout), **extra}
    if _torch.is_local_tensor(obj):
        return layouts.of_local_tensor(obj)
    if isinstance(obj, torch.Tensor):
        raise TypeError(
            f"{who} got a plain torch.Tensor {tuple(obj.shape)}, which has no mesh or placements. "
            f"{who} accepts {_ACCEPTS}: distribute it first (distribute_tensor(t, mesh, placements) "
            f"inside sv.record()), or draw the geometry alone with {who}(sv.layout({tuple(obj.shape)}, "
            '(4,), ["S(0)"]))'
        )
    raise TypeError(
        f"{who} accepts {_ACCEPTS}, or a Trace / Event (from sv.record) for the collective player; "
        f"got {type(obj).__name__}"
    )


def _check_options(who: str, options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"{who} got unknown option(s) {unknown}; it takes {', '.join(allowed)}")


session.set_drawer(show)  # a backend hands what it wants drawn to session.draw
