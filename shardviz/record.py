"""Running SPMD code and recording it: ``record()``, ``run()``, ``per_rank()``, ``last_trace()``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import _torch, backends
from .errors import BackendError
from .explain import explain_simulation_error
from .recorder import Recorder, ValueBudget, split_per_rank
from .storage import MemoryRecorder, made
from .trace import DEFAULT_VALUE_BUDGET, Trace

_last: Trace | None = None


def last_trace() -> Trace | None:
    """The trace of the last ``record()`` block, ``run()`` or ``%%spmd`` cell."""
    return _last


def _set_last(trace: Trace) -> None:
    global _last
    _last = trace


def _local() -> Any:
    backend = backends.current()
    if backend.name != "local":
        raise BackendError(
            f"record() runs code in this process, which the {backend.name!r} backend cannot do; use "
            "sv.run(fn) or a %%spmd cell, or switch back with sv.use('local')"
        )
    return backend


@contextlib.contextmanager
def record(values: str | int = DEFAULT_VALUE_BUDGET, memory: Any = False) -> Iterator[Trace]:
    """Run the body as SPMD ranks on the local backend and record what it communicates.

    ``values`` is the value policy: ``"all"``, ``"none"`` or a byte budget for the values of all
    snapshots in this trace (default 64 MiB); past the budget, snapshots keep shape and dtype only.
    ``memory=True`` also counts the live tensor storage of every rank as each event starts
    (``trace.memory``, a ``MemoryTimeline``: peak and timeline per rank); a module, an optimizer
    or a list of them counts their existing tensors too. It looks at every operator's result, so
    it is off by default.
    The trace's events are filled in when the block ends. No dispatch mode outlives the block,
    even when the body raises; the error keeps its type.
    """
    ValueBudget(values)  # validate before entering anything
    backend = _local()
    trace = Trace(backend.world_size, "local", values)
    recorder = _recorder(trace, backend.world_size, values, memory)
    try:
        with backend.simulate(), recorder:
            yield trace
    except BaseException as e:
        trace.complete = False
        explain_simulation_error(e, backend.world_size)  # in place: same object, type and cause
        raise
    finally:
        recorder.finish()
        _set_last(trace)


def _recorder(trace: Trace, world_size: int, values: str | int, memory: Any, **kw: Any) -> Recorder:
    if memory is False or memory is None:
        return Recorder(trace, world_size, values, **kw)
    return MemoryRecorder(trace, world_size, values, memory=memory, **kw)


def run(
    fn: Callable[..., Any],
    *args: Any,
    values: str | int = DEFAULT_VALUE_BUDGET,
    threads: int | None = None,
    memory: Any = False,
    **kwargs: Any,
) -> Trace:
    """Run ``fn(*args, **kwargs)`` on every rank and return the Trace; ``trace.results[rank]`` is
    what ``fn`` returned on that rank (a DTensor's local shard, a LocalTensor's per-rank tensor).

    ``threads=N`` (local backend) runs ``fn(thread, *args, **kwargs)`` in N simulated threads, one
    per block of ``world_size / N`` ranks: for send/recv and pipelines (``shardviz.p2p``).
    """
    if (
        memory is not False
        and memory is not None
        and (threads is not None or backends.current().name != "local")
    ):
        raise NotImplementedError(
            "sv.run(..., memory=...) counts live storage in the simulator's single-thread runs only; "
            "for threads=N or a real backend, drop memory= (sv.model_map(model, optimizer=opt) gives "
            "what each rank holds at rest), or record the same code with sv.use('local') and "
            "sv.record(memory=True)"
        )
    if threads is not None:
        from .p2p import run as run_threads

        return run_threads(fn, *args, threads=threads, values=values, **kwargs)
    if not callable(fn):
        raise TypeError(f"sv.run needs a callable, got {type(fn).__name__}")
    backend = backends.current()
    if backend.name != "local":
        return backend.run(fn, args, kwargs, values=values)  # type: ignore[attr-defined]
    with record(values, memory=memory) as trace:
        result = fn(*args, **kwargs)
        trace.results = split_per_rank(result, range(backend.world_size))
    return trace


def per_rank(fn: Callable[[int], Any]) -> Any:
    """A tensor whose value on each rank is ``fn(rank)``: for rank-dependent code.

    In the simulator Python cannot branch or index on ``dist.get_rank()`` (0 on every rank on
    torch 2.13; from 2.14 a per-rank value that ``int()`` and list indexing refuse), so
    ``x.chunk(n)[dist.get_rank()]`` does not give each rank its chunk;
    ``sv.per_rank(lambda r: x.chunk(n)[r])`` does. ``fn`` runs once per rank on plain tensors.
    """
    if not callable(fn):
        raise TypeError(f"sv.per_rank needs a callable taking the rank, got {type(fn).__name__}")
    backend = backends.current()
    if backend.name != "local":
        return backend.per_rank(fn)  # type: ignore[attr-defined]
    values = {}
    with _torch.no_dispatch():
        for r in range(backend.world_size):
            v = fn(r)
            if not isinstance(v, torch.Tensor):
                raise TypeError(
                    f"sv.per_rank: fn({r}) returned a {type(v).__name__}; it must return a tensor per rank"
                )
            if _torch.is_local_tensor(v) or _torch.is_dtensor(v):
                raise TypeError(
                    f"sv.per_rank: fn({r}) returned a {type(v).__name__}; return one rank's plain tensor "
                    "(fn runs once per rank)"
                )
            values[r] = v.detach().clone()
    out = _torch.new_local_tensor(values)
    made(out)  # counted by any recording that counts memory
    return out


@contextlib.contextmanager
def record_rank(
    rank: int,
    world_size: int,
    values: str | int = DEFAULT_VALUE_BUDGET,
    on_collective: Callable[..., None] | None = None,
) -> Iterator[Trace]:
    """Record what one real process communicates: its own buffers and its own groups.

    Used on each rank of a real backend; the client merges the ranks' traces into one.
    ``on_collective`` is the Recorder's hook, called before and after each collective.
    """
    ValueBudget(values)
    trace = Trace(world_size, "rank", values)
    recorder = Recorder(trace, world_size, values, rank=rank, on_collective=on_collective)
    try:
        with recorder:
            yield trace
    except BaseException:
        trace.complete = False
        raise
    finally:
        recorder.finish()
