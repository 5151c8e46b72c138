"""The Backend installed inside a rank's own process, so that ``sv.*`` in a ``%%spmd`` cell means
what it means in the simulator."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from ...data.trace import DEFAULT_VALUE_BUDGET, Trace
from ...errors import BackendError
from .. import session
from ..base import rank_tensor, refuse_record, refuse_simulation_options
from . import state
from .shows import gather_show


class RankBackend:
    """shardviz's backend inside a rank's own process: code runs here directly, on this rank.

    Installed on the engine by ``setup`` (and by ``sv.record_job`` in a launched job) so that
    ``sv.device_type()``, ``sv.per_rank`` and ``sv.show`` in a ``%%spmd`` cell mean the same as in
    the simulator. What only the notebook can do (run cells, restart the ranks) is refused.
    """

    simulated = False

    def __init__(self, name: str, world_size: int, rank: int) -> None:
        self.name = name
        self.world_size = world_size
        self.rank = rank

    def key(self) -> tuple[Any, ...]:
        return (self.name, self.world_size)

    def device_type(self) -> str:
        return "cuda" if self.name == "nccl" else "cpu"

    def close(self) -> None:
        """The client owns the process group; nothing to release from inside a cell."""

    def restart(self) -> RankBackend:
        raise BackendError(
            "sv.restart() rebuilds the ranks from the notebook that started them; on a rank (a %%spmd "
            "cell, sv.record_job) there is nothing to restart"
        )

    def record(self, values: str | int, memory: Any) -> AbstractContextManager[Trace]:
        raise refuse_record(self.name)

    def per_rank(self, fn: Callable[[int], Any]) -> Any:
        return rank_tensor(fn, self.rank)

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
        refuse_simulation_options(self.name, values, threads, memory)
        raise BackendError(
            "sv.run inside a %%spmd cell: the cell already runs on every rank and is recorded; "
            "call the function directly"
        )

    def run_cell(self, cell: str, shell: Any, values: str | int | None = None) -> Any:
        raise BackendError("%%spmd cells are sent to the ranks from the notebook, not run on a rank")

    def show(self, obj: Any, **options: Any) -> Any:
        """While a cell or ``sv.run`` function runs here: keep this rank's part for the client,
        which draws every rank's together; otherwise (``%px``, ``sv.record_job``) draw here."""
        st = state.current
        if st is not None and st.running:
            return gather_show(obj, **options)
        return session.draw(obj, **options)

    def __repr__(self) -> str:
        return f"RankBackend({self.name!r}, rank={self.rank}, world_size={self.world_size})"
