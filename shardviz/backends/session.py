"""Session state: the current backend, the last trace, and the drawer the front end registered.

State alone, so that both sides meet here without importing each other: a backend sets the last
trace and hands what it wants drawn to ``draw``; the front ends read the trace and register the
drawer (``shardviz.show`` does at import). Which backend to build, and building the default, is
``choose``'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..errors import BackendError

if TYPE_CHECKING:
    from ..data.trace import Trace
    from .base import Backend

_current: Backend | None = None
_last: Trace | None = None
_drawer: Callable[..., Any] | None = None
_running: list[str] = []  # what runs on the current backend's world now (outermost first)


def peek() -> Backend | None:
    """The current backend, or None before any was built (nothing is built here)."""
    return _current


def install(backend: Backend | None) -> Backend | None:
    """Make ``backend`` current (None: none) without closing the one in use, and return that one:
    a real rank, or a job recorded under torchrun, answers ``sv.*`` calls as that rank."""
    global _current
    previous, _current = _current, backend
    return previous


@contextlib.contextmanager
def swapped(backend: Backend) -> Iterator[Backend]:
    """Make ``backend`` current for a while without closing the one in use (``sv.compare`` runs
    the simulator next to a real backend this way)."""
    saved = install(backend)
    try:
        yield backend
    finally:
        install(saved)


@contextlib.contextmanager
def running(what: str) -> Iterator[None]:
    """While it lasts, ``what`` (``"sv.record()"``, ``"sv.run(fn)"``, ``"a %%spmd cell"``) runs on
    the current backend's world, so that world must not change under it: ``sv.use`` and
    ``sv.restart`` refuse until it ends (a recording of 4 ranks that went on in a world of 8 would
    hold groups of ranks its trace does not have, and numbers no real run gives)."""
    _running.append(what)
    try:
        yield
    finally:
        _running.pop()


def run_in_progress() -> str | None:
    """The outermost run or recording on the current backend's world, or None."""
    return _running[0] if _running else None


def world_size() -> int | None:
    """The current backend's world size, or None before any backend was built."""
    return None if _current is None else int(_current.world_size)


def last_trace() -> Trace | None:
    """The trace of the last ``record()`` block, ``run()`` or ``%%spmd`` cell."""
    return _last


def set_last(trace: Trace | None) -> None:
    global _last
    _last = trace


def set_drawer(drawer: Callable[..., Any]) -> None:
    """What ``draw`` calls: the notebook view of an object (``shardviz.show.show``)."""
    global _drawer
    _drawer = drawer


def draw(obj: Any, **options: Any) -> Any:
    """The notebook view of ``obj`` (a torch object, or plain data: a Layout with its values), as
    ``sv.show`` draws it wherever the notebook itself draws."""
    if _drawer is None:
        raise BackendError("nothing can draw here: import shardviz (its front end registers the views)")
    return _drawer(obj, **options)
