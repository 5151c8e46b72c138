"""shardviz: see, step through and debug PyTorch DTensor sharding and collectives in notebooks.

The public API lives here; everything else is an implementation detail.
"""

from __future__ import annotations

from typing import Any

from . import _torch
from .backends import device_type, restart
from .backends import show as _backend_show
from .backends import use as _use
from .compare import compare
from .diff import diff, numerics
from .job import record_job
from .layout import Layout, ShardInfo
from .layout import compute as _compute_layout
from .memory import MemoryTimeline
from .model import ModelMap, model_map
from .numerics import NumericsReport, StepNumerics, Tolerance
from .pipeline import Timeline
from .pipeline import timeline as pipeline_timeline
from .placement import Placement
from .plan import plan
from .record import last_trace, per_rank, record, run
from .show import export_html, play, plot
from .show import show as _view
from .trace import CollectiveEvent, Event, OpEvent, RedistributeEvent, Source, TensorSnapshot, Trace

__version__ = "0.1.0"

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
) -> Trace:
    """Open a trace: a file written by ``trace.save(path)``; a folder of per-rank files written by
    ``sv.record_job`` (merged into one trace; when ranks died, hung or diverged, the events they
    share, with ``trace.notes`` saying which rank stopped where); or PyTorch Flight Recorder dumps
    (a folder of per-rank dumps, or one file), aligned by process group and sequence number.

    Plain JSON and numpy arrays: no code runs. Flight Recorder dumps in torch's pickle format are
    refused unless ``allow_pickle=True`` — unpickling runs whatever code the file names, so pass
    it only for files you trust. ``progress`` prints a status line when loading takes a while.

    A file may come from a stranger: a bad one raises ``TraceFileError`` naming the field, and
    what loading may cost is capped (``max_*``: bytes, or sizes such as ``"8GiB"``; defaults in
    ``shardviz.limits``, or ``$SHARDVIZ_MAX_MEMBER_BYTES`` and the like). A Flight Recorder stack's
    source line is read only from files under ``source_root`` (a folder you name; never outside it).
    """
    from .job import load_path
    from .limits import resolve

    limits = resolve(
        max_member_bytes=max_member_bytes,
        max_file_bytes=max_file_bytes,
        max_json_bytes=max_json_bytes,
        max_world_size=max_world_size,
    )
    return load_path(
        path, allow_pickle=allow_pickle, progress=progress, source_root=source_root, limits=limits
    )


def use(backend: str = "local", world_size: int | None = None, **options: Any) -> None:
    """Choose where SPMD code runs: ``"local"`` (simulated in this kernel, every rank at once),
    ``"threads"`` (simulated in this kernel, one thread per rank: Python may branch on the rank),
    ``"gloo"`` or ``"nccl"`` (real processes).

    Calling it again with the same arguments changes nothing; other arguments rebuild the backend.
    """
    _use(backend, world_size, **options)


def show(obj: Any, **options: Any) -> Any:
    return _backend_show(obj, **options)


show.__doc__ = f"""{_view.__doc__}
    Inside a ``%%spmd`` cell on a real backend, each rank sends its shard and the notebook draws
    the gathered view, as under the simulator.
    """


def layout(
    obj: Any,
    mesh_shape: Any = None,
    placements: Any = None,
    mesh_dim_names: Any = None,
    **kwargs: Any,
) -> Layout:
    """Per-rank geometry of a DTensor, or of (shape, mesh_shape, placements) with no tensor at all.

    ``sv.layout(dt)`` reads a DTensor; ``sv.layout((10, 3), (4,), ["S(0)"])`` computes the same
    geometry as a pure function, for any mesh size, without a process group.
    """
    if isinstance(obj, Layout):
        if mesh_shape is not None or placements is not None:
            raise TypeError("sv.layout(layout) takes no mesh_shape/placements: the layout already has them")
        return obj
    if _torch.is_dtensor(obj):
        if mesh_shape is not None or placements is not None or mesh_dim_names is not None:
            raise TypeError(
                "sv.layout(dtensor) reads the mesh and placements from the DTensor; pass only the DTensor"
            )
        return _compute_layout(**_torch.dtensor_geometry(obj))
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
    return _compute_layout(obj, mesh_shape, placements, mesh_dim_names, **kwargs)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext shardviz``: registers ``%shardviz`` and ``%%spmd``."""
    from .magics import load_ipython_extension as _load_magics

    _load_magics(ipython)
