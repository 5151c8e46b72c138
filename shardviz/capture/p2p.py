"""Point-to-point and pipelines in the simulator: ``sv.run(fn, *args, threads=N)``.

``sv.record()`` runs every rank in one Python thread, so code cannot branch on the rank and a
``recv`` has nobody to wait for. A threaded run calls ``fn(thread, *args)`` in ``N`` runner threads
(one running at a time): thread ``i`` stands for the ``i``-th contiguous block of ``world_size / N``
ranks (the pipeline coordinate, when ``pp`` is the outermost mesh dim). Each thread simulates the
whole world with its own LocalTensorMode and its own Recorder, but only its own ranks' buffers are
kept; sends and receives between threads are moved by shardviz (``_torch.P2PMode``). The threads'
events merge into one Trace in the order they happened:

- a send is a ``CollectiveEvent`` with ``op="send"``, ``groups`` the (source, destination) pairs
  of global ranks (one per group that ran it at once), ``root=1`` (the destination's index in each
  pair), ``inputs`` at the sources; its receive is a later ``op="recv"`` event with the same pairs,
  ``root=0``, the sent value as ``inputs`` at the source and the received one as ``outputs`` at
  the destination. ``params``: ``tag``, ``peer`` (the id of the matching event), ``process_group``
  (each pair's whole group), and ``pipeline`` (stage, microbatch, phase) for pipeline traffic;
- ``torch.distributed.pipelining`` stages report each forward / backward of a microbatch as a
  ``ComputeEvent`` (``stage``, ``microbatch``, ``ranks``); what they communicate inside
  (tensor-parallel collectives) are its children. ``shardviz.pipeline.timeline(trace)`` draws it.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from ..data.events import CollectiveEvent, ComputeEvent, Event, LocalEvent, Source, TensorSnapshot, dtype_size
from ..data.trace import Trace
from ..errors import BackendError, DeadlockError, P2PError, RankExitError
from . import torch as _torch
from .recorder import Recorder, ValueBudget, frames, mesh_dim, split_per_rank, to_numpy


def live_ranks(world_size: int, threads: int) -> list[frozenset[int]]:
    """The ranks each thread stands for: contiguous blocks of ``world_size // threads``."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive int, not {threads!r}")
    if world_size % threads:
        raise ValueError(
            f"threads={threads} does not divide the world size {world_size}: each thread stands for "
            f"an equal block of ranks (use a divisor of {world_size}, e.g. the pipeline size)"
        )
    n = world_size // threads
    return [frozenset(range(t * n, (t + 1) * n)) for t in range(threads)]


def run_threads(
    trace: Trace,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    threads: int,
    done: Callable[[Trace], None],
) -> None:
    """``sv.run(fn, *args, threads=N)`` on the simulator: ``fn(thread, *args, **kwargs)`` in
    ``threads`` simulated threads, recorded into ``trace`` (its world size and value policy).

    ``trace.results[rank]`` is what ``fn`` returned on that rank's thread, at that rank. The trace
    is handed to ``done`` once it holds what ran, also when the run fails (not when it is refused).
    """
    values = trace.values
    ValueBudget(values)
    if _torch.active_local_mode() is not None:
        raise BackendError(
            "sv.run(fn, threads=N) cannot run inside sv.record() or a %%spmd cell: call it outside"
        )
    world = trace.world_size
    _torch.settle_stopped_runs()  # threads an earlier run left behind, before anything is entered
    state = _Run(world, live_ranks(world, threads), values)
    state.sim.before = _torch.patchable_now()
    try:
        with (
            _torch.tracking_meshes(),
            _torch.fsdp_in_simulation(),
            _torch.per_rank_values(state.sim.live_ranks),  # dist.get_rank() is each rank's, not 0
            state.pipeline_hooks(),
        ):
            results = state.sim.run(lambda t: fn(t, *args, **kwargs), setup=state.thread_setup)
    except _torch.P2PStuck as e:
        trace.complete = False
        _finish(state, trace)
        done(trace)
        raise DeadlockError(
            "deadlock: every simulated rank is finished or blocked in a receive that nothing will "
            f"satisfy:\n{e}\nOn real ranks this program would hang. Make every recv match a send "
            "(e.g. even ranks send first, odd ranks receive first), or use isend/irecv or "
            "batch_isend_irecv so that no rank blocks before its own sends."
        ) from None
    except _torch.P2PGroupError as e:
        trace.complete = False
        raise P2PError(str(e)) from None
    except BaseException as e:
        trace.complete = False
        with contextlib.suppress(Exception):  # a thread left running may still be recording
            _finish(state, trace)
            done(trace)
        raise _explained(e, state)  # noqa: B904 - the same error, or one whose cause is set
    _finish(state, trace)
    trace.results = {}
    for t, live in enumerate(state.live):
        trace.results.update(split_per_rank(results.get(t), sorted(live)))
    done(trace)


def _explained(error: BaseException, state: _Run) -> BaseException:
    """A thread's ``sys.exit`` as a named error; Ctrl-C with where each thread was."""
    sim = state.sim
    threads = len(state.live)

    def ranks(t: int) -> str:
        live = sorted(state.live[t])
        return f"thread {t} (rank{'s' if len(live) > 1 else ''} {', '.join(map(str, live))})"

    if isinstance(error, SystemExit) and sim.error_thread is not None:
        t = sim.error_thread
        tb = traceback.extract_tb(error.__traceback__)
        at = f" at line {tb[-1].lineno} of {tb[-1].filename}: {tb[-1].line}" if tb else ""
        exit_error = RankExitError(
            f"{ranks(t)} of sv.run(fn, threads={threads}) called sys.exit({error.code!r}){at}. Real "
            "ranks' processes would end there; here the run stops, and the kernel or script goes on. "
            "(os._exit in a thread ends the whole process: the notebook's kernel with it.)",
            rank=min(state.live[t]),
            code=error.code,
        )
        exit_error.__cause__ = error
        return exit_error
    if isinstance(error, RuntimeError) and "can't start new thread" in str(error):
        started = sum(1 for t in sim.idents)
        out = BackendError(
            f"sv.run(fn, threads={threads}): the OS refused to start a thread ({error}) after "
            f"{started} had started; those are stopped again. Use fewer threads (a divisor of the "
            "world size, e.g. the pipeline size)."
        )
        out.__cause__ = error
        return out
    if isinstance(error, Exception) and sim.error_thread is not None and not isinstance(error, P2PError):
        error.add_note(
            f"raised on {ranks(sim.error_thread)} of sv.run(fn, threads={threads}); the run stopped there."
        )
    if isinstance(error, KeyboardInterrupt) and sim.positions:
        where = "\n".join(f"  {ranks(t)}: {sim.positions[t]}" for t in sorted(sim.positions))
        note = f"stopped by Ctrl-C (sv.run(fn, threads={threads})); where each thread was:\n{where}"
        if sim.left_running:
            note += (
                f"\nthread {', '.join(map(str, sim.left_running))} had not stopped "
                f"{_torch.P2P_STOP_WAIT:g} s later (in a call Python cannot interrupt: a long torch op, a "
                "lock, I/O); it ends with that call."
            )
        error.add_note(note)
    return error


class _ThreadRecorder(Recorder):
    """A Recorder for one runner thread: stamps each event with the run's global clock, ignores
    what other threads do (module hooks and user-call watches are process-wide), and refuses a
    collective whose groups mix this thread's ranks with other threads'."""

    def __init__(self, run: _Run, thread: int, trace: Trace, world_size: int, values: str | int) -> None:
        super().__init__(trace, world_size, run.budget)  # one value budget for the whole trace
        self.run = run
        self.thread = thread
        self.live = run.live[thread]
        self.ident = threading.get_ident()
        self.stamps: dict[int, int] = {}
        ms = self.modules
        for name in ("_enter_forward", "_leave_forward"):
            setattr(ms, name, self._only_mine(getattr(ms, name)))

    def _only_mine(self, hook: Callable[..., Any]) -> Callable[..., Any]:
        def only_mine(*a: Any) -> Any:
            if threading.get_ident() == self.ident:
                return hook(*a)
            return None

        return only_mine

    def _reserve(self) -> int:
        eid = super()._reserve()
        self.stamps[eid] = self.run.tick()
        return eid

    def _on_to_local(self, dt: Any, out: Any, caller: Any) -> None:
        if threading.get_ident() == self.ident:
            super()._on_to_local(dt, out, caller)

    def _on_from_local(self, out: Any, caller: Any) -> None:
        if threading.get_ident() == self.ident:
            super()._on_from_local(out, caller)

    def _groups(self, key: str, group: Any, ranks: Any) -> tuple[tuple[int, ...], ...]:
        groups = super()._groups(key, group, ranks)
        for g in groups:
            inside = [r for r in g if r in self.live]
            if inside and len(inside) != len(g):
                src = frames.user_source(sys._getframe(2))
                where = f" (line {src.line}: {src.text})" if src is not None else ""
                raise P2PError(
                    f"a collective over ranks {list(g)}{where} spans several threads of "
                    f"sv.run(..., threads={len(self.run.live)}): thread {self.thread} stands for ranks "
                    f"{sorted(self.live)}. In a threaded run a collective must stay inside one thread's "
                    "ranks (tensor parallel within a pipeline stage); collectives across threads are "
                    "not simulated. Use send/recv between threads, or run that part with sv.run(fn) "
                    "or sv.record() without threads."
                )
        return groups


class _Run:
    """The shared state of one threaded run (only one thread runs at a time: no locks needed)."""

    def __init__(self, world_size: int, live: list[frozenset[int]], values: str | int) -> None:
        self.world_size = world_size
        self.live = live
        self.values = values
        self.budget = ValueBudget(values)
        self._clock = itertools.count()
        self.recorders: dict[int, _ThreadRecorder] = {}
        self.idents: dict[int, int] = {}
        self.labels: dict[int, tuple[Any, dict[str, Any]]] = {}  # id(tensor) -> (tensor, label)
        self.computes: list[dict[str, Any]] = []
        self.p2p: list[dict[str, Any]] = []  # sends and receives, as they happened
        self._sends: dict[int, dict[str, Any]] = {}  # id(message) -> its send
        self.sim = _torch.ThreadedP2P(world_size, live, self.on_send, self.on_recv, self.describe)

    def tick(self) -> int:
        return next(self._clock)

    # --- per thread --------------------------------------------------------------------------

    @contextlib.contextmanager
    def thread_setup(self, t: int) -> Iterator[None]:
        self.idents[t] = threading.get_ident()
        sub = Trace(self.world_size, "local", self.values)
        rec = _ThreadRecorder(self, t, sub, self.world_size, self.values)
        self.recorders[t] = rec
        try:
            with rec:
                yield
        finally:
            rec.finish()

    def describe(self, t: int) -> str:
        frame = sys._current_frames().get(self.idents.get(t, -1))
        src = frames.user_source(frame) if frame is not None else None
        return f", at line {src.line}: {src.text}" if src is not None else ""

    # --- messages ----------------------------------------------------------------------------

    def _where(self) -> tuple[Source | None, str | None]:
        rec = self.recorders.get(self.sim.thread)
        found = frames.Found(look_for_call=rec is not None and rec.modules.compiled)
        frame, _ = frames.user_frame(sys._getframe(2), found=found)
        module = rec.modules.current(found.fsdp, found.called) if rec is not None else None
        return frames.source(frame), module

    def _label(self, key: int) -> dict[str, Any] | None:
        hit = self.labels.get(key)
        return dict(hit[1]) if hit is not None else None

    def on_send(self, t: int, msgs: list[_torch.P2PMessage]) -> None:
        source, module = self._where()
        rec = {
            "kind": "send",
            "stamp": self.tick(),
            "thread": t,
            "msgs": msgs,
            "source": source,
            "module": module,
            "label": self._label(msgs[0].key) if msgs else None,
            "snaps": {m.src: self._snapshot(m.value) for m in msgs},
            "recvs": [],
            # while the mesh is alive: a mesh built in ``fn`` is gone when the run is merged
            "dim": mesh_dim(
                tuple(m.group for m in msgs), msgs[0].desc if msgs else "", (), _torch.mesh_generation()
            ),
        }
        for m in msgs:
            self._sends[id(m)] = rec
        self.p2p.append(rec)

    def on_recv(self, t: int, msgs: list[_torch.P2PMessage], key: int) -> None:
        source, module = self._where()
        sends = [self._sends.get(id(m)) for m in msgs]
        first = next((x for x in sends if x is not None), None)
        rec = {
            "dim": first["dim"] if first is not None else (None, None),
            "kind": "recv",
            "stamp": self.tick(),
            "thread": t,
            "msgs": msgs,
            "source": source,
            "module": module,
            "label": self._label(key),
            "sends": sends,
        }
        for s in sends:
            if s is not None:
                s["recvs"].append(rec)
        self.p2p.append(rec)

    def _snapshot(self, value: Any) -> TensorSnapshot:
        shape = tuple(int(s) for s in value.shape)
        dtype = _torch.dtype_name(value.dtype)
        nbytes = value.numel() * dtype_size(dtype)
        keep = self.budget.take(nbytes, -1)
        return TensorSnapshot(shape, dtype, to_numpy(value) if keep else None)

    # --- pipelines ---------------------------------------------------------------------------

    def pipeline_hooks(self) -> Any:
        return _torch.pipeline_stage_hooks(self._group_rank, self._compute, self._ops)

    def _group_rank(self, group: Any) -> int:
        live = self.live[self.sim.thread]
        for g in _torch.p2p_groups(group):
            mine = [i for i, r in enumerate(g) if r in live]
            if len(mine) == 1:
                return mine[0]
        raise P2PError(
            f"a pipeline stage's group holds no single rank of thread {self.sim.thread} (ranks "
            f"{sorted(live)}): build the stages on the pipeline dim's group (mesh.get_group('pp')) of a "
            "mesh whose outermost dim is 'pp', and pass threads=<pp size> to sv.run"
        )

    @contextlib.contextmanager
    def _compute(self, stage: int, method: str, chunk: int) -> Iterator[None]:
        t = self.sim.thread
        rec = self.recorders.get(t)
        source = None
        if rec is not None:
            source = frames.user_source(sys._getframe(3))
        item = {
            "thread": t,
            "start": self.tick(),
            "end": None,
            "name": _torch.STAGE_COMPUTE_NAMES.get(method, method),
            "stage": stage,
            "microbatch": chunk,
            "source": source,
        }
        self.computes.append(item)
        try:
            yield
        finally:
            item["end"] = self.tick()

    def _ops(self, stage: int, method: str, chunk: int, tensors: list[Any]) -> None:
        label = {"stage": stage, "microbatch": chunk, "phase": _torch.STAGE_OPS_PHASES.get(method, method)}
        for x in tensors:
            self.labels[id(x)] = (x, label)  # the tensor is kept: its id stays its own


# --- merging the threads' events --------------------------------------------------------------


def _keep_live(e: Event, live: frozenset[int]) -> Event | None:
    """An event of one thread with only that thread's ranks (the others are shadows)."""
    if isinstance(e, CollectiveEvent):
        groups = tuple(g for g in e.groups if all(r in live for r in g))
        if not groups and e.groups:
            return None
        return replace(
            e,
            groups=groups,
            inputs={r: v for r, v in e.inputs.items() if r in live},
            outputs={r: v for r, v in e.outputs.items() if r in live},
            nbytes={r: n for r, n in e.nbytes.items() if r in live},
        )
    if isinstance(e, LocalEvent):
        return replace(
            e,
            inputs={r: v for r, v in e.inputs.items() if r in live},
            outputs={r: v for r, v in e.outputs.items() if r in live},
        )
    return e


def _finish(state: _Run, trace: Trace) -> None:
    """Merge the threads' recorders, computes and messages into ``trace``, by the global clock."""
    items: list[tuple[int, int, str, Any]] = []  # (stamp, order, what, payload)
    order = itertools.count()
    for t, rec in sorted(state.recorders.items()):
        stamp_of = {id(s): rec.stamps.get(i, 0) for i, s in enumerate(rec._slots) if s is not None}
        for e in rec.trace.events:
            kept = _keep_live(e, state.live[t])
            if kept is not None:
                items.append((stamp_of.get(id(e), 0), next(order), "event", (t, e.id, kept)))
        for m in rec.trace.meshes:
            if m not in trace.meshes:
                trace.meshes.append(m)
    for c in state.computes:
        items.append((c["start"], next(order), "compute", c))
    for p in state.p2p:
        items.append((p["stamp"], next(order), p["kind"], p))
    items.sort(key=lambda x: (x[0], x[1]))

    new_id: dict[Any, int] = {}
    for i, (_, _, what, payload) in enumerate(items):
        key = (payload[0], payload[1]) if what == "event" else id(payload)
        new_id[key] = i
    open_computes: dict[int, list[tuple[float, int]]] = {}  # thread -> [(end stamp or inf, id)]
    events: list[Event] = []
    meshes = _mesh_infos(trace.meshes)
    generation = _torch.mesh_generation()
    for i, (stamp, _, what, payload) in enumerate(items):
        thread = payload[0] if what == "event" else payload["thread"]
        stack = open_computes.setdefault(thread, [])
        while stack and stack[-1][0] is not None and stack[-1][0] < stamp:
            stack.pop()
        enclosing = stack[-1][1] if stack else None
        if what == "event":
            t, _, e = payload
            parent = new_id.get((t, e.parent)) if e.parent is not None else enclosing
            events.append(replace(e, id=i, parent=parent))
        elif what == "compute":
            end = payload["end"] if payload["end"] is not None else float("inf")
            events.append(
                ComputeEvent(
                    id=i,
                    parent=enclosing,
                    source=payload["source"],
                    phase="backward" if payload["name"].startswith("backward") else "forward",
                    name=payload["name"],
                    ranks=tuple(sorted(state.live[thread])),
                    stage=payload["stage"],
                    microbatch=payload["microbatch"],
                )
            )
            stack.append((end, i))
        else:
            events.append(_p2p_event(i, enclosing, what, payload, new_id, meshes, generation))
    trace.events = events
    if state.budget.exhausted_at is not None:
        trace.values_dropped_from = next(
            (e.id for e in events if _lacks_values(e)),
            None,
        )
    unreceived = [p for p in state.p2p if p["kind"] == "send" and not p["recvs"]]
    if unreceived and hasattr(trace, "notes"):
        pairs = ", ".join(f"{m.src}->{m.dst}" for p in unreceived for m in p["msgs"])
        trace.notes.append(f"sent but never received (no matching recv, or its wait() never called): {pairs}")


def _mesh_infos(meshes: list[dict[str, Any]]) -> tuple[_torch.MeshInfo, ...]:
    return tuple(
        (
            tuple(m["mesh_shape"]),
            tuple(m["mesh_dim_names"]) if m.get("mesh_dim_names") else None,
            tuple(m["ranks"]),
        )
        for m in meshes
    )


def _lacks_values(e: Event) -> bool:
    for snaps in (getattr(e, "inputs", {}), getattr(e, "outputs", {})):
        for s in snaps.values():
            for x in s if isinstance(s, list) else [s]:
                if x.values is None:
                    return True
    return False


def _p2p_event(
    eid: int,
    parent: int | None,
    what: str,
    p: dict[str, Any],
    new_id: dict[Any, int],
    meshes: tuple[_torch.MeshInfo, ...],
    generation: tuple[int, int],
) -> CollectiveEvent:
    msgs: list[_torch.P2PMessage] = p["msgs"]
    groups = tuple((m.src, m.dst) for m in msgs)
    process_groups = tuple(m.group for m in msgs)
    dim, dim_name = p["dim"]
    if dim is None and process_groups:
        dim, dim_name = mesh_dim(process_groups, msgs[0].desc, meshes, generation)
    params: dict[str, Any] = {
        "tag": msgs[0].tag if msgs else 0,
        "process_group": [list(g) for g in process_groups],
    }
    label = p["label"]
    if label is not None:
        params["pipeline"] = label
    phase = label["phase"] if label is not None else None
    common = {
        "id": eid,
        "parent": parent,
        "source": p["source"],
        "module": p["module"],
        "phase": phase,
        "groups": groups,
        "mesh_dim": dim,
        "mesh_dim_name": dim_name,
    }
    if what == "send":
        recvs = p["recvs"]
        params["peer"] = new_id.get(id(recvs[0])) if recvs else None
        return CollectiveEvent(
            op="send",
            impl="c10d.send",
            root=1,
            inputs=dict(p["snaps"]),
            outputs={},
            nbytes={m.src: s.nbytes for m, s in zip(msgs, p["snaps"].values(), strict=True)},
            params=params,
            **common,
        )
    sends = [s for s in p["sends"] if s is not None]
    params["peer"] = new_id.get(id(sends[0])) if sends else None
    inputs: dict[int, Any] = {}
    outputs: dict[int, Any] = {}
    for m, s in zip(msgs, p["sends"], strict=True):
        snap = s["snaps"].get(m.src) if s is not None else None
        if snap is not None:
            inputs[m.src] = snap
            outputs[m.dst] = snap  # what arrived is exactly what was sent
    return CollectiveEvent(
        op="recv",
        impl="c10d.recv_",
        root=0,
        inputs=inputs,
        outputs=outputs,
        nbytes={},
        params=params,
        **common,
    )
