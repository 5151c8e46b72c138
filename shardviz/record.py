"""Running SPMD code and recording it: ``record()``, ``run()``, ``per_rank()``, ``last_trace()``,
and ``record_job()`` for each rank of a real job."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .backends import session
from .backends.choose import current
from .capture.job import ENV_DIR, JobRecording, backend_name
from .capture.recorder import ValueBudget
from .data.trace import DEFAULT_VALUE_BUDGET, Trace


def last_trace() -> Trace | None:
    """The trace of the last ``record()`` block, ``run()`` or ``%%spmd`` cell."""
    return session.last_trace()


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
    with current().record(values, memory) as trace:
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
    return current().run(fn, args, kwargs, values=values, threads=threads, memory=memory)


def per_rank(fn: Callable[[int], Any]) -> Any:
    """A tensor whose value on each rank is ``fn(rank)``: for rank-dependent code.

    In the simulator Python cannot branch or index on ``dist.get_rank()`` (a per-rank value that
    ``int()``, list indexing and comparisons the ranks disagree on refuse), so
    ``x.chunk(n)[dist.get_rank()]`` does not give each rank its chunk;
    ``sv.per_rank(lambda r: x.chunk(n)[r])`` does. ``fn`` runs once per rank on plain tensors.
    """
    if not callable(fn):
        raise TypeError(f"sv.per_rank needs a callable taking the rank, got {type(fn).__name__}")
    return current().per_rank(fn)


def record_job(
    path: str | Path | None = None,
    *,
    values: str | int = DEFAULT_VALUE_BUDGET,
    flush_every: float = 1.0,
    signals: bool = True,
) -> JobRecording:
    """Record this rank of a real job (torchrun, Slurm, ...) into ``path/rankNNNNN.svtrace``.

    ``with sv.record_job("traces/run1"): train()`` — or ``sv.record_job()`` alone, which records
    from here to the end of the process. With no ``path`` the folder is ``$SHARDVIZ_TRACE_DIR``;
    when that is unset too, nothing is recorded (so the line can stay in a script). ``values`` is
    the value policy of ``sv.record`` (``"all"``, ``"none"`` or a byte budget per rank). The file is
    rewritten while the rank runs (at most every ``flush_every`` seconds) and when it ends — also on
    an exception, SIGTERM (``signals=False`` leaves SIGTERM alone) or exit — so a rank that died or
    hung leaves how far it got. Open the folder with ``sv.load(folder)``.
    """
    folder = path if path is not None else os.environ.get(ENV_DIR) or None
    job = JobRecording(folder, values=values, flush_every=flush_every, signals=signals, around=_as_rank)
    return job.start()


@contextlib.contextmanager
def _as_rank(job: JobRecording) -> Iterator[None]:
    """``sv.per_rank`` and ``sv.device_type`` inside the job mean this rank, as in a ``%%spmd``
    cell on a real backend (the code's own ``dist`` calls need nothing from shardviz)."""
    from .backends.rank import RankBackend

    backend = RankBackend(backend_name(), job.world_size, job.rank)
    previous = session.install(backend)
    try:
        yield
    finally:
        if session.peek() is backend:
            session.install(previous)
