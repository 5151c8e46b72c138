"""The threads backend itself: a run on every rank's thread, recorded and merged into one trace
(``merge.merge`` for SPMD code, else ``interleave`` by where the ranks met)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist

from ...capture import threadpg
from ...capture import torch as _torch
from ...capture.recorder import ValueBudget, split_per_rank
from ...data.events import ComputeEvent
from ...data.interleave import Link, Message, interleave
from ...data.merge import SequenceMismatchError, check_sequences, merge
from ...data.trace import DEFAULT_VALUE_BUDGET, Trace
from ...errors import BackendError
from .. import session
from ..base import check_world_size, counts_memory, rank_tensor
from .names import Borrower, RankNamespace
from .output import RankStreams, Shown, cell_value, draw_shows, swap_markers
from .recorder import RankRecorder

NAME = "threads"


class ThreadsBackend:
    """N ranks simulated in this process, each in its own thread (``shardviz.threadpg``)."""

    name = NAME
    simulated = False

    def __init__(self, world_size: int = 4) -> None:
        self.world_size = check_world_size(world_size)
        self.pool = threadpg.RankThreads(self.world_size)
        self.namespaces = [RankNamespace(r) for r in range(self.world_size)]
        self.known_meshes: list[dict[str, Any]] = []
        self._shows: dict[int, dict[int, Any]] = {}  # show id -> rank -> payload, during a run
        self._show_counts: dict[int, int] = {}
        self._widgets: dict[int, Any] = {}  # show id -> the drawn view, after a run

    def key(self) -> tuple[Any, ...]:
        return (NAME, self.world_size)

    def device_type(self) -> str:
        return "cpu"

    def close(self) -> None:
        self.pool.close()

    def restart(self) -> ThreadsBackend:
        """New rank threads: new process groups, and the ranks' names forgotten."""
        self.close()
        return ThreadsBackend(self.world_size)

    def __repr__(self) -> str:
        return f"ThreadsBackend(world_size={self.world_size})"

    # --- what the front ends ask ---------------------------------------------------------------

    def record(self, values: str | int, memory: Any) -> AbstractContextManager[Trace]:
        raise BackendError(
            "sv.record() runs its body once, in the notebook's thread; under sv.use('threads') every "
            "rank runs the code in a thread of its own, which a with-block cannot do. Put the body in "
            "a function and call sv.run(fn) (each rank calls fn; branch on dist.get_rank()), or use a "
            "%%spmd cell; or switch to the lockstep simulator with sv.use('local')."
        )

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
        """``fn(*args, **kwargs)`` in every rank's thread, each with its own copy of what it reads;
        ``trace.results[rank]`` is what ``fn`` returned there."""
        ValueBudget(values)
        if threads is not None:
            raise BackendError(
                "sv.run(fn, threads=N) is the lockstep simulator's way to send and receive; under "
                "sv.use('threads') every rank already runs in its own thread: call sv.run(fn) and "
                "branch on dist.get_rank()"
            )
        if counts_memory(memory):
            raise NotImplementedError(
                "sv.run(..., memory=...) counts live storage in the lockstep simulator only: record the "
                "same code with sv.use('local') and sv.record(memory=True), or drop memory= "
                "(sv.model_map(model, optimizer=opt) gives what each rank holds at rest)"
            )

        def body(rank: int) -> Any:
            ns = self.namespaces[rank]
            borrow = Borrower(rank, getattr(fn, "__globals__", None), dict(ns))
            f = borrow.function(fn)
            return f(*borrow.value(args), **borrow.value(kwargs))

        values_by_rank, trace = self._run(body, values, "sv.run(fn)")
        trace.results = {
            r: swap_markers(split_per_rank(v, [r])[r], self._widgets)
            for r, v in sorted(values_by_rank.items())
        }
        return trace

    def per_rank(self, fn: Callable[[int], Any]) -> Any:
        """Inside a rank's code: ``fn(rank)`` for this rank."""
        rank = threadpg.current_rank()
        if rank is None:
            raise BackendError(
                "sv.per_rank under sv.use('threads') gives the calling rank its own value, so it runs "
                "inside a rank's code: in sv.run(fn) or a %%spmd cell. Each rank can also compute its "
                "own tensor directly (e.g. x.chunk(n)[dist.get_rank()])."
            )
        return rank_tensor(fn, rank)

    def run_cell(self, cell: str, shell: Any, values: str | int | None = None) -> Any:
        """A ``%%spmd`` cell in every rank's own namespace; returns the cell's value as the other
        backends do (a tensor per rank: a LocalTensor; a value all agree on: that value)."""
        from ..cells import compile_cell, run_compiled

        body, last = compile_cell(cell)
        if body is None and last is None:
            return None
        notebook = getattr(shell, "user_ns", None) or {}
        for ns in self.namespaces:
            ns.attach(notebook)

        def run_on(rank: int) -> Any:
            return run_compiled(body, last, self.namespaces[rank])

        values_by_rank, _ = self._run(
            run_on, DEFAULT_VALUE_BUDGET if values is None else values, "a %%spmd cell"
        )
        return cell_value(values_by_rank, self._widgets)

    def show(self, obj: Any, **options: Any) -> Any:
        """Inside a rank's code: this rank's part, drawn with the others' when the run ends."""
        rank = threadpg.current_rank()
        if rank is None:
            return session.draw(obj, **options)
        from ..rank import show_payload

        payload = show_payload(obj, rank, **options)
        if not isinstance(payload, dict):
            return payload
        sid = self._show_counts.get(rank, 0)
        self._show_counts[rank] = sid + 1
        self._shows.setdefault(sid, {})[rank] = payload
        return Shown(sid)

    # --- a run -----------------------------------------------------------------------------------

    def _run(self, body: Callable[[int], Any], values: str | int, what: str) -> tuple[dict[int, Any], Trace]:
        """``body(rank)`` on every rank, recorded; (each rank's value, the merged trace). ``what``
        runs (``sv.run(fn)``, a cell): the backend may not change meanwhile."""
        ValueBudget(values)
        _torch.settle_stopped_runs()  # a stopped lockstep run's threads, before any rank starts
        share = (
            values // self.world_size if isinstance(values, int) and not isinstance(values, bool) else values
        )
        recorders: dict[int, RankRecorder] = {}
        self._shows, self._show_counts, self._widgets = {}, {}, {}

        def job(rank: int) -> Any:
            trace = Trace(self.world_size, NAME, share)
            rec = recorders[rank] = RankRecorder(trace, self.world_size, share, rank, self.pool)
            try:
                with rec:
                    return body(rank)
            except BaseException:
                trace.complete = False
                raise
            finally:
                rec.finish()

        streams = RankStreams()

        def here() -> RankRecorder:
            rank = threadpg.current_rank()
            assert rank is not None, "a pipeline stage ran outside a rank's thread"
            return recorders[rank]

        hooks = _torch.pipeline_stage_hooks(
            lambda group: dist.get_rank(group),  # each rank's own: a plain int, as on real ranks
            lambda *a: here().compute(*a),
            lambda *a: here().stage_ops(*a),
        )
        try:
            with session.running(what), streams, hooks:
                results = self.pool.run(job)
        except BaseException as e:
            from ...capture.explain import explain_rank_error

            explain_rank_error(e)  # in place: a sharding error, a framework's trap
            streams.replay()
            trace = self._merged(recorders, values, complete=False)
            if trace is not None:
                session.set_last(trace)
            raise
        streams.replay()
        self._widgets = draw_shows(self._shows)
        trace = self._merged(recorders, values, complete=True)
        assert trace is not None
        session.set_last(trace)
        return results, trace

    def _merged(self, recorders: dict[int, RankRecorder], values: str | int, complete: bool) -> Trace | None:
        """One trace from every rank's: ``merge.merge`` for SPMD code, else by where they met."""
        if not recorders:
            return None
        traces = {r: rec.trace for r, rec in sorted(recorders.items())}
        links = {r: rec.links_of_events() for r, rec in recorders.items()}
        known = list(self.known_meshes)
        for rec in recorders.values():
            for shape, names, ranks in getattr(rec, "mesh_infos", ()):
                m = {
                    "mesh_shape": list(shape),
                    "mesh_dim_names": list(names) if names else None,
                    "ranks": list(ranks),
                }
                if m not in known:
                    known.append(m)
        # Messages and pipeline stages differ by rank by nature: they are merged by where they met.
        by_position = not any(
            link.kind in ("send", "recv") for ls in links.values() for link in ls
        ) and not any(isinstance(e, ComputeEvent) for t in traces.values() for e in t.events)
        try:
            if by_position and len(traces) == self.world_size:
                try:
                    check_sequences({r: t.events for r, t in traces.items()})
                    trace = merge(traces, NAME, values, known)
                except SequenceMismatchError:
                    trace = self._interleaved(traces, links, values, known)
            else:
                trace = self._interleaved(traces, links, values, known)
        except Exception:
            if complete:
                raise
            return None  # a failed run's partial traces that do not merge: the error says enough
        if not complete:
            trace.complete = False
        unreceived = [m for m in self.pool.messages if not m.received]
        if unreceived:
            pairs = ", ".join(f"{m.src}->{m.dst}" for m in unreceived)
            trace.notes.append(
                f"sent but never received (no matching recv, or its wait() never called): {pairs}"
            )
        for m in trace.meshes:
            if m not in self.known_meshes:
                self.known_meshes.append(m)
        return trace

    def _interleaved(
        self,
        traces: dict[int, Trace],
        links: dict[int, list[Link]],
        values: str | int,
        known: list[dict[str, Any]],
    ) -> Trace:
        messages = {m.id: Message(m.src, m.dst, m.tag, m.group) for m in self.pool.messages}
        return interleave(traces, links, messages, NAME, values, known)
