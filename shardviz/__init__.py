"""shardviz: see, step through and debug PyTorch DTensor sharding and collectives in notebooks.

The public API lives here; everything else is an implementation detail.
"""

from __future__ import annotations

import sys as _sys
import types as _types
from importlib import import_module as _import_module
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any

from ._version import __version__
from .backends import session as _session
from .capture import adapters as _adapters

if _TYPE_CHECKING:
    from .backends.choose import device_type, restart
    from .compare import compare
    from .data.events import CollectiveEvent, Event, OpEvent, RedistributeEvent, Source, TensorSnapshot
    from .data.memory import MemoryTimeline
    from .data.model import ModelMap
    from .data.numerics import NumericsReport, StepNumerics, Tolerance
    from .data.pipeline import Timeline
    from .data.pipeline import timeline as pipeline_timeline
    from .data.plan import plan
    from .data.trace import Trace
    from .diff import diff, numerics
    from .geometry.layout import Layout, ShardInfo
    from .geometry.placement import Placement
    from .record import last_trace, per_rank, record, record_job, run
    from .show import export_html, play, plot

_adapters.watch_imports()  # a framework's own sharded tensors (PhysicsNeMo's), once it is imported


def _draw(obj: Any, **options: Any) -> Any:
    """What a backend hands to ``session.draw`` before the views were loaded: loads them (their
    module registers its own drawer in place of this one) and draws."""
    from .show import show as _view

    return _view(obj, **options)


_session.set_drawer(_draw)

# The public names defined elsewhere, by module: imported on first use, so that ``import shardviz``
# costs little more than ``import torch`` (torch.distributed.tensor, the recorder, matplotlib and
# the widgets load when something needs them).
_LAZY = {
    "device_type": ".backends.choose",
    "restart": ".backends.choose",
    "compare": ".compare",
    "CollectiveEvent": ".data.events",
    "Event": ".data.events",
    "OpEvent": ".data.events",
    "RedistributeEvent": ".data.events",
    "Source": ".data.events",
    "TensorSnapshot": ".data.events",
    "MemoryTimeline": ".data.memory",
    "ModelMap": ".data.model",
    "NumericsReport": ".data.numerics",
    "StepNumerics": ".data.numerics",
    "Tolerance": ".data.numerics",
    "Timeline": ".data.pipeline",
    "pipeline_timeline": ".data.pipeline:timeline",
    "plan": ".data.plan",
    "Trace": ".data.trace",
    "diff": ".diff",
    "numerics": ".diff",
    "Layout": ".geometry.layout",
    "ShardInfo": ".geometry.layout",
    "Placement": ".geometry.placement",
    "last_trace": ".record",
    "per_rank": ".record",
    "record": ".record",
    "record_job": ".record",
    "run": ".record",
    "export_html": ".show",
    "play": ".show",
    "plot": ".show",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'shardviz' has no attribute {name!r}")
    module, _, attr = where.partition(":")
    value = getattr(_import_module(module, __name__), attr or name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


class _Package(_types.ModuleType):
    """The package, whose public functions named like its modules (``record``, ``show``, ``diff``,
    ``compare``) stay functions: importing such a module later, as the lazy names do, would
    otherwise bind the module over the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, _types.ModuleType) and name in __all__:
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

__all__ = [
    "CollectiveEvent",
    "Event",
    "Layout",
    "MemoryTimeline",
    "ModelMap",
    "NumericsReport",
    "OpEvent",
    "Placement",
    "RedistributeEvent",
    "ShardInfo",
    "Source",
    "StepNumerics",
    "TensorSnapshot",
    "Timeline",
    "Tolerance",
    "Trace",
    "__version__",
    "compare",
    "device_type",
    "diff",
    "export_html",
    "last_trace",
    "layout",
    "load",
    "load_ipython_extension",
    "model_map",
    "numerics",
    "per_rank",
    "pipeline_timeline",
    "plan",
    "play",
    "playground",
    "plot",
    "record",
    "record_job",
    "restart",
    "run",
    "show",
    "use",
]


def load(
    path: Any,
    *,
    allow_pickle: bool = False,
    progress: bool = True,
    source_root: Any = None,
    max_member_bytes: int | str | None = None,
    max_file_bytes: int | str | None = None,
    max_json_bytes: int | str | None = None,
    max_world_size: int | None = None,
) -> Trace | NumericsReport:
    """Open a trace: a file written by ``trace.save(path)``; a folder of per-rank files written by
    ``sv.record_job`` (merged into one trace; when ranks died, hung or diverged, the events they
    share, with ``trace.notes`` saying which rank stopped where); or PyTorch Flight Recorder dumps
    (a folder of per-rank dumps, or one file), aligned by process group and sequence number.

    Plain JSON and numpy arrays: no code runs. Flight Recorder dumps in torch's pickle format are
    refused unless ``allow_pickle=True`` — unpickling runs whatever code the file names, so pass
    it only for files you trust. ``progress`` prints a status line when loading takes a while.

    A file may come from a stranger: a bad one raises ``TraceFileError`` naming the field, and
    what loading may cost is capped (``max_*``: bytes, or sizes such as ``"8GiB"``; defaults in
    ``shardviz.data.limits``, or ``$SHARDVIZ_MAX_MEMBER_BYTES`` and the like). A Flight Recorder stack's
    source line is read only from files under ``source_root`` (a folder you name; never outside it).

    A file written by ``report.save(path)`` (an ``sv.diff`` report) comes back as the
    ``NumericsReport``, equal to the one saved, read with the same bounds and checks.
    """
    from .capture.recorder.snapshot import from_values
    from .data.limits import resolve
    from .data.load import load_path
    from .data.numerics.report_file import is_report, load_report

    limits = resolve(
        max_member_bytes=max_member_bytes,
        max_file_bytes=max_file_bytes,
        max_json_bytes=max_json_bytes,
        max_world_size=max_world_size,
    )
    if is_report(path):
        return load_report(path, limits=limits, tensor=from_values)
    return load_path(
        path,
        allow_pickle=allow_pickle,
        progress=progress,
        source_root=source_root,
        limits=limits,
        tensor=from_values,  # a saved tensor result comes back a torch tensor
    )


def use(backend: str = "local", world_size: int | None = None, **options: Any) -> None:
    """Choose where SPMD code runs: ``"local"`` (simulated in this kernel, every rank at once),
    ``"threads"`` (simulated in this kernel, one thread per rank: Python may branch on the rank),
    ``"gloo"`` or ``"nccl"`` (real processes).

    Calling it again with the same arguments changes nothing; other arguments rebuild the backend.
    """
    from .backends.choose import use as _use

    _use(backend, world_size, **options)


def show(obj: Any, **options: Any) -> Any:
    from .backends.choose import show as _backend_show

    return _backend_show(obj, **options)


def _show_doc() -> str:
    """``sv.show``'s help: the view's own, read from its module without importing it (which would
    load torch and the views)."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).parent / "show.py").read_text())
    view = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "show")
    return f"""{ast.get_docstring(view, clean=False)}
    Inside a ``%%spmd`` cell on a real backend, each rank sends its shard and the notebook draws
    the gathered view, as under the simulator.
    """


show.__doc__ = _show_doc()


def layout(
    obj: Any,
    mesh_shape: Any = None,
    placements: Any = None,
    mesh_dim_names: Any = None,
    **kwargs: Any,
) -> Layout:
    """Per-rank geometry of a DTensor, or of (shape, mesh_shape, placements) with no tensor at all.

    ``sv.layout(dt)`` reads a DTensor (or PhysicsNeMo's ShardTensor, with its own shard sizes);
    ``sv.layout((10, 3), (4,), ["S(0)"])`` computes the same geometry as a pure function, for any
    mesh size, without a process group. ``shard_sizes={0: (3, 3, 2, 2)}`` gives the size of each
    coordinate's piece along a ``S(d)`` mesh dim where the shards do not follow chunking.
    """
    from .capture import torch as _torch
    from .geometry.layout import Layout
    from .geometry.layout import check_arguments as _check_layout_arguments
    from .geometry.layout import compute as _compute_layout

    if isinstance(obj, Layout):
        if mesh_shape is not None or placements is not None:
            raise TypeError("sv.layout(layout) takes no mesh_shape/placements: the layout already has them")
        return obj
    if _torch.is_dtensor(obj):
        if mesh_shape is not None or placements is not None or mesh_dim_names is not None:
            raise TypeError(
                "sv.layout(dtensor) reads the mesh and placements from the DTensor; pass only the DTensor"
            )
        from .capture.layouts import held_layout

        return held_layout(obj)
    adapter = _adapters.for_object(obj)
    if adapter is not None:
        if mesh_shape is not None or placements is not None or mesh_dim_names is not None:
            raise TypeError(
                f"sv.layout({type(obj).__name__}) reads the mesh, placements and shard sizes from the "
                "tensor's spec; pass only the tensor"
            )
        return adapter.layout(obj)
    if _torch.is_local_tensor(obj) or hasattr(obj, "__torch_function__"):
        raise TypeError(
            f"sv.layout got a {type(obj).__name__}, which has no placements: pass a DTensor, or a global "
            'shape with a mesh shape and placements, e.g. sv.layout((10, 3), (4,), ["S(0)"])'
        )
    if mesh_shape is None or placements is None:
        raise TypeError(
            "sv.layout(shape, mesh_shape, placements) needs all three, e.g. "
            'sv.layout((10, 3), (4,), ["S(0)"]); or pass a DTensor'
        )
    try:
        _check_layout_arguments(
            obj, mesh_shape, placements, mesh_dim_names, kwargs.get("mesh_ranks"), kwargs.get("groups")
        )
    except (TypeError, ValueError) as e:
        # The arguments are wrong: the error points at the caller's line, not at the validators
        # under the cached geometry (a screenful of frames in a notebook).
        raise e.with_traceback(None) from None
    return _compute_layout(obj, mesh_shape, placements, mesh_dim_names, **kwargs)


def model_map(
    model: Any,
    optimizer: Any = None,
    *,
    world_size: int | None = None,
    grads: bool = True,
    buffers: bool = True,
    name: str | None = None,
) -> ModelMap:
    """The model map of an ``nn.Module`` (DTensor or plain parameters, any device, meta too), or of
    a mapping ``{name: Layout}`` (pure geometry, e.g. from ``sv.layout(shape, mesh, placements)``).

    ``optimizer``: its state per parameter (Adam's ``exp_avg``, ``exp_avg_sq``, ``step``) is
    counted as rows of kind ``"optimizer"``; a wrapper of several optimizers (``.optimizers``, as
    torchtitan's OptimizersContainer) or a list of them counts each one's. ``grads``: count each
    parameter's ``.grad`` when it has one. ``world_size``: the world plain tensors are replicated
    over (default: the current backend's, or the largest rank any DTensor names, plus one).
    """
    from .capture.model_map import model_map as _model_map

    return _model_map(
        model,
        optimizer,
        world_size=world_size,
        grads=grads,
        buffers=buffers,
        name=name,
        backend_world=_session.world_size(),
    )


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext shardviz``: registers ``%shardviz`` and ``%%spmd``."""
    from .magics import load_ipython_extension as _load_magics

    _load_magics(ipython)


def playground(
    shape: Any = None,
    mesh_shape: Any = None,
    src: Any = None,
    dst: Any = None,
    mesh_dim_names: Any = None,
    *,
    link: str | None = None,
) -> Any:
    """A placement playground for teaching: choose a tensor shape, a mesh (with dim names) and
    source / target placements per mesh dim in the widget; it draws both layouts, DTensor's
    redistribute plan with each collective's bytes and alpha-beta time on ``link``, and steps
    through the collectives. Small shapes run on ``arange`` values under the local simulator;
    model-size ones are planned from geometry only (``sv.plan``); a note says which.

    ``sv.playground((10, 6), (4,), ["S(0)"], ["R"], ["tp"])`` sets the first choice.
    """
    from .placement_playground import playground as _playground

    return _playground(shape, mesh_shape, src, dst, mesh_dim_names, link=link)
