"""Running SPMD code and recording it: ``record()``, ``run()``, ``per_rank()``, ``last_trace()``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from . import backends
from .capture.recorder import Recorder, ValueBudget
from .data.trace import DEFAULT_VALUE_BUDGET, Trace

_last: Trace | None = None


def last_trace() -> Trace | None:
    """The trace of the last ``record()`` block, ``run()`` or ``%%spmd`` cell."""
    return _last


def _set_last(trace: Trace) -> None:
    global _last
    _last = trace


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
    even when the body raises; the error keeps its type. Real backends refuse: their ranks are
    other processes, which a ``with`` body in this one cannot run on.
    """
    ValueBudget(values)  # validate before asking the backend anything
    with backends.current().record(values, memory) as trace:
        yield trace


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
    ``memory=`` (local backend, single thread) counts live storage as ``record(memory=)`` does.
    """
    if not callable(fn):
        raise TypeError(f"sv.run needs a callable, got {type(fn).__name__}")
    return backends.current().run(fn, args, kwargs, values=values, threads=threads, memory=memory)


def per_rank(fn: Callable[[int], Any]) -> Any:
    """A tensor whose value on each rank is ``fn(rank)``: for rank-dependent code.

    In the simulator Python cannot branch or index on ``dist.get_rank()`` (a per-rank value that
    ``int()``, list indexing and comparisons the ranks disagree on refuse), so
    ``x.chunk(n)[dist.get_rank()]`` does not give each rank its chunk;
    ``sv.per_rank(lambda r: x.chunk(n)[r])`` does. ``fn`` runs once per rank on plain tensors.
    """
    if not callable(fn):
        raise TypeError(f"sv.per_rank needs a callable taking the rank, got {type(fn).__name__}")
    return backends.current().per_rank(fn)


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
