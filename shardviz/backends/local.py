"""The local backend: N SPMD ranks simulated in this process by LocalTensorMode.

``use()`` only sets up a fake process group of the right size; the dispatch mode is entered by
``record()``/``run()``/``%%spmd`` and left when they finish, so plain torch code in the notebook
stays plain between cells.

What ``sv.record``, ``sv.run``, ``sv.per_rank`` and ``%%spmd`` do in the simulator lives here;
the front ends (``shardviz.record``, ``shardviz.magics``) only pick the current backend. The
capture modules it drives (recorder, storage, p2p) are imported where used, so that importing
the backends stays cheap and free of import cycles.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ..capture import processes
from ..capture import torch as _torch
from ..data.trace import DEFAULT_VALUE_BUDGET, Trace
from ..errors import BackendError, WorldSizeError
from . import capacity, session
from .base import MEMORY_REFUSED, check_world_size, counts_memory, rank_tensor


def outside_simulation_note(world_size: int) -> str:
    return (
        f"shardviz: this collective ran outside the simulation. sv.use('local', world_size={world_size}) "
        f"made a fake process group so that code inside sv.record(), sv.run(fn) or a %%spmd cell runs on "
        f"{world_size} simulated ranks; outside them no rank but this process exists, and the collective "
        f"would give the value of a world of one, which no real world of {world_size} ranks gives. Run it "
        "inside `with sv.record():` (or sv.run / %%spmd), or on real ranks with sv.use('gloo', world_size=N)."
    )


class LocalBackend:
    name = "local"
    simulated = True

    def __init__(self, world_size: int = 4, check_capacity: bool = True, engine: str | None = None) -> None:
        self.world_size = check_world_size(world_size)
        self.check_capacity = check_capacity  # sv.run(fn, threads=N) checks N against the machine
        # "batched": each op once for all ranks on their stacked values; "lockstep": torch's
        # LocalTensorMode, each op once per rank. $SHARDVIZ_ENGINE picks when none is named.
        self.engine = _torch.check_engine(engine) if engine is not None else _torch.default_engine()
        self._owns_pg = False
        self._ensure_pg()
        # One mode for the backend's life: its cache of per-rank mesh coordinates then survives
        # from cell to cell (recomputing them costs ~N^2 small ops: seconds at 256 ranks).
        self._mode = _torch.new_local_mode(self.world_size, self.engine)

    def key(self) -> tuple[Any, ...]:
        # the default engine keeps the key it always had (sv.use with the same arguments is a no-op)
        if self.engine == _torch.DEFAULT_ENGINE:
            return ("local", self.world_size)
        return ("local", self.world_size, ("engine", self.engine))

    def device_type(self) -> str:
        return "cpu"

    def _ensure_pg(self) -> None:
        """Create the fake process group, or adopt a matching one the user already made."""
        if dist.is_initialized():
            backend = dist.get_backend()
            size = dist.get_world_size()
            if backend == "fake" and size == self.world_size:
                return
            if self._owns_pg:
                dist.destroy_process_group()
            else:
                raise BackendError(
                    f"a {backend!r} process group of world size {size} is already initialized; the local "
                    f"backend needs a 'fake' one of size {self.world_size}. Call "
                    "torch.distributed.destroy_process_group() first, or use "
                    f"sv.use('local', world_size={size}) if it is a fake group."
                )
        hook = sys.excepthook
        _torch.guard_fake_groups(outside_simulation_note(self.world_size))
        dist.init_process_group(
            "fake", rank=0, world_size=self.world_size, pg_options=_torch.simulation_world_options()
        )
        # torch tags every later traceback of the process with "[rank0]:": the simulator is every
        # rank at once, and a plain error in the notebook or script is no rank's.
        sys.excepthook = hook
        _torch.forget_dtensor_caches()  # a new world: DTensor's caches hold the old one's meshes
        self._owns_pg = True

    @contextlib.contextmanager
    def simulate(self) -> Iterator[Any]:
        """Enter LocalTensorMode for this world size; always leave it, even on error."""
        _torch.settle_stopped_runs()
        self._ensure_pg()
        _torch.drop_stale_local_mode(self._mode)
        outer = _torch.active_local_mode()
        if outer is not None and outer.ranks != frozenset(range(self.world_size)):
            raise WorldSizeError(
                f"a LocalTensorMode over {len(outer.ranks)} ranks is already active, but the local backend "
                f"simulates {self.world_size}; collectives would silently skip ranks. Leave that mode, or "
                f"call sv.use('local', world_size={len(outer.ranks)})."
            )
        mode = self._mode
        if outer is mode:
            yield mode  # already inside this backend's simulation
            return
        _torch.reuse_local_mode(mode)
        with (
            _torch.tracking_meshes(),
            _torch.fsdp_in_simulation(),
            _torch.ddp_refused(),
            _torch.debug_modes_as_on_real_ranks(),
            _torch.premul_sum_factors(),
            mode,
            _torch.per_rank_values(),  # inside the mode: on top of what it patches
            processes.lockstep(),  # executor tasks run here; threads it starts are guarded
        ):
            yield mode

    def close(self) -> None:
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()
        if self._owns_pg:
            _torch.unguard_fake_groups()
        self._owns_pg = False

    def restart(self) -> LocalBackend:
        """A new simulator of the same size: a new fake process group and a fresh mode."""
        self.close()
        return LocalBackend(self.world_size, self.check_capacity, self.engine)

    @contextlib.contextmanager
    def record(self, values: str | int = DEFAULT_VALUE_BUDGET, memory: Any = False) -> Iterator[Trace]:
        """Run the body as SPMD ranks and record it (``sv.record``). The trace's events are filled
        in when the block ends; no dispatch mode outlives it, and an error keeps its type."""
        from ..capture.explain import explain_simulation_error
        from ..capture.recorder import Recorder, ValueBudget
        from ..capture.storage import MemoryRecorder

        ValueBudget(values)  # validate before entering anything
        trace = Trace(self.world_size, "local", values)
        if counts_memory(memory):
            recorder: Recorder = MemoryRecorder(trace, self.world_size, values, memory=memory)
        else:
            recorder = Recorder(trace, self.world_size, values)
        try:
            with session.running("sv.record()"), self.simulate(), recorder:
                yield trace
        except BaseException as e:
            trace.complete = False
            explain_simulation_error(e, self.world_size)  # in place: same object, type and cause
            raise
        finally:
            recorder.finish()
            session.set_last(trace)

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
        """``fn`` on every simulated rank at once, or in ``threads`` simulated threads (send/recv,
        pipelines: ``shardviz.p2p``); memory is counted in single-thread runs only."""
        if threads is not None:
            if counts_memory(memory):
                raise NotImplementedError(MEMORY_REFUSED)
            from ..capture.p2p import live_ranks, run_threads

            live_ranks(self.world_size, threads)  # a bad threads= is refused before anything else
            if self.check_capacity:
                capacity.check(
                    f"sv.run(fn, threads={threads:,})",
                    threads,
                    threads * self.world_size,  # each thread simulates the whole world
                    "Use fewer threads (a divisor of the world size, e.g. the pipeline size)",
                    f"call sv.use('local', world_size={self.world_size}, {capacity.OVERRIDE}) first",
                )
            self._ensure_pg()
            trace = Trace(self.world_size, "local", values)
            with session.running(f"sv.run(fn, threads={threads})"):
                run_threads(trace, fn, args, kwargs, threads=threads, done=session.set_last)
            return trace
        from ..capture.recorder import split_per_rank

        with session.running("sv.run(fn)"), self.record(values, memory=memory) as trace:
            result = fn(*args, **kwargs)
            trace.results = split_per_rank(result, range(self.world_size))
        return trace

    def per_rank(self, fn: Callable[[int], Any]) -> Any:
        """A LocalTensor whose rank ``r`` holds ``fn(r)``; ``fn`` runs once per rank on plain tensors."""
        from ..capture.storage import made

        values = {}
        with _torch.no_dispatch():
            for r in range(self.world_size):
                v = rank_tensor(fn, r)
                if _torch.is_local_tensor(v) or _torch.is_dtensor(v):
                    raise TypeError(
                        f"sv.per_rank: fn({r}) returned a {type(v).__name__}; return one rank's plain "
                        "tensor (fn runs once per rank)"
                    )
                values[r] = v.detach().clone()
        out = _torch.new_local_tensor(values)
        made(out)  # counted by any recording that counts memory
        return out

    def run_cell(self, cell: str, shell: Any, values: str | int | None = None) -> Any:
        """A ``%%spmd`` cell in the notebook's namespace, recorded; names it defines stay there."""
        from .cells import compile_cell, run_compiled

        body, last = compile_cell(cell)
        ns = shell.user_ns
        with (
            session.running("a %%spmd cell"),
            self.record(DEFAULT_VALUE_BUDGET if values is None else values),
        ):
            return run_compiled(body, last, ns)

    def show(self, obj: Any, **options: Any) -> Any:
        return session.draw(obj, **options)

    def __repr__(self) -> str:
        return f"LocalBackend(world_size={self.world_size}, engine={self.engine!r})"


class AttachedBackend(LocalBackend):
    """A simulation someone else set up: the LocalTensorMode a user or a test harness (torch's
    ``create_local_tensor_test_class``) entered, on the process group they made. ``sv.record``,
    ``sv.run``, ``sv.per_rank`` and ``%%spmd`` inside it record there; nothing is initialised, entered
    for good or torn down, so the harness finds its mode and process group as it left them."""

    name = "local"

    def __init__(self, mode: Any) -> None:
        ranks = frozenset(mode.ranks)
        self.world_size = len(ranks)
        if ranks != frozenset(range(self.world_size)):
            raise WorldSizeError(
                f"the active LocalTensorMode simulates ranks {sorted(ranks)}; shardviz records a "
                f"simulation of ranks 0..N-1 only. Enter LocalTensorMode({self.world_size}) instead."
            )
        self._owns_pg = False
        self._mode = mode
        self.check_capacity = True

    def key(self) -> tuple[Any, ...]:
        return ("attached", id(self._mode))

    def _ensure_pg(self) -> None:
        """Check, never create: the process group is the harness's."""
        if dist.is_initialized() and dist.get_world_size() != self.world_size:
            raise WorldSizeError(
                f"the active LocalTensorMode simulates {self.world_size} ranks, but the default process "
                f"group has {dist.get_world_size()}: collectives would silently skip ranks. Make both "
                "the same size."
            )

    @contextlib.contextmanager
    def simulate(self) -> Iterator[Any]:
        """The mode is already active: only shardviz's own fixes to the simulation (per-rank ranks,
        FSDP2 per rank, PREMUL_SUM factors, meshes kept) are put in place, and taken out after."""
        _torch.settle_stopped_runs()
        from ..capture.recorder import Recorder

        self._ensure_pg()
        if _torch.active_local_mode() is not self._mode:
            raise BackendError("the LocalTensorMode this recording attached to is no longer active")
        # A passive recording of the whole test (pytest --shardviz-traces) steps aside meanwhile:
        # DTensor reports a redistribute to one recorder only, and a collective this one does
        # itself never reaches the one below it, so two at once would each get half the story.
        stack = _torch.dispatch_mode_stack()
        paused = stack[-1] if stack and isinstance(stack[-1], Recorder) and stack[-1].passive else None
        if paused is not None:
            paused.__exit__(None, None, None)
        try:
            with (
                _torch.tracking_meshes(),
                _torch.fsdp_in_simulation(),
                _torch.ddp_refused(),
                _torch.debug_modes_as_on_real_ranks(),
                _torch.premul_sum_factors(),
                _torch.per_rank_values(),
                processes.lockstep(),
            ):
                yield self._mode
        finally:
            if paused is not None:
                paused.__enter__()

    def close(self) -> None:
        """Nothing to close: the mode and the process group are the harness's."""

    def restart(self) -> LocalBackend:
        raise BackendError(
            "sv.restart() inside a LocalTensorMode shardviz did not enter (a test harness's, say): "
            "the mode and its process group belong to whoever entered them; leave the mode first"
        )

    def __repr__(self) -> str:
        return f"AttachedBackend(world_size={self.world_size})"
