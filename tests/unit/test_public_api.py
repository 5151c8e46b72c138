"""The public API is ``shardviz``'s own names: the modules behind them may move, the names may not.

The lists below were written down from the package as it stood before its modules were laid out
in layer folders; a name that goes, changes kind, or takes other parameters fails here.
"""

from __future__ import annotations

import inspect
from types import ModuleType

import shardviz as sv

CLASSES = {
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
}

# Each public function's parameters: names, kinds and defaults (annotations left out).
FUNCTIONS = {
    "compare": "(fn, *args, values='all', rtol=1e-05, atol=1e-06, **kwargs)",
    "device_type": "()",
    "diff": "(reference, parallel, inputs=None, *, against=None, loss=None, optimizer=None, tolerance=None, "
    "modules=None, backward=True, budget=268435456, seed=0, values=67108864, context=6)",
    "export_html": "(obj, path, **options)",
    "last_trace": "()",
    "layout": "(obj, mesh_shape=None, placements=None, mesh_dim_names=None, **kwargs)",
    "load": "(path, *, allow_pickle=False, progress=True, source_root=None, max_member_bytes=None, "
    "max_file_bytes=None, max_json_bytes=None, max_world_size=None)",
    "load_ipython_extension": "(ipython)",
    "model_map": "(model, optimizer=None, *, world_size=None, grads=True, buffers=True, name=None)",
    "numerics": "(model, inputs, parallelize=None, *, loss=None, optimizer=None, tolerance=None, "
    "modules=None, backward=True, budget=268435456, seed=0, values=67108864, reference=None)",
    "per_rank": "(fn)",
    "pipeline_timeline": "(trace, forward=1, backward=1)",
    "plan": "(shape, mesh_shape, src, dst, mesh_dim_names=None, *, dtype='float32')",
    "play": "(trace, **options)",
    "playground": "(shape=None, mesh_shape=None, src=None, dst=None, mesh_dim_names=None, *, link=None)",
    "plot": "(obj, **options)",
    "record": "(values=67108864, memory=False)",
    "record_job": "(path=None, *, values=67108864, flush_every=1.0, signals=True)",
    "restart": "()",
    "run": "(fn, *args, values=67108864, threads=None, memory=False, **kwargs)",
    "show": "(obj, **options)",
    "use": "(backend='local', world_size=None, **options)",
}

PUBLIC = CLASSES | set(FUNCTIONS) | {"__version__"}


def _bare(fn: object) -> str:
    sig = inspect.signature(fn)  # type: ignore[arg-type]
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def test_all_lists_todays_public_names():
    assert sorted(sv.__all__) == sorted(PUBLIC)


def test_every_public_name_is_in_dir():
    assert sorted(PUBLIC - set(dir(sv))) == []


def test_no_other_public_name_appears():
    """Besides submodules (``shardviz.data``, ...) and what ``from __future__``/``typing`` leave."""
    extra = {
        n
        for n in dir(sv)
        if not n.startswith("_") and not isinstance(getattr(sv, n), ModuleType) and n not in PUBLIC
    }
    assert sorted(extra - {"annotations", "Any"}) == []


def test_classes_are_classes():
    assert sorted(n for n in CLASSES if not inspect.isclass(getattr(sv, n))) == []


def test_functions_keep_their_parameters():
    got = {n: _bare(getattr(sv, n)) for n in FUNCTIONS}
    assert got == FUNCTIONS


def test_version_is_a_version_string():
    parts = sv.__version__.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts)
