"""``sv.show`` / ``sv.play`` / ``sv.plot`` / ``sv.export_html``: objects become plain data, then a view.

Views never touch torch. This module is the one step between: a DTensor becomes its ``Layout``
plus each rank's local values as numpy arrays; a LocalTensor (per-rank values, no placements)
becomes a side-by-side layout. ``show_layout`` takes that plain data directly, so a real-process
backend can draw shards it gathered from its ranks without any torch object at hand. A Trace (or
one of its events) is already plain data: it goes to the collective player through ``_player``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from . import _torch
from .layout import Layout, ShardInfo
from .layout import compute as _compute_layout
from .recorder import to_numpy
from .trace import Event, Trace

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from .model import ModelMap
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
    timeline = _timeline_view(obj, "sv.show", options)
    if timeline is not None:
        return timeline
    numerics = _numerics_widget(obj, "sv.show", options)
    if numerics is not None:
        return numerics
    if isinstance(obj, Trace | Event):
        return _player(obj, "sv.show", options)
    if _is_model(obj):
        return _model_widget(obj, "sv.show", options)
    layout, values, extra = _plain(obj, "sv.show", options)
    return show_layout(layout, values, **{**extra, **options})


def play(trace: Any, **options: Any) -> PlayerWidget:
    """The collective player: steps through a trace's collectives and redistributes.

    Options: ``step`` (start position, from 0; the widget's ``step`` trait follows the view; by
    default the training step's first collective), ``link`` (cost preset: "nvlink4", "pcie5",
    "ib-ndr", ...), ``local_steps=True`` (local compute on to_local() shards becomes a step too),
    ``title``, ``filter`` (``{"phase", "module", "mesh_dim", "all_ops"}``: the steps and timeline
    rows shown). An event alone plays as a one-step trace.
    """
    return _player(trace, "sv.play", options)


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
    from .memory import MemoryTimeline
    from .pipeline import Timeline
    from .views.mpl import plot_event, plot_layout, plot_trace

    if _is_numerics(obj):
        from .views.numerics_mpl import plot_numerics

        _check_options("sv.plot", options, ("title",))
        return plot_numerics(obj, **options)
    if isinstance(obj, MemoryTimeline):
        from .views.memory_mpl import plot_memory

        _check_options("sv.plot", options, ("title",))
        return plot_memory(obj, **options)
    if isinstance(obj, Timeline):
        from .views.pipeline_mpl import plot_timeline

        _check_options("sv.plot", options, ("title",))
        return plot_timeline(obj, **options)
    if isinstance(obj, Trace):
        _check_options("sv.plot", options, ("link", "title"))
        return plot_trace(obj, **options)
    if isinstance(obj, Event):
        _check_options("sv.plot", options, ("title", "trace"))
        return plot_event(obj, options.pop("trace", None), **options)
    if _is_model(obj):
        from .views.mpl import plot_model_map

        _check_options("sv.plot", options, (*_MAP_OPTIONS, "stack", "title"))
        view = {k: options.pop(k) for k in ("stack", "title") if k in options}
        return plot_model_map(_model_map(obj, options), **view)
    layout, values, extra = _plain(obj, "sv.plot", options)
    extra.pop("values_note", None)
    opts = {**extra, **options}
    _check_options("sv.plot", opts, _VIEW_OPTIONS)
    return plot_layout(layout, values, **opts)


def export_html(obj: Any, path: str | Path, **options: Any) -> Path:
    """One self-contained HTML file of the view ``sv.show`` draws (a layout, the player, a model
    map, a pipeline or memory timeline) that renders with no kernel and no network.

    Values are embedded up to ``values_budget`` bytes (default 16 MiB); past it the page keeps
    the geometry (the player: every step's shapes and flow) and says why values are missing.
    Every name in the data shows as text, and the page's Content-Security-Policy runs only its
    own script and loads nothing (views/markup.py), so a trace from a stranger is safe to open.
    """
    from .views.widgets import EXPORT_VALUES_BUDGET

    timeline = _timeline_view(obj, "sv.export_html", options)
    if timeline is not None:
        return timeline.export_html(path)
    budget = options.pop("values_budget", EXPORT_VALUES_BUDGET)
    numerics = _numerics_widget(obj, "sv.export_html", options)
    if numerics is not None:
        try:
            return numerics.export_html(path, values_budget=budget)
        finally:
            numerics.close()
    if isinstance(obj, Trace | Event):
        player = _player(obj, "sv.export_html", options)
        try:
            return player.export_html(path, values_budget=budget)
        finally:
            player.close()
    if _is_model(obj):
        model_widget = _model_widget(obj, "sv.export_html", options)
        try:
            return model_widget.export_html(path, values_budget=budget)
        finally:
            model_widget.close()
    layout, values, extra = _plain(obj, "sv.export_html", options)
    widget = show_layout(layout, values, **{**extra, **options})
    try:
        return widget.export_html(path, values_budget=budget)
    finally:
        widget.close()


def _timeline_view(obj: Any, who: str, options: dict[str, Any]) -> TimelineView | MemoryView | None:
    """The static SVG views: a pipeline Timeline's lanes, a MemoryTimeline's curves."""
    from .memory import MemoryTimeline
    from .pipeline import Timeline

    if isinstance(obj, MemoryTimeline):
        from .views.memory_svg import MemoryView

        _check_options(who, options, ("title",))
        return MemoryView(obj, **options)
    if not isinstance(obj, Timeline):
        return None
    from .views.pipeline_svg import TimelineView

    _check_options(who, options, ("title",))
    return TimelineView(obj, **options)


def _is_numerics(obj: Any) -> bool:
    from .numerics import NumericsReport

    return isinstance(obj, NumericsReport)


def _numerics_widget(obj: Any, who: str, options: dict[str, Any]) -> NumericsWidget | None:
    """A NumericsReport (``sv.diff``): its module tree coloured by error (``selected``, ``title``)."""
    if not _is_numerics(obj):
        return None
    from .views.numerics_view import NumericsWidget

    _check_options(who, options, ("selected", "title"))
    return NumericsWidget(obj, **options)


# ---- torch -> plain data ------------------------------------------------------------------------


def _is_model(obj: Any) -> bool:
    from .model import ModelMap

    return isinstance(obj, ModelMap | torch.nn.Module)


def _model_map(obj: Any, options: dict[str, Any]) -> ModelMap:
    """A ModelMap as given, or built from a module with the map options (popped)."""
    from .model import ModelMap, model_map

    opts = {k: options.pop(k) for k in _MAP_OPTIONS if k in options}
    if isinstance(obj, ModelMap):
        if opts:
            raise TypeError(f"{sorted(opts)} build a model map from a module; this ModelMap is already built")
        return obj
    return model_map(obj, **opts)


def _model_widget(obj: Any, who: str, options: dict[str, Any]) -> ModelWidget:
    from .views.model_view import ModelWidget

    _check_options(who, options, _MODEL_OPTIONS)
    return ModelWidget(_model_map(obj, options), **options)


def _plain(
    obj: Any, who: str, options: dict[str, Any]
) -> tuple[Layout, dict[int, np.ndarray] | None, dict[str, Any]]:
    """(layout, per-rank values or None, default view options) for any object the API accepts."""
    if "of" in options:
        return _from_chunks(obj, options.pop("of"), options.pop("offsets", None), who)
    if "offsets" in options:
        raise TypeError(f"{who}(..., offsets=...) goes with of=: the global tensor the chunks come from")
    if isinstance(obj, Layout):
        return obj, options.pop("values", None), {}
    if "values" in options:
        raise TypeError(f"{who}(..., values=...) is only for a Layout: a {type(obj).__name__} brings its own")
    if isinstance(obj, Trace | Event):
        raise TypeError(f"{who} draws a {type(obj).__name__} with the collective player, not a layout view")
    if _torch.is_dtensor(obj):
        return _from_dtensor(obj)
    if _torch.is_local_tensor(obj):
        return _from_local_tensor(obj)
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


def _player(obj: Any, who: str, options: dict[str, Any]) -> PlayerWidget:
    """The one place where traces and events plug in: the collective player."""
    from .views.player import PlayerWidget, event_trace

    _check_options(who, options, _PLAYER_OPTIONS)
    if isinstance(obj, Event):
        obj = event_trace(obj)
    if not isinstance(obj, Trace):
        hint = " (sv.record() returns one: `with sv.record() as trace: ...`)" if callable(obj) else ""
        raise TypeError(
            f"{who} plays a shardviz Trace (from sv.record, sv.run, sv.last_trace or sv.load) or one of "
            f"its events; got {type(obj).__name__}{hint}"
        )
    return PlayerWidget(obj, **options)


def _values(tensors: Mapping[int, torch.Tensor]) -> dict[int, np.ndarray]:
    with _torch.no_dispatch():
        return {int(r): to_numpy(t) for r, t in tensors.items()}


def _from_chunks(
    obj: Any, whole: Any, offsets: Any, who: str
) -> tuple[Layout, dict[int, np.ndarray], dict[str, Any]]:
    """Each rank's hand-made chunk (a per-rank tensor) drawn inside the global tensor ``whole``."""
    from .chunks import chunk_layout, find_offset, resolve_offsets

    per_rank = _torch.local_tensors(obj)
    if per_rank is None:
        kind = "DTensor (it knows its placements: drop of=)" if _torch.is_dtensor(obj) else type(obj).__name__
        raise TypeError(
            f"{who}(chunk, of=global) needs a per-rank tensor (each rank's chunk, e.g. from "
            f"sv.per_rank(lambda rank: x.chunk(4)[rank])), not a {kind}"
        )
    if not isinstance(whole, torch.Tensor) or _torch.is_local_tensor(whole) or _torch.is_dtensor(whole):
        raise TypeError(f"{who}(..., of=...) takes the plain global tensor the chunks were cut from")
    chunks = _values(dict(sorted(per_rank.items())))
    with _torch.no_dispatch():
        full = to_numpy(whole)
    given = resolve_offsets(offsets, sorted(chunks))
    found = given if given is not None else {r: find_offset(full, c, r) for r, c in chunks.items()}
    layout = chunk_layout(chunks, found, full.shape, _torch.dtype_name(whole.dtype))
    title = f"{len(chunks)} ranks' chunks of a {'×'.join(map(str, full.shape))} tensor (partitioned by hand)"
    return layout, chunks, {"title": title}


def _from_dtensor(dt: Any) -> tuple[Layout, dict[int, np.ndarray] | None, dict[str, Any]]:
    layout = _compute_layout(**_torch.dtensor_geometry(dt))
    local = _torch.local_of(dt)
    per_rank = _torch.local_tensors(local)
    try:
        if per_rank is not None:
            return layout, _values(per_rank), {}
        replicated = all(p == "R" for p in layout.placements)
        if replicated or layout.world_size == 1:
            # A Replicate-only DTensor may hold one plain tensor: every rank has the same values.
            same = _values({0: local})[0]
            return layout, {r: same for r in layout.ranks}, {}
    except (RuntimeError, TypeError, NotImplementedError) as e:
        return layout, None, {"values_note": f"values unavailable ({type(e).__name__}: {e}); geometry only"}
    return (
        layout,
        None,
        {
            "values_note": "values unknown: this DTensor holds only this process's shard; inside a "
            "%%spmd cell sv.show gathers every rank's"
        },
    )


def _from_local_tensor(lt: Any) -> tuple[Layout, dict[int, np.ndarray], dict[str, Any]]:
    """Per-rank tensors side by side: concatenated along the last dim, one mesh cell per rank."""
    per_rank = _torch.local_tensors(lt)
    assert per_rank is not None
    values = _values(dict(sorted(per_rank.items())))
    ndims = {a.ndim for a in values.values()}
    if len(ndims) != 1:
        raise ValueError(
            f"this LocalTensor's ranks hold tensors of different ranks (ndim {sorted(ndims)}); sv.show draws "
            "per-rank tensors side by side only when they have the same number of dims"
        )
    values = {r: a.reshape(1) if a.ndim == 0 else a for r, a in values.items()}
    nd = max(ndims.pop(), 1)
    ranks = tuple(values)
    last = nd - 1
    starts = np.cumsum([0] + [a.shape[last] for a in values.values()])
    lead = tuple(max(a.shape[d] for a in values.values()) for d in range(last))
    shape = (*lead, int(starts[-1]))
    shards = []
    for i, (rank, a) in enumerate(values.items()):
        indices = tuple(
            (range(int(starts[i]), int(starts[i + 1])),)
            if d == last
            else ((range(0, a.shape[d]),) if a.shape[d] else ())
            for d in range(nd)
        )
        indices = tuple(runs if all(len(r) for r in runs) else () for runs in indices)
        offset = tuple(int(starts[i]) if d == last else 0 for d in range(nd))
        shards.append(ShardInfo(rank=rank, coord=(i,), offset=offset, shape=a.shape, indices=indices))
    layout = Layout(
        global_shape=shape,
        dtype=_torch.dtype_name(lt.dtype),
        mesh_shape=(len(ranks),),
        mesh_dim_names=("rank",),
        placements=(f"S({last})",),
        shards=tuple(shards),
        mesh_ranks=ranks,
    )
    title = f"LocalTensor: {len(ranks)} ranks' tensors side by side along dim {last} (no placements)"
    return layout, values, {"title": title}


def _check_options(who: str, options: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise TypeError(f"{who} got unknown option(s) {unknown}; it takes {', '.join(allowed)}")
