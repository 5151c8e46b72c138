"""The threads that simulated code starts belong to its simulated process.

On real ranks, a thread that a rank starts (a checkpoint loader's ``ThreadPoolExecutor``, a
``threading.Thread``) lives in that rank's process: it sees the rank's process groups, meshes and
rank. In the simulation a thread started by simulated code would otherwise run outside it: under
``sv.use("threads")`` it would find no process group (``Could not resolve the process group
registered under the name 0``), and in the lockstep simulator it would run LocalTensors outside
LocalTensorMode, racing the recording thread (a different error on each run). So, while a
simulation runs (``simulated_processes``):

- a ``ThreadPoolExecutor`` that simulated code submits to runs each task at once, in the
  submitting thread: in the rank's thread (its world, its recorder, its turn) or in the lockstep
  simulation; the future is done when ``submit`` returns, a task's exception is the future's, and
  runs are the same every time (tasks in submission order, never racing the rank);
- a ``threading.Thread`` started by a rank's thread runs in that rank's world (its process groups
  and their names, ``dist.get_rank()``, its printing), alongside the rank as in a process. What
  the simulator cannot give it is refused by name rather than shared: a collective (the simulator
  carries out a rank's communication in the rank's own thread, one rank at a time) and a draw from
  the process's default generator (which holds whichever rank runs at that moment);
- a thread started inside the lockstep simulator cannot be every rank: an operation on the
  simulated ranks' tensors, or a collective, in it is refused with the way out (executor tasks,
  or ``sv.use("threads")``).

A refusal in a started thread is raised there (``threading.excepthook`` prints it, tagged with
the rank) and again when the simulation that started the thread ends, so that the run fails with
it rather than leaving it in the output.

Who the simulated code is comes from the simulations themselves (``register_kind``): the threads
backend's rank threads (``shardviz.capture.threadpg``), and the lockstep simulator's recording
thread (``lockstep``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ShardvizError
from . import torch as _torch


class SimulatedThreadError(ShardvizError, RuntimeError):
    """A thread started by simulated code did what the simulator cannot give it."""


@dataclass(frozen=True)
class _Kind:
    """A simulation whose code may start threads: ``child()``, called in the starting thread,
    returns what the started thread runs first (or None when this thread is not that
    simulation's)."""

    name: str
    child: Callable[[], Callable[[], Any] | None]


_kinds: list[_Kind] = []


def register_kind(name: str, child: Callable[[], Callable[[], Any] | None]) -> None:
    """A simulation's threads: ``child()`` as above. Registered once per name."""
    if all(k.name != name for k in _kinds):
        _kinds.append(_Kind(name, child))


# --- the refusals a simulation collects -----------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    """One ``simulated_processes`` block: the refusals of threads started while it lasted."""

    refusals: list[BaseException] = field(default_factory=list)


_lock = threading.Lock()
_entries: list[_Entry] = []
_originals: dict[str, Any] = {}


def _current_entry() -> _Entry | None:
    with _lock:
        return _entries[-1] if _entries else None


@contextlib.contextmanager
def simulated_processes() -> Iterator[None]:
    """While it lasts, threads and executors started by simulated code belong to it (above). A
    refusal in a started thread fails the block when it ends (once, with the first)."""
    entry = _Entry()
    with _lock:
        if not _entries:
            _install()
        _entries.append(entry)
    failed = False
    try:
        yield
    except BaseException:
        failed = True
        raise
    finally:
        with _lock:
            _entries.remove(entry)
            if not _entries:
                _uninstall()
        if entry.refusals and not failed:
            first = entry.refusals[0]
            raise SimulatedThreadError(str(first)) from first


def _install() -> None:
    _originals["start"] = threading.Thread.start
    _originals["submit"] = concurrent.futures.ThreadPoolExecutor.submit
    threading.Thread.start = _start  # type: ignore[method-assign]
    concurrent.futures.ThreadPoolExecutor.submit = _submit  # type: ignore[method-assign,assignment]


def _uninstall() -> None:
    threading.Thread.start = _originals.pop("start")  # type: ignore[method-assign]
    concurrent.futures.ThreadPoolExecutor.submit = _originals.pop("submit")  # type: ignore[method-assign]


def _child_setup() -> Callable[[], Any] | None:
    for kind in _kinds:
        setup = kind.child()
        if setup is not None:
            return setup
    return None


# --- executors: tasks run in the submitting simulated thread ----------------------------------


def _submit(self: concurrent.futures.ThreadPoolExecutor, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    if _child_setup() is None:
        return _originals["submit"](self, fn, *args, **kwargs)
    if getattr(self, "_shutdown", False):
        raise RuntimeError("cannot schedule new futures after shutdown")
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    try:
        result = fn(*args, **kwargs)
    except Exception as e:  # the task's error is the future's; Ctrl-C and a stopped run go on up
        future.set_exception(e)
    else:
        future.set_result(result)
    return future


# --- threads: started in the simulated process's world -------------------------------------------


def _start(self: threading.Thread) -> None:
    setup = _child_setup()
    if setup is not None:
        entry = _current_entry()
        run = self.run

        def run_in_world() -> None:
            try:
                setup()
                run()
            except SimulatedThreadError as e:
                if entry is not None:
                    entry.refusals.append(e)
                raise

        self.run = run_in_world  # type: ignore[method-assign]
    _originals["start"](self)


class ChildThreadGuard(_torch.TorchDispatchMode):
    """Entered in a thread that simulated code started: refuses what the simulator cannot give
    that thread (see the module's docstring); every other op runs as it is."""

    def __init__(self, lockstep: bool, rank: int | None = None) -> None:
        super().__init__()
        self.lockstep = lockstep
        self.rank = rank

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.lockstep:
            if _torch.is_communication_op(func) or any(
                _torch.is_local_tensor(a) for a in _leaves((args, kwargs))
            ):
                raise SimulatedThreadError(
                    f"a thread started inside the lockstep simulator ran {func} on the simulated ranks' "
                    "tensors. The lockstep simulator runs every rank at once in the thread that records; "
                    "a thread it starts runs outside it, so what it computes would depend on timing, not "
                    "on your code. Tasks of a ThreadPoolExecutor run in the recording thread (submit "
                    "there); for code that starts its own threads, run it with one thread per rank: "
                    "sv.use('threads', world_size=N)."
                )
            return func(*args, **kwargs)
        if _torch.is_communication_op(func):
            raise SimulatedThreadError(
                f"a thread that rank {self.rank} started called {func}. The threads simulator carries "
                "out a rank's collectives and messages in the rank's own thread, one rank at a time, so "
                "that every run meets in the same order; a second thread of the rank communicating "
                "alongside it would make that order depend on timing. Call it from the rank's own code, "
                "or in a ThreadPoolExecutor task (which runs in the rank's thread in the simulation); "
                "or run it on real process groups: sv.use('gloo', world_size=N)."
            )
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
            raise SimulatedThreadError(
                f"a thread that rank {self.rank} started draws random numbers ({func}) from the "
                "process's default generator. The threads simulator gives each rank its own generator "
                "by swapping it in while that rank runs; this thread runs alongside whichever rank "
                "holds it at that moment, so it would draw from another rank's stream. Draw them in "
                "the rank's own code or a ThreadPoolExecutor task (which runs in the rank's thread), "
                "or pass the thread a torch.Generator of its own (generator=...)."
            )
        return func(*args, **kwargs)


def _leaves(x: Any) -> Iterator[Any]:
    if isinstance(x, list | tuple):
        for v in x:
            yield from _leaves(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    else:
        yield x


def guard(lockstep: bool, rank: int | None = None) -> Callable[[], None]:
    """What a started thread runs first to be guarded (its dispatch modes are its own)."""

    def enter() -> None:
        ChildThreadGuard(lockstep, rank).__enter__()  # for the thread's life; its stack dies with it

    return enter


# --- the lockstep simulator's recording thread ----------------------------------------------------

_lockstep_threads: dict[int, int] = {}  # thread ident -> how many lockstep blocks it is inside


@contextlib.contextmanager
def lockstep() -> Iterator[None]:
    """The lockstep simulation runs in this thread while the block lasts: executor tasks it
    submits run here, and threads it starts are guarded (above)."""
    ident = threading.get_ident()
    with _lock:
        _lockstep_threads[ident] = _lockstep_threads.get(ident, 0) + 1
    try:
        with simulated_processes():
            yield
    finally:
        with _lock:
            left = _lockstep_threads[ident] - 1
            if left:
                _lockstep_threads[ident] = left
            else:
                del _lockstep_threads[ident]


def _lockstep_child() -> Callable[[], Any] | None:
    if threading.get_ident() not in _lockstep_threads:
        return None
    return guard(lockstep=True)


register_kind("lockstep", _lockstep_child)
