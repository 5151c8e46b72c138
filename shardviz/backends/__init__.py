"""The current backend: chosen by ``sv.use``, local with 4 ranks until then."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from .. import _torch
from .base import Backend, draw
from .local import AttachedBackend, LocalBackend

DEFAULT_WORLD_SIZE = 4
BACKENDS = ("local", "threads", "gloo", "nccl")

_current: Backend | None = None
_default_key: tuple[Any, ...] = ("local", DEFAULT_WORLD_SIZE)


def _build(name: str, world_size: int, **options: Any) -> Backend:
    if name == "local":
        if options:
            raise TypeError(f"the local backend takes no options, got {sorted(options)}")
        return LocalBackend(world_size)
    if name == "threads":
        if options:
            raise TypeError(f"the threads backend takes no options, got {sorted(options)}")
        from .threads import ThreadsBackend

        return ThreadsBackend(world_size)
    if name in ("gloo", "nccl"):
        from .cluster import ClusterBackend

        return ClusterBackend(name, world_size, **options)
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


def use(name: str = "local", world_size: int | None = None, **options: Any) -> Backend:
    """Switch backend; the same arguments again change nothing."""
    global _current
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    if world_size is None:
        world_size = DEFAULT_WORLD_SIZE
    key = (name, world_size, *sorted(options.items()))
    if _current is not None and _current.key() == key:
        return _current
    if _current is not None:
        _current.close()
        _current = None
    _current = _build(name, world_size, **options)
    return _current


@contextlib.contextmanager
def swapped(backend: Backend) -> Iterator[Backend]:
    """Make ``backend`` current for a while without closing the one in use (``sv.compare`` runs
    the simulator next to a real backend this way)."""
    global _current
    saved = _current
    _current = backend
    try:
        yield backend
    finally:
        _current = saved


def install(backend: Backend | None) -> Backend | None:
    """Make ``backend`` current (None: none) without closing the one in use, and return that one:
    a real rank, or a job recorded under torchrun, answers ``sv.*`` calls as that rank."""
    global _current
    previous, _current = _current, backend
    return previous


_attached: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()


def current() -> Backend:
    """The active backend, building the default (local, 4 ranks) on first use. Inside a
    LocalTensorMode that shardviz did not enter (a test harness's), the simulation it runs,
    attached to as it is (``AttachedBackend``), whatever ``sv.use`` chose."""
    global _current
    mode = _torch.active_local_mode()
    if mode is not None and not _torch.is_own_mode(mode):
        backend = _attached.get(mode)
        if backend is None:
            backend = _attached[mode] = AttachedBackend(mode)
        return backend
    if _current is None:
        _current = _build("local", DEFAULT_WORLD_SIZE)
    return _current


def peek() -> Backend | None:
    return _current


def restart() -> Backend:
    """Rebuild the current backend with the same arguments (real backends: in place)."""
    global _current
    _current = current().restart()
    return _current


def show(obj: Any, **options: Any) -> Any:
    """``sv.show``: drawn by the current backend, so that inside a ``%%spmd`` cell a real rank can
    send its shard to the notebook instead. Before any backend exists it only draws: a picture
    needs no process group."""
    if _current is None:
        return draw(obj, **options)
    return _current.show(obj, **options)


def device_type() -> str:
    if _current is None:
        return "cpu"
    return _current.device_type()
