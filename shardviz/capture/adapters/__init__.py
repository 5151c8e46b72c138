"""What shardviz knows of other libraries: tensor types that carry their own sharding spec
(PhysicsNeMo's ShardTensor), per-process singletons (accelerate's state), their traps explained.

Such a tensor is not a DTensor, and its shard sizes need not follow chunking, so the views, the
recorder and the error explainer ask its framework's adapter module for its geometry, its local
shard and its events. A framework's singletons are made per rank thread, and its code that the
lockstep simulator cannot run is explained by name. Each framework has one module here, imported
only once the framework itself is (as treescope keeps each framework in a module of its own):
importing shardviz never imports PhysicsNeMo, accelerate or transformers, and a session without
them pays one dict lookup per question.

The adapter may have to act as soon as its framework is imported, even in the middle of a
recorded cell (PhysicsNeMo's ``DistributedManager.initialize()`` in the same cell as its import
must already see the recording's world): ``watch_imports`` installs an import hook that only
reacts to the modules named in ``_WATCHED``.

A recording tells this module when it starts and ends (``recording_started``), per thread: an
adapter's hooks reach the recorder of the thread they run in, and adopt that recording's world.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# The framework's top-level package -> this package's module for it.
_ADAPTERS = {
    "physicsnemo": "shardviz.capture.adapters.physicsnemo",
    "accelerate": "shardviz.capture.adapters.accelerate",
    "transformers": "shardviz.capture.adapters.transformers",
}
# Framework modules whose import activates their adapter (what it hooks lives there).
_WATCHED = {
    "physicsnemo.distributed.manager": "physicsnemo",
    "physicsnemo.domain_parallel.shard_tensor": "physicsnemo",
    "accelerate.state": "accelerate",
    "transformers.modeling_utils": "transformers",
}

_active: dict[str, ModuleType] = {}
_lock = threading.RLock()


def _adapter(framework: str) -> ModuleType:
    """The adapter of ``framework``, imported and activated once."""
    hit = _active.get(framework)
    if hit is not None:
        return hit
    with _lock:
        if framework not in _active:
            module = importlib.import_module(_ADAPTERS[framework])
            _active[framework] = module
            module.activate()
        return _active[framework]


def _framework(obj: object) -> str | None:
    top = type(obj).__module__.partition(".")[0]
    return top if top in _ADAPTERS else None


def for_object(obj: object) -> Any:
    """The adapter module that draws ``obj`` (a tensor with its own sharding spec), or None."""
    framework = _framework(obj)
    if framework is None:
        return None
    adapter = _adapter(framework)
    return adapter if adapter.handles(obj) else None


def for_spec(spec: object) -> Any:
    """The adapter module that knows the shard sizes of ``spec`` (a DTensorSpec subclass), or None."""
    framework = _framework(spec)
    if framework is None:
        return None
    adapter = _adapter(framework)
    return adapter if adapter.handles_spec(spec) else None


def shard_sizes(spec: object) -> dict[int, tuple[int, ...]] | None:
    """Explicit per-coordinate shard sizes of a spec whose framework chooses them, else None."""
    adapter = for_spec(spec)
    return None if adapter is None else adapter.spec_shard_sizes(spec)


def local_of(obj: object) -> Any:
    """The local shard of a framework's sharded tensor (as ``to_local()`` gives it), or None."""
    adapter = for_object(obj)
    return None if adapter is None else adapter.local(obj)


def view_title(obj: object, layout: Any) -> str:
    """A view's default title for a framework's sharded tensor: its own type, not "DTensor"."""
    from ...data.describe import extent

    return f"{type(obj).__name__} {extent(layout.global_shape)} {layout.dtype}"


def active() -> list[Any]:
    """The adapters whose framework has been imported."""
    return list(_active.values())


# --- the recording each thread runs ----------------------------------------------------------------


@dataclass(frozen=True)
class Recording:
    """What an adapter may adopt: the simulated or real world a recording runs in. ``rank`` is
    None in the lockstep simulator (every rank at once)."""

    recorder: Any
    rank: int | None
    world_size: int


_threads = threading.local()
_all: list[Recording] = []  # every recording open, in any thread, oldest first


def recording_started(recorder: Any, rank: int | None, world_size: int) -> None:
    rec = Recording(recorder, rank, world_size)
    stack = getattr(_threads, "stack", None)
    if stack is None:
        stack = _threads.stack = []
    stack.append(rec)
    with _lock:
        _all.append(rec)
    for adapter in active():
        adapter.recording_started(rec)


def recording_ended(recorder: Any) -> None:
    stack: list[Recording] = getattr(_threads, "stack", [])
    for i in range(len(stack) - 1, -1, -1):
        if stack[i].recorder is recorder:
            del stack[i]
            break
    with _lock:
        for i in range(len(_all) - 1, -1, -1):
            if _all[i].recorder is recorder:
                del _all[i]
                break


def recording() -> Recording | None:
    """The recording this thread runs, or None. A thread that runs none while the lockstep
    simulator records (a thread of ``sv.run(fn, threads=N)``) belongs to the newest one."""
    stack = getattr(_threads, "stack", None)
    if stack:
        return stack[-1]
    with _lock:
        lockstep = [r for r in _all if r.rank is None]
        return lockstep[-1] if lockstep else None


# --- the import hook ------------------------------------------------------------------------------


class _Loader(importlib.abc.Loader):
    """A framework module's own loader, which activates the adapter once the module has run."""

    def __init__(self, loader: Any, framework: str) -> None:
        self._loader = loader
        self._framework = framework

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _adapter(self._framework).module_loaded(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...: the original's
        return getattr(self._loader, name)


class _Watch(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        framework = _WATCHED.get(fullname)
        if framework is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, framework)
                return spec
        return None


_watch = _Watch()


def watch_imports() -> None:
    """Activate each adapter when its framework is imported (now, if it already is)."""
    if _watch not in sys.meta_path:
        sys.meta_path.insert(0, _watch)
    for name, framework in _WATCHED.items():
        if name in sys.modules:
            _adapter(framework).module_loaded(name)
