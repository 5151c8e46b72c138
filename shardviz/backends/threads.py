"""The threads backend (``sv.use("threads", world_size=N)``): one thread per rank.

Each rank runs the user's code in its own thread, with plain tensors and plain ints
(``shardviz.threadpg``), so Python that branches or indexes on the rank runs as written. Each rank
records itself with the Recorder real ranks use (``Recorder(rank=r)``), so a rank's trace is what
a gloo rank would record; the ranks' traces are merged with ``merge.merge`` when the ranks ran
the same sequence (SPMD code), else by where they met (``shardviz.interleave``).

Like on a real backend, each rank has its own names: a ``%%spmd`` cell runs in the rank's own
namespace, kept from cell to cell, and what a rank reads from the notebook (a tensor, a module,
a list) is copied for it on first use, so that one rank's changes never reach another (modules,
classes, functions and constants are shared as they are). ``sv.run(fn)`` gives each rank its own
copy of what ``fn`` reads the same way. A ``with sv.record():`` body runs once, in the notebook's
thread, which cannot be every rank: it is refused, with ``sv.run(fn)`` and ``%%spmd`` as the way.

``simulated`` is False: the ranks are not LocalTensorMode's, so memory counting and
``threads=`` are refused, and ``sv.compare`` / ``%%spmd --compare`` run the lockstep simulator next
to this backend, as next to a real one.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import enum
import io
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..capture import threadpg
from ..capture import torch as _torch
from ..capture.recorder import Recorder, ValueBudget, split_per_rank
from ..capture.recorder.snapshot import flatten, nbytes
from ..capture.recorder.specs import params
from ..data.events import CollectiveEvent, ComputeEvent
from ..data.interleave import Link, Message, interleave
from ..data.merge import SequenceMismatchError, check_sequences, merge
from ..data.trace import DEFAULT_VALUE_BUDGET, Trace
from ..errors import BackendError
from . import session
from .base import check_world_size, counts_memory, rank_tensor

NAME = "threads"
_COMPUTE_NAMES = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward_weight",
}
_OPS_PHASE = {
    "get_fwd_send_ops": "forward",
    "get_fwd_recv_ops": "forward",
    "get_bwd_send_ops": "backward",
    "get_bwd_recv_ops": "backward",
}


class ThreadsBackend:
    """N ranks simulated in this process, each in its own thread (``shardviz.threadpg``)."""

    name = NAME
    simulated = False

    def __init__(self, world_size: int = 4) -> None:
        self.world_size = check_world_size(world_size)
        self.pool = threadpg.RankThreads(self.world_size)
        self.namespaces = [_RankNamespace(r) for r in range(self.world_size)]
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
            borrow = _Borrower(rank, getattr(fn, "__globals__", None), dict(ns))
            f = borrow.function(fn)
            return f(*borrow.value(args), **borrow.value(kwargs))

        values_by_rank, trace = self._run(body, values)
        trace.results = {
            r: _swap_markers(split_per_rank(v, [r])[r], self._widgets)
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
        from .cells import compile_cell, run_compiled

        body, last = compile_cell(cell)
        if body is None and last is None:
            return None
        notebook = getattr(shell, "user_ns", None) or {}
        for ns in self.namespaces:
            ns.attach(notebook)

        def run_on(rank: int) -> Any:
            return run_compiled(body, last, self.namespaces[rank])

        values_by_rank, _ = self._run(run_on, DEFAULT_VALUE_BUDGET if values is None else values)
        return _cell_value(values_by_rank, self._widgets)

    def show(self, obj: Any, **options: Any) -> Any:
        """Inside a rank's code: this rank's part, drawn with the others' when the run ends."""
        rank = threadpg.current_rank()
        if rank is None:
            return session.draw(obj, **options)
        from .rank import show_payload

        payload = show_payload(obj, rank, **options)
        if not isinstance(payload, dict):
            return payload
        sid = self._show_counts.get(rank, 0)
        self._show_counts[rank] = sid + 1
        self._shows.setdefault(sid, {})[rank] = payload
        return _Shown(sid)

    # --- a run -----------------------------------------------------------------------------------

    def _run(self, body: Callable[[int], Any], values: str | int) -> tuple[dict[int, Any], Trace]:
        """``body(rank)`` on every rank, recorded; (each rank's value, the merged trace)."""
        ValueBudget(values)
        share = (
            values // self.world_size if isinstance(values, int) and not isinstance(values, bool) else values
        )
        recorders: dict[int, _RankRecorder] = {}
        self._shows, self._show_counts, self._widgets = {}, {}, {}

        def job(rank: int) -> Any:
            trace = Trace(self.world_size, NAME, share)
            rec = recorders[rank] = _RankRecorder(trace, self.world_size, share, rank, self.pool)
            try:
                with rec:
                    return body(rank)
            except BaseException:
                trace.complete = False
                raise
            finally:
                rec.finish()

        streams = _RankStreams()

        def here() -> _RankRecorder:
            rank = threadpg.current_rank()
            assert rank is not None, "a pipeline stage ran outside a rank's thread"
            return recorders[rank]

        hooks = _torch.pipeline_stage_hooks(
            lambda group: dist.get_rank(group),  # each rank's own: a plain int, as on real ranks
            lambda *a: here().compute(*a),
            lambda *a: here().stage_ops(*a),
        )
        try:
            with streams, hooks:
                results = self.pool.run(job)
        except BaseException as e:
            from ..capture.explain import explain_rank_error

            explain_rank_error(e)  # in place: a sharding error, a framework's trap
            streams.replay()
            trace = self._merged(recorders, values, complete=False)
            if trace is not None:
                session.set_last(trace)
            raise
        streams.replay()
        self._widgets = _draw_shows(self._shows)
        trace = self._merged(recorders, values, complete=True)
        assert trace is not None
        session.set_last(trace)
        return results, trace

    def _merged(self, recorders: dict[int, _RankRecorder], values: str | int, complete: bool) -> Trace | None:
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


# --- recording a rank ----------------------------------------------------------------------------


class _RankRecorder(Recorder):
    """A rank's own recorder (as on a real rank) in a process where other ranks record too: it
    ignores the other threads' calls that reach every recorder (module hooks, ``to_local``), stamps
    each event with the run's clock, notes which meeting or message each collective was, and
    records a receive when its data arrives (``irecv(...).wait()``), not when it is posted."""

    def __init__(
        self, trace: Trace, world_size: int, values: str | int, rank: int, pool: threadpg.RankThreads
    ) -> None:
        super().__init__(trace, world_size, values, rank=rank)
        self.pool = pool
        self.ident = threading.get_ident()
        self.keys: dict[int, int] = {}  # provisional event id -> the run's clock (ordering key)
        self.links: dict[int, tuple[str, int]] = {}
        self.pipeline: dict[int, dict[str, Any]] = {}  # event -> its pipeline label (a p2p event)
        self.labels: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(tensor) -> (tensor, label)
        self._computes: list[int] = []
        self._last = -1
        ms = self.modules
        for name in ("_enter_forward", "_leave_forward"):
            setattr(ms, name, self._only_mine(getattr(ms, name)))

    def _only_mine(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def only_mine(*a: Any) -> Any:
            return hook(*a) if threading.get_ident() == self.ident else None

        return only_mine

    def __enter__(self) -> _RankRecorder:
        super().__enter__()
        mode = threadpg.current_mode()
        if mode is not None:
            mode.on_meeting = self._linked
        return self

    def __exit__(self, *exc: object) -> None:
        mode = threadpg.current_mode()
        if mode is not None:
            mode.on_meeting = None
            mode.on_recv = None
        super().__exit__(*exc)

    def _reserve(self) -> int:
        eid = super()._reserve()
        self.keys[eid] = self.pool.tick()
        self._last = eid
        return eid

    def _linked(self, kind: str, ident: int, stamp: int, tensor: int | None) -> None:
        self.links[self._last] = (kind, ident)
        self.keys[self._last] = stamp
        if tensor is not None and tensor in self.labels:
            self.pipeline[self._last] = dict(self.labels[tensor][1])

    # --- pipeline stages (torch.distributed.pipelining), through _torch.pipeline_stage_hooks ---

    def _parent(self, in_dispatch: bool) -> int | None:
        parent = super()._parent(in_dispatch)
        return parent if parent is not None or not self._computes else self._computes[-1]

    @contextlib.contextmanager
    def compute(self, stage: int, method: str, chunk: int) -> Iterator[None]:
        """A stage's forward or backward of one microbatch: an event whose children are what it
        communicates (its tensor-parallel collectives)."""
        eid = self._reserve()
        source, _, _, _ = self._context()
        name = _COMPUTE_NAMES.get(method, method)
        assert self.rank is not None
        self._slots[eid] = ComputeEvent(
            id=eid,
            parent=self._parent(False),
            source=source,
            phase="backward" if name.startswith("backward") else "forward",
            name=name,
            ranks=(self.rank,),
            stage=stage,
            microbatch=chunk,
        )
        self._computes.append(eid)
        try:
            yield
        finally:
            self._computes.pop()

    def stage_ops(self, stage: int, method: str, chunk: int, tensors: list[Any]) -> None:
        """The tensors a stage is about to send or receive: their messages are pipeline traffic."""
        label = {"stage": stage, "microbatch": chunk, "phase": _OPS_PHASE.get(method, method)}
        for x in tensors:
            self.labels[id(x)] = (x, label)  # the tensor is kept: its id stays its own

    def _on_to_local(self, dt: Any, out: Any, caller: Any) -> None:
        if threading.get_ident() == self.ident:
            super()._on_to_local(dt, out, caller)

    def _on_from_local(self, out: Any, caller: Any) -> None:
        if threading.get_ident() == self.ident:
            super()._on_from_local(out, caller)

    def _collective(self, entry: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        if entry[0].op == "recv":
            return self._recv_later(entry, func, args, kwargs)
        return super()._collective(entry, func, args, kwargs)

    def _recv_later(self, entry: Any, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """A receive: its event is made when its data is in the buffer (the Work's ``wait()``)."""
        spec, impl, names = entry
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        eid = self._reserve()
        parent: int | None
        if self._stack:
            top = self._stack[-1]
            parent, source, module, phase = top.id, top.source, top.module, top.phase
        else:
            source, module, phase, in_dispatch = self._context()
            parent = self._parent(in_dispatch)
        group = bound.get(spec.group)
        gkey = _torch.process_group_key(group)
        groups = (tuple(_torch.process_group_ranks(group)),)
        out_arg = bound[spec.outputs]
        (buf,) = out_arg
        if self.snaps.aliases:
            self.snaps.unalias(flatten(out_arg))  # the receive writes it
        rank = self.rank
        assert rank is not None

        def received(msg: threadpg.Message) -> None:
            with _torch.no_dispatch():
                outputs = self.snaps.take(out_arg, [rank], eid)
            event = CollectiveEvent(
                id=eid,
                parent=parent,
                source=source,
                module=module,
                phase=phase,
                op=spec.op,
                impl=impl,
                groups=groups,
                root=int(bound["src"]),
                inputs={},
                outputs=outputs,
                nbytes=nbytes([], [rank]),
                params=params(bound, spec),
            )
            if parent is not None:
                self._has_children.add(parent)
            self._slots[eid] = event
            self._group_desc[id(event)] = self._desc(gkey, group)
            self.links[eid] = ("recv", msg.id)
            self.keys[eid] = msg.stamp
            if id(buf) in self.labels:
                self.pipeline[eid] = dict(self.labels[id(buf)][1])

        mode = threadpg.current_mode()
        if mode is not None:
            mode.on_recv = received
        return func(*args, **kwargs)

    def finish(self) -> None:
        super().finish()
        # The meshes alive now, in the rank's thread (a sub-mesh's root among them): they name the
        # mesh dims of the merged trace's collectives, as the lockstep simulator's recorder does.
        self.mesh_infos = _torch.known_mesh_infos()

    def links_of_events(self) -> list[Link]:
        """Each event of the finished trace's ``Link``, in trace order."""
        by_event: dict[int, Link] = {}
        for eid, slot in enumerate(self._slots):
            if slot is not None:
                kind, ident = self.links.get(eid, (None, None))
                by_event[id(slot)] = Link(self.keys.get(eid, 0), kind, ident, self.pipeline.get(eid))
        return [by_event.get(id(e), Link(0)) for e in self.trace.events]


# --- each rank's names -----------------------------------------------------------------------------


class _RankNamespace(dict[str, Any]):
    """A rank's names in ``%%spmd`` cells: its own, then the notebook's, each copied for the rank on
    first use (a name missing here is looked up through ``__missing__``: Python does that for
    globals that are not a plain dict). A copy is made again when the notebook rebinds the name."""

    def __init__(self, rank: int) -> None:
        super().__init__(__builtins__=builtins)
        self.rank = rank
        self.notebook: dict[str, Any] = {}
        self.borrowed: dict[str, tuple[Any, Any]] = {}  # name -> (the notebook's object, the copy)
        self.borrower: _Borrower | None = None  # this run's copies

    def attach(self, notebook: dict[str, Any]) -> None:
        """Before a cell: drop copies of names the notebook has since rebound."""
        self.notebook = notebook
        self.borrower = None
        for name, (original, mine) in list(self.borrowed.items()):
            if notebook.get(name, _MISSING) is not original or self.get(name, _MISSING) is not mine:
                del self.borrowed[name]
                if self.get(name, _MISSING) is mine:
                    del self[name]

    def __missing__(self, name: str) -> Any:
        if name.startswith("__") or name in _IPYTHON_NAMES or name not in self.notebook:
            raise KeyError(name)
        original = self.notebook[name]
        if self.borrower is None:
            self.borrower = _Borrower(self.rank, self.notebook, self)
        mine = self.borrower.value(original)
        self[name] = mine
        self.borrowed[name] = (original, mine)
        return mine


_MISSING = object()
_IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit", "_", "__", "___"})
_SHARED = (
    types.ModuleType,
    type,
    types.BuiltinFunctionType,
    types.BuiltinMethodType,
    types.MethodWrapperType,
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    range,
    torch.dtype,
    torch.device,
    enum.Enum,
)


class _Borrower:
    """Copies of what one rank's code reads from a namespace it shares with the notebook: its own
    tensors, modules and containers (one copy per object per run: shared references stay shared
    within the rank), and functions rebound to read through the rank's namespace."""

    def __init__(self, rank: int, source: dict[str, Any] | None, ns: dict[str, Any]) -> None:
        self.rank = rank
        self.source = source
        self.ns = ns if isinstance(ns, _RankNamespace) else self._namespace(ns)
        self.memo: dict[int, Any] = {}

    def _namespace(self, own: dict[str, Any]) -> _RankNamespace:
        ns = _RankNamespace(self.rank)
        ns.update(own)
        ns.notebook = self.source if self.source is not None else {}
        ns.borrower = self
        return ns

    def function(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.value(fn)

    def value(self, v: Any) -> Any:
        if isinstance(v, _SHARED):
            return v
        hit = self.memo.get(id(v))
        if hit is not None:
            return hit
        out = self._copy(v)
        self.memo[id(v)] = out
        return out

    def _copy(self, v: Any) -> Any:
        if isinstance(v, types.FunctionType):
            if self.source is not None and v.__globals__ is self.source:
                return self._rebound(v)
            return v
        if _torch.is_local_tensor(v):
            with _torch.no_dispatch():
                return split_per_rank(v, [self.rank])[self.rank]
        if _torch.is_dtensor(v):
            raise BackendError(
                "a DTensor made outside the rank threads (by the lockstep simulator, or in the notebook) "
                "cannot be used on a rank under sv.use('threads'): its mesh belongs to another process "
                "group. Make it inside sv.run(fn) or a %%spmd cell."
            )
        if isinstance(v, torch.Tensor):
            if v.is_leaf:
                return copy.deepcopy(v)  # a Parameter stays one, requires_grad is kept
            return v.detach().clone().requires_grad_(v.requires_grad)
        if isinstance(v, list):
            return [self.value(x) for x in v]
        if isinstance(v, tuple) and not hasattr(v, "_fields"):
            return tuple(self.value(x) for x in v)
        if isinstance(v, dict) and type(v) is dict:
            return {k: self.value(x) for k, x in v.items()}
        try:
            return copy.deepcopy(v)
        except Exception:  # a lock, a generator, an open file: not copyable, shared as it is
            return v

    def _rebound(self, f: types.FunctionType) -> types.FunctionType:
        """``f`` reading its globals through the rank's namespace, with its own closure and defaults."""
        closure = None
        if f.__closure__ is not None:
            closure = tuple(
                types.CellType(self.value(c.cell_contents)) if _filled(c) else c for c in f.__closure__
            )
        new = types.FunctionType(f.__code__, self.ns, f.__name__, self.value(f.__defaults__), closure)
        self.memo[id(f)] = new
        new.__kwdefaults__ = self.value(f.__kwdefaults__)
        new.__qualname__ = f.__qualname__
        new.__dict__.update(f.__dict__)
        return new


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


# --- output, shows and values ----------------------------------------------------------------------


class _RankStreams:
    """While a run lasts, what each rank prints is kept apart; afterwards it is written out rank
    by rank, each line tagged ``[rank r]`` (as the real backends show it)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], io.StringIO] = {}
        self.saved: tuple[Any, Any] | None = None

    def __enter__(self) -> _RankStreams:
        self.saved = (sys.stdout, sys.stderr)
        sys.stdout = _RankStream(self, "stdout", sys.stdout)
        sys.stderr = _RankStream(self, "stderr", sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.saved is not None
        sys.stdout, sys.stderr = self.saved

    def replay(self) -> None:
        for (name, rank), buf in sorted(self.buffers.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            text = buf.getvalue()
            if text:
                out = sys.stdout if name == "stdout" else sys.stderr
                out.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        self.buffers.clear()
        sys.stdout.flush()


class _RankStream(io.TextIOBase):
    def __init__(self, owner: _RankStreams, name: str, original: Any) -> None:
        self.owner = owner
        self.name_ = name
        self.original = original

    def write(self, s: str) -> int:
        rank = threadpg.current_rank()
        if rank is None:
            return int(self.original.write(s))
        return self.owner.buffers.setdefault((self.name_, rank), io.StringIO()).write(s)

    def flush(self) -> None:
        if threadpg.current_rank() is None:
            self.original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


@dataclass(frozen=True)
class _Shown:
    """What ``sv.show`` returns on a rank: the run draws every rank's part in its place."""

    id: int

    def __repr__(self) -> str:
        return f"<shardviz show #{self.id}>"


def _draw_shows(shows: dict[int, dict[int, Any]]) -> dict[int, Any]:
    from .cluster import draw_show

    return {sid: draw_show(payloads) for sid, payloads in sorted(shows.items())}


def _swap_markers(value: Any, widgets: dict[int, Any]) -> Any:
    if isinstance(value, _Shown):
        return widgets.get(value.id, value)
    if isinstance(value, list):
        return [_swap_markers(v, widgets) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_swap_markers(v, widgets) for v in value)
    if isinstance(value, dict):
        return {k: _swap_markers(v, widgets) for k, v in value.items()}
    return value


def _cell_value(values: dict[int, Any], widgets: dict[int, Any]) -> Any:
    """A cell's value as the other backends give it: a tensor per rank is a LocalTensor (a DTensor
    its local shards), a value every rank agrees on is that value, others a PerRank dict."""
    from .cluster import PerRank, same_value

    ranks = sorted(values)
    vals = [split_per_rank(values[r], [r])[r] for r in ranks]
    if all(v is None for v in vals):
        return None
    if all(isinstance(v, torch.Tensor) for v in vals):
        return _torch.new_local_tensor(dict(zip(ranks, vals, strict=True)))
    if all(same_value(vals[0], v) for v in vals[1:]):
        return _swap_markers(vals[0], widgets)
    return PerRank({r: _swap_markers(v, widgets) for r, v in zip(ranks, vals, strict=True)})
