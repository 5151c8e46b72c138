"""The current backend: chosen by ``sv.use``, local with 4 ranks until then.

What the front ends ask of wherever the ranks are goes through ``current()``; the state itself
(which backend is current) is ``session``'s, which the backends read too.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..capture import torch as _torch
from ..errors import BackendError
from . import capacity, session
from .base import Backend, check_world_size
from .local import AttachedBackend, LocalBackend

DEFAULT_WORLD_SIZE = 4
CHECK_CAPACITY = capacity.OVERRIDE.split("=")[0]
BACKENDS = ("local", "threads", "gloo", "nccl")


def _check(name: str, world_size: int, options: dict[str, Any]) -> None:
    """Refuse what cannot start before the backend in use is closed: a simulator's unknown options,
    a world larger than this machine can hold (``check_capacity=False`` skips that)."""
    if name not in ("local", "threads"):
        return
    checked = options.get(CHECK_CAPACITY, True)
    allowed = {CHECK_CAPACITY, "engine"} if name == "local" else {CHECK_CAPACITY}
    if set(options) - allowed:
        raise TypeError(
            f"the {name} backend takes no options but {', '.join(sorted(allowed))}, got {sorted(options)}"
        )
    check_world_size(world_size)
    if checked:
        threads = world_size if name == "threads" else 0
        capacity.check(
            f"sv.use({name!r}, world_size={world_size:,})",
            threads,
            world_size,
            "Use a smaller world"
            + (" (the lockstep simulator, sv.use('local'), needs no thread per rank)" if threads else ""),
        )


def _build(name: str, world_size: int, **options: Any) -> Backend:
    _check(name, world_size, options)
    if name == "local":
        return LocalBackend(world_size, options.get(CHECK_CAPACITY, True), options.get("engine"))
    if name == "threads":
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
    # the default engine keeps the key the local backend always had
    keyed = {k: v for k, v in options.items() if (k, v) != ("engine", _torch.DEFAULT_ENGINE)}
    key = (name, world_size, *sorted(keyed.items()))
    old = session.peek()
    if old is not None and old.key() == key:
        return old
    _refuse_inside_a_run(f"sv.use({name!r}, world_size={world_size})", old)
    _check(name, world_size, options)
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


def _refuse_inside_a_run(call: str, old: Backend | None) -> None:
    running = session.run_in_progress()
    if running is None:
        return
    world = f"the {old.name!r} backend's {old.world_size} ranks" if old is not None else "its world"
    raise BackendError(
        f"{call} inside {running}: that recording runs on {world} from its start to its end, and "
        "changing the world under it would give collectives over ranks its trace does not have and "
        "numbers no real run gives. Call it before the block or cell starts, or after it ends."
    )


def restart() -> Backend:
    """Rebuild the current backend with the same arguments (real backends: in place)."""
    _refuse_inside_a_run("sv.restart()", session.peek())
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
    """The device type of the current backend's tensors: ``"cpu"`` for the simulators and gloo,
    ``"cuda"`` for nccl, so that ``init_device_mesh(sv.device_type(), ...)`` runs on any backend.

    It reads the backend's kind and initialises nothing (the notebook never touches CUDA itself).
    """
    backend = session.peek()
    return "cpu" if backend is None else backend.device_type()
