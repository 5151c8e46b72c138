"""The backend interface: what ``sv.run``, ``sv.per_rank``, ``%%spmd``, ``sv.restart`` and
``sv.show`` ask of wherever the ranks are, plus the messages shared by the backends that refuse
something only the simulator can do."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from ..data.trace import DEFAULT_VALUE_BUDGET, Trace
from ..errors import BackendError


class Backend(Protocol):
    """Where SPMD code runs: simulated ranks in this process, or real ranks elsewhere."""

    name: str
    world_size: int
    simulated: bool
    """True when the ranks are simulated in this process (``LocalTensorMode``): a ``with``
    block, threads and memory counting can then run on them; real ranks are other processes."""

    def key(self) -> tuple[Any, ...]:
        """Arguments that identify this backend; ``use()`` with the same key is a no-op."""
        ...

    def device_type(self) -> str: ...

    def close(self) -> None:
        """Release what the backend started (process groups, engines)."""
        ...

    def restart(self) -> Backend:
        """Rebuild (new process group; real backends: new engines for dead ranks); returns the
        backend to use from now on, which may be this one rebuilt in place."""
        ...

    def record(self, values: str | int, memory: Any) -> AbstractContextManager[Trace]:
        """``sv.record()``: run the ``with`` body on every rank, recorded."""
        ...

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        values: str | int = DEFAULT_VALUE_BUDGET,
        threads: int | None = None,
        memory: Any = False,
    ) -> Trace:
        """``sv.run``: ``fn(*args, **kwargs)`` on every rank, recorded; ``trace.results[rank]``."""
        ...

    def per_rank(self, fn: Callable[[int], Any]) -> Any:
        """``sv.per_rank``: a tensor that is ``fn(rank)`` on every rank."""
        ...

    def run_cell(self, cell: str, shell: Any, values: str | int | None = None) -> Any:
        """A ``%%spmd`` cell on every rank, recorded; returns the cell's value."""
        ...

    def show(self, obj: Any, **options: Any) -> Any:
        """``sv.show``: the view of ``obj`` (a rank inside a cell sends its part to the notebook)."""
        ...


def check_world_size(world_size: object) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, not {world_size!r}")
    return world_size


def counts_memory(memory: Any) -> bool:
    return memory is not False and memory is not None


MEMORY_REFUSED = (
    "sv.run(..., memory=...) counts live storage in the simulator's single-thread runs only; "
    "for threads=N or a real backend, drop memory= (sv.model_map(model, optimizer=opt) gives "
    "what each rank holds at rest), or record the same code with sv.use('local') and "
    "sv.record(memory=True)"
)


def refuse_record(name: str) -> BackendError:
    return BackendError(
        f"record() runs code in this process, which the {name!r} backend cannot do; use "
        "sv.run(fn) or a %%spmd cell, or switch back with sv.use('local')"
    )


def refuse_simulation_options(name: str, values: str | int, threads: int | None, memory: Any) -> None:
    """``sv.run``'s options that only simulated ranks honour, refused on real ranks with the way out."""
    if counts_memory(memory):
        raise NotImplementedError(MEMORY_REFUSED)
    if threads is not None:
        from ..capture.recorder import ValueBudget

        ValueBudget(values)
        raise BackendError(
            f"sv.run(fn, threads=N) simulates ranks in this process; on the {name!r} backend "
            "every rank is a real process already: call sv.run(fn) and branch on dist.get_rank()"
        )


def rank_tensor(fn: Callable[[int], Any], rank: int) -> torch.Tensor:
    """``fn(rank)`` for ``sv.per_rank``, which must be a tensor."""
    v = fn(rank)
    if not isinstance(v, torch.Tensor):
        raise TypeError(
            f"sv.per_rank: fn({rank}) returned a {type(v).__name__}; it must return a tensor per rank"
        )
    return v
