"""The current backend: chosen by ``sv.use``, local with 4 ranks until then.

What the front ends ask of wherever the ranks are goes through ``current()``; the state itself
(which backend is current) is ``session``'s, which the backends read too.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..capture import torch as _torch
from . import session
from .base import Backend
from .local import AttachedBackend, LocalBackend

DEFAULT_WORLD_SIZE = 4
BACKENDS = ("local", "threads", "gloo", "nccl")


def _build(name: str, world_size: int, **options: Any) -> Backend:
    if name == "local":
        engine = options.pop("engine", None)
        if options:
            raise TypeError(f"the local backend takes one option, engine=, got {sorted(options)}")
        return LocalBackend(world_size, engine)
    if name == "threads":
        if options:
            raise TypeError(f"the threads backend takes no options, got {sorted(options)}")
        from .threads import ThreadsBackend  # its meeting point loads only when asked for

        return ThreadsBackend(world_size)
    if name in ("gloo", "nccl"):
        from .cluster import ClusterBackend  # ipyparallel loads only when asked for

        return ClusterBackend(name, world_size, **options)
    raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")


def use(name: str = "local", world_size: int | None = None, **options: Any) -> Backend:
    """Switch backend; the same arguments again change nothing."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {BACKENDS}")
    if world_size is None:
        world_size = DEFAULT_WORLD_SIZE
    if name == "local":
        options["engine"] = _torch.check_engine(options.get("engine") or _torch.default_engine())
    key = (name, world_size, *sorted(options.items()))
    old = session.peek()
    if old is not None and old.key() == key:
        return old
    if old is not None:
        old.close()
        session.install(None)
    backend = _build(name, world_size, **options)
    session.install(backend)
    return backend


_attached: weakref.WeakKeyDictionary[Any, Backend] = weakref.WeakKeyDictionary()


def current() -> Backend:
    """The active backend, building the default (local, 4 ranks) on first use. Inside a
    LocalTensorMode that shardviz did not enter (a test harness's), the simulation it runs,
    attached to as it is (``AttachedBackend``), whatever ``sv.use`` chose."""
    mode = _torch.active_local_mode()
    if mode is not None and not _torch.is_own_mode(mode):
        attached = _attached.get(mode)
        if attached is None:
            attached = _attached[mode] = AttachedBackend(mode)
        return attached
    backend = session.peek()
    if backend is None:
        backend = _build("local", DEFAULT_WORLD_SIZE)
        session.install(backend)
    return backend


def restart() -> Backend:
    """Rebuild the current backend with the same arguments (real backends: in place)."""
    backend = current().restart()
    session.install(backend)
    return backend


def show(obj: Any, **options: Any) -> Any:
    """``sv.show``: drawn by the current backend, so that inside a ``%%spmd`` cell a real rank can
    send its shard to the notebook instead. Before any backend exists it only draws: a picture
    needs no process group."""
    backend = session.peek()
    if backend is None:
        return session.draw(obj, **options)
    return backend.show(obj, **options)


def device_type() -> str:
    backend = session.peek()
    return "cpu" if backend is None else backend.device_type()
