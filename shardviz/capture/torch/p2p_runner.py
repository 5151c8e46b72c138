"""Point-to-point in the simulator: runner threads, one LocalTensorMode each, and the dispatch
mode that moves sends and receives between them."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import time
import types
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .. import stopping
from .c10d import fake_work, p2p_groups, process_group_desc
from .gate import LocalTensor, TorchDispatchMode, _private
from .modes import new_local_mode, no_dispatch
from .rank_threads import settle_cuda_guard
from .tensors import dtype_name

# Torch's own send/recv under LocalTensorMode (``local_p2p_op``) maps ranks wrongly on groups other
# than WORLD, replaces buffers instead of writing into them and hangs on a deadlock. Here N threads
# run under torch's LocalRunnerMode (one at a time), each with its own LocalTensorMode over the
# whole world; ``P2PMode`` on top of it moves the messages itself. Plain data out through hooks.


class P2PStuck(RuntimeError):
    """Every thread of a threaded simulation is finished or waiting for a message nobody sends."""


class P2PAborted(RuntimeError):
    """This thread stopped because another thread of the run failed first."""


class _Stopped(BaseException):
    """Raised in a runner thread at its next line of Python (or in its sleep) on Ctrl-C: a
    BaseException, so that the user's ``except Exception`` does not swallow it."""


STOP_WAIT = 1.0  # seconds a Ctrl-C waits for the runner threads to stop
SETTLE_WAIT = 3.0  # seconds a run waits for the threads a stopped run left in an uninterruptible call

_MISSING = object()


@dataclasses.dataclass(eq=False)
class _StoppedRun:
    """A run stopped by Ctrl-C whose threads were still in a call Python cannot interrupt.

    Until they end, LocalTensorMode's process-mode flag stays off, so that every thread keeps its
    own list of active modes: a straggler leaving its mode touches only its own, never the
    notebook's. But leaving its modes also writes back the globals they patched (``dist.get_rank``
    on torch >= 2.15, DeviceMesh's rank methods, shardviz's per-rank ``get_rank``) as they were when
    it entered: by then another thread's patch, left in place after the notebook's run has returned.
    So once they end, ``put_back`` (each attribute and the value it had before the run) is applied."""

    threads: dict[int, Any]  # thread index -> its Thread
    where: dict[int, str]  # thread index -> where it was stopped
    process_mode: bool
    put_back: list[tuple[Any, str, Any]]


_stopped_runs: list[_StoppedRun] = []


def settle_stopped_runs(wait: float | None = None) -> None:
    """Before any simulation starts: wait (up to ``wait`` seconds, SETTLE_WAIT by default) for
    threads a stopped run left behind, and once they have ended put back what their leaving
    changed. Refuses, naming them, while one still runs: its leaving would change the globals a
    new run stands on, halfway through it."""
    from ...errors import BackendError

    deadline = time.monotonic() + (SETTLE_WAIT if wait is None else wait)
    for entry in list(_stopped_runs):
        stopping.wait_ended(entry.threads.values(), deadline)
        alive = [t for t, th in entry.threads.items() if th.is_alive()]
        if alive:
            raise BackendError(
                "a run of sv.run(fn, threads=N) stopped by Ctrl-C left "
                + "; ".join(f"thread {t} {entry.where.get(t, 'running')}" for t in alive)
                + " in a call Python cannot interrupt, and no simulated run can start until it "
                "ends: wait for it (or restart the kernel)"
            )
        _stopped_runs.remove(entry)
        _private["local_tensor_module"]._PROCESS_MODE = entry.process_mode
        for owner, name, value in entry.put_back:
            if value is _MISSING:
                if name in vars(owner):
                    delattr(owner, name)
            else:
                setattr(owner, name, value)


def _patchable() -> list[Any]:
    """The modules and classes whose attributes a run's modes patch while they are on
    (LocalTensorMode's, the recorder's, per-rank values', shardviz's c10d and pipelining wraps)."""
    import sys

    from torch.distributed.tensor import _redistribute

    owners: list[Any] = [torch, torch.random, dist, dist.distributed_c10d, dist.ProcessGroup, DeviceMesh]
    owners += [DTensor, _redistribute, _private["LocalIntNode"], _private["ConstantIntNode"]]
    stage = sys.modules.get("torch.distributed.pipelining.stage")
    if stage is not None:
        owners.append(stage._PipelineStageBase)
    return owners


def patchable_now() -> list[tuple[Any, dict[str, Any]]]:
    """Those attributes as they are now (``ThreadedP2P.before``: taken before a run's modes)."""
    return [(owner, dict(vars(owner))) for owner in _patchable()]


def _changed(before: list[tuple[Any, dict[str, Any]]]) -> list[tuple[Any, str, Any]]:
    """Each attribute that differs now from ``before``, with its value there."""
    out = []
    for owner, then in before:
        now = vars(owner)
        for name in now.keys() | then.keys():
            old, new = then.get(name, _MISSING), now.get(name, _MISSING)
            if old is new or name.startswith("__") or isinstance(new, types.ModuleType):
                continue  # a submodule imported meanwhile stays
            if old is _MISSING and isinstance(owner, types.ModuleType):
                continue  # so does a module attribute first set meanwhile
            out.append((owner, name, old))
    return out


@dataclasses.dataclass(eq=False)
class P2PMessage:
    """One message of a threaded run: global ranks, the group it went over, a copy of the value."""

    src: int
    dst: int
    group: tuple[int, ...]  # the group's global ranks, by group rank
    tag: int
    value: torch.Tensor  # a plain copy of what the sender's buffer held
    key: int  # id() of the tensor the sender passed (to find who sent it)
    thread: int
    desc: str = ""  # the process group's description ("mesh_pp" for a DeviceMesh's): its mesh dim


def _patched_globals() -> list[tuple[Any, str, Any]]:
    """Module and class attributes that entering a LocalTensorMode (or a recorder) replaces; a
    threaded run enters one mode per thread, so it saves them all and puts them back at the end."""
    import importlib as _il

    ltm_mod = _private["local_tensor_module"]
    saved: list[tuple[Any, str, Any]] = []
    for name in getattr(ltm_mod, "_PATCHED_DEVICE_MESH_METHODS", ()):
        saved.append((DeviceMesh, name, DeviceMesh.__dict__.get(name)))
    for global_name, _ in getattr(ltm_mod, "_PATCHED_RANDOM_FUNCTIONS", ()):
        mod_name, attr = global_name.rsplit(".", 1)
        mod = _il.import_module(mod_name)
        saved.append((mod, attr, getattr(mod, attr)))
    for name in ("get_rank", *getattr(ltm_mod, "_PATCHED_DIST_FUNCTIONS", ())):
        saved.append((dist, name, getattr(dist, name)))
    saved.append((DTensor, "to_local", DTensor.__dict__.get("to_local")))
    saved.append((DTensor, "from_local", DTensor.__dict__.get("from_local")))
    c10d = dist.distributed_c10d
    saved.append((c10d, "_check_not_self_rank", getattr(c10d, "_check_not_self_rank", None)))
    return saved


def _restore_globals(saved: list[tuple[Any, str, Any]]) -> None:
    for owner, name, value in saved:
        if value is not None:
            setattr(owner, name, value)


class ThreadedP2P:
    """One threaded simulation: ``run(fn)`` calls ``fn(thread)`` in ``threads`` runner threads,
    each inside its own LocalTensorMode over ``world_size`` ranks; ``live[t]`` are the ranks thread
    ``t`` stands for (its other ranks are computed but meaningless). ``on_send(thread, msgs)`` is
    called once per send with its messages (one per group that runs it at once) before they are
    queued; ``on_recv(thread, msgs, key)`` once a receive's messages are in the receiver's buffer
    (``key``: id() of the receiving tensor); ``describe(thread)`` says where a blocked thread is,
    for the deadlock message."""

    def __init__(
        self,
        world_size: int,
        live: list[frozenset[int]],
        on_send: Any,
        on_recv: Any,
        describe: Any = None,
    ) -> None:
        self.world_size = world_size
        self.live = live
        self.threads = len(live)
        self.on_send = on_send
        self.on_recv = on_recv
        self.describe = describe or (lambda t: "")
        self.queues: dict[tuple[tuple[int, ...], int, int], collections.deque[P2PMessage]] = (
            collections.defaultdict(collections.deque)
        )
        self.finished: set[int] = set()
        self.waiting: dict[int, tuple[Any, str]] = {}
        self.error: BaseException | None = None
        self.interrupted: BaseException | None = None  # what stopped the calling thread (Ctrl-C)
        self.turn: int | None = 0  # the thread that runs now (one at a time, in a fixed order)
        self.results: dict[int, Any] = {}
        self.error_thread: int | None = None  # the thread whose error ended the run
        self.idents: dict[int, int] = {}  # thread index -> its thread's id
        self.left_running: list[int] = []  # threads still running when a Ctrl-C stopped waiting
        self.positions: dict[int, str] = {}  # where each thread was when the run was stopped
        self._stop = stopping.Stop(_Stopped)
        self._stop_lock = threading.Lock()
        self._done: set[int] = set()  # threads past their body: no stop may be raised in them
        self._runner: Any = None
        self._local = threading.local()
        # the patchable globals before the caller's modes were entered (see _StoppedRun)
        self.before: list[tuple[Any, dict[str, Any]]] | None = None

    @property
    def thread(self) -> int:
        return int(self._local.thread)

    def live_ranks(self) -> frozenset[int] | None:
        """The ranks the calling runner thread stands for (None outside a runner thread)."""
        t = getattr(self._local, "thread", None)
        return self.live[t] if t is not None else None

    def run(self, fn: Any, setup: Any = None) -> dict[int, Any]:
        """``setup(thread)``, if given, is a context manager entered inside the thread's
        LocalTensorMode and under the P2P mode (a recorder goes there)."""
        from torch.distributed._local_tensor import LocalRunnerMode

        settle_stopped_runs()
        before = self.before or patchable_now()
        saved = _patched_globals()
        dist.distributed_c10d._check_not_self_rank = lambda *a, **k: None  # the fake PG is rank 0
        cond_box: list[Any] = []

        def main(t: int) -> None:
            self.idents[t] = threading.get_ident()
            stopping.enrol(self._stop)
            try:
                try:
                    body(t)
                except BaseException as e:
                    self._note_error(e, t)
                    cond_box[0].notify_all()
            finally:
                stopping.leave()
                with self._stop_lock:  # no stop is raised in this thread after this
                    self._done.add(t)
                    stopping.clear_pending(threading.get_ident())

        def body(t: int) -> None:
            self._local.thread = t
            cond = cond_box[0]
            self._await_turn(t)
            self.check_stop()  # a thread that started late, after Ctrl-C, enters no mode
            try:
                with new_local_mode(self.world_size, "lockstep"):
                    try:
                        with setup(t) if setup is not None else contextlib.nullcontext(), P2PMode(self, t):
                            self.results[t] = fn(t)
                    except BaseException as e:
                        self._note_error(e, t)
                        raise
                    finally:
                        # Keep this thread's mode (and the globals it patched) until all are done.
                        self.finished.add(t)
                        self.turn = self._next_runnable(t)
                        if (
                            self.turn is None
                            and self.waiting
                            and self.error is None
                            and self.interrupted is None
                        ):
                            # the rest wait for messages that no running thread can send
                            blocked = {u: w[1] for u, w in self.waiting.items()}
                            self.error = P2PStuck(self._deadlock_text(blocked))
                        cond.notify_all()
                        while (
                            len(self.finished) < self.threads
                            and self.error is None
                            and self.interrupted is None
                        ):
                            cond.wait(0.5)
            finally:
                cond.notify_all()

        ltm_mod = _private["local_tensor_module"]
        process_mode = getattr(ltm_mod, "_PROCESS_MODE", True)
        settle_cuda_guard()
        runner = LocalRunnerMode(self.world_size, self.threads, main)
        cond_box.append(runner._run_cond)
        self._runner = runner
        try:
            try:
                with stopping.stoppable_sleeps():
                    runner.__enter__()  # starts the threads
                    self._join(runner)
            except BaseException as e:
                # Ctrl-C (a KeyboardInterrupt here, in the calling thread) while the runners run, or
                # a thread the OS refused to start: they stop at their next line of Python (a sleep
                # at once), and are joined before the globals they run under are reset, so that a
                # later run starts clean. One in a call Python cannot interrupt is named instead.
                self.interrupted = e
                self._stop_runners(runner)
                raise
        finally:
            # Not LocalRunnerMode.__exit__: it re-raises the first thread's error before resetting
            # its globals and leaves the other threads unjoined.
            if getattr(ltm_mod, "_LOCAL_RUNNER_MODE", None) is runner:
                ltm_mod._LOCAL_RUNNER_MODE = None
            alive = {t: th for t, th in enumerate(runner._runners) if th.is_alive()}
            if alive:
                # what the modes patch, taken while some are still on
                where = {t: self.positions.get(t, "") for t in alive}
                put_back = _changed(before)
                _stopped_runs.append(_StoppedRun(alive, where, process_mode, put_back))
            else:
                ltm_mod._PROCESS_MODE = process_mode
            _restore_globals(saved)
        if self.error is not None:
            raise self.error
        return self.results

    def where(self, t: int) -> str:
        """What thread ``t`` is doing now, for messages."""
        if t in self.finished:
            return "finished"
        if t in self.waiting:
            return f"waiting for {self.waiting[t][1]}{self.describe(t)}"
        if t not in self.idents:
            return "had not started"
        return f"running{self.describe(t)}"

    def _note_error(self, error: BaseException, thread: int) -> None:
        if self.error is None and not isinstance(error, P2PAborted | _Stopped):
            self.error, self.error_thread = error, thread

    @staticmethod
    def _join(runner: Any, deadline: float | None = None) -> None:
        """Wait for every runner thread that was started (a KeyboardInterrupt can come while
        ``LocalRunnerMode`` starts them), until ``deadline`` (``time.monotonic()``) if given."""
        stopping.wait_ended(runner._runners, deadline)

    def _stop_runners(self, runner: Any) -> None:
        """The thread that runs stops at its next line of Python (a sleep at once); the others,
        waiting for their turn, see ``interrupted`` within half a second."""
        self.positions = {t: self.where(t) for t in range(self.threads)}
        self._stop.set()
        with self._stop_lock:
            running = self.turn
            ident = self.idents.get(running) if running is not None else None
            if ident is not None and running not in self._done:
                stopping.raise_in(ident, _Stopped)
        with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting
            self._join(runner, time.monotonic() + STOP_WAIT)
        self.left_running = [t for t, th in enumerate(runner._runners) if th.is_alive()]

    def check_stop(self) -> None:
        """Raise ``P2PAborted`` in a runner thread once another thread failed or the run was
        interrupted."""
        if self.interrupted is not None:
            raise P2PAborted(f"stopped: the run was interrupted ({type(self.interrupted).__name__})")
        if self.error is not None:
            raise P2PAborted(f"stopped: another simulated thread failed ({type(self.error).__name__})")

    def _await_turn(self, t: int) -> None:
        """Wait (releasing the run lock) until it is thread ``t``'s turn, or a thread failed."""
        cond = self._runner._run_cond
        while self.turn != t:
            self.check_stop()
            cond.wait(0.5)

    def _next_runnable(self, t: int) -> int | None:
        """The thread to run after ``t`` stops, round robin from ``t + 1``: one not finished and
        not waiting for a message that is not there. Deterministic, so traces are too."""
        for k in range(1, self.threads + 1):
            u = (t + k) % self.threads
            if u == t or u in self.finished:
                continue
            waiting = self.waiting.get(u)
            if waiting is None or waiting[0]():
                return u
        return None

    def wait_for(self, ready: Any, what: str) -> None:
        """Block this thread (letting others run) until ``ready()``; a deadlock raises P2PStuck."""
        cond = self._runner._run_cond
        t = self.thread
        while not ready():
            self.check_stop()
            self.waiting[t] = (ready, what)
            nxt = self._next_runnable(t)
            if nxt is None:
                others = [u for u in range(self.threads) if u != t]
                blocked = {u: self.waiting[u][1] for u in others if u in self.waiting}
                blocked[t] = what
                del self.waiting[t]
                self.error = P2PStuck(self._deadlock_text(blocked))
                self.turn = None
                cond.notify_all()
                raise self.error
            self.turn = nxt
            cond.notify_all()
            try:
                self._await_turn(t)
            finally:
                del self.waiting[t]

    def _deadlock_text(self, blocked: dict[int, str]) -> str:
        lines = []
        for u in sorted(blocked):
            where = self.describe(u)
            lines.append(f"  ranks {sorted(self.live[u])}: waiting for {blocked[u]}{where}")
        done = sorted(r for u in self.finished for r in self.live[u])
        if done:
            lines.append(f"  ranks {done}: finished")
        return "\n".join(lines)


class P2PMode(TorchDispatchMode):
    """Entered in each runner thread on top of its LocalTensorMode: handles ``c10d.send`` and
    ``c10d.recv_`` between the threads' live ranks; everything else passes on."""

    def __init__(self, sim: ThreadedP2P, thread: int) -> None:
        super().__init__()
        self.sim = sim
        self.thread = thread
        self.live = sim.live[thread]

    def _me(self, group: tuple[int, ...], op: str) -> int:
        mine = [r for r in group if r in self.live]
        if len(mine) != 1:
            raise P2PGroupError(
                f"{op} on the group {list(group)}: it must hold exactly one rank of this thread "
                f"(ranks {sorted(self.live)}), it holds {mine or 'none'}. Send over the pipeline mesh "
                "dim's group (mesh.get_group('pp')), or run one thread per rank (threads=world_size)."
            )
        return mine[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.sim.interrupted is not None:
            self.sim.check_stop()  # Ctrl-C in the calling thread: stop at this operator
        kwargs = kwargs or {}
        if func is torch.ops.c10d.send.default:
            return self._send(*args, **kwargs)
        if func is torch.ops.c10d.recv_.default:
            return self._recv(*args, **kwargs)
        if func is torch.ops.c10d.recv_any_source_.default:
            raise P2PGroupError(
                "recv from any source (dist.recv(t) without src) is not simulated: pass src=<rank>"
            )
        return func(*args, **kwargs)

    def _send(self, tensors: Any, group: Any, dst: int, tag: int) -> Any:
        sim = self.sim
        (tensor,) = tensors
        msgs = []
        desc = process_group_desc(group)
        with no_dispatch(), torch.no_grad():
            for g in p2p_groups(group):
                src = self._me(g, "send")
                plain = tensor._local_tensors[src] if isinstance(tensor, LocalTensor) else tensor
                value = plain.detach().clone()
                msgs.append(P2PMessage(src, g[int(dst)], g, int(tag), value, id(tensor), self.thread, desc))
        sim.on_send(self.thread, msgs)
        for msg in msgs:
            sim.queues[(msg.group, msg.src, msg.dst)].append(msg)
        sim._runner._run_cond.notify_all()
        return fake_work()

    def _recv(self, tensors: Any, group: Any, src: int, tag: int) -> Any:
        from torch._C._distributed_c10d import PythonCallbackWork

        sim = self.sim
        (tensor,) = tensors
        wants = []
        for g in p2p_groups(group):
            wants.append((g, g[int(src)], self._me(g, "recv")))
        done = [False]

        def wait(timeout: Any = None) -> bool:
            if done[0]:
                return True
            got = []
            for g, s, d in wants:
                q = sim.queues[(g, s, d)]
                sim.wait_for(lambda q=q: len(q) > 0, f"a message from rank {s} to rank {d}")
                msg = q.popleft()
                with no_dispatch(), torch.no_grad():
                    buf = tensor._local_tensors[d] if isinstance(tensor, LocalTensor) else tensor
                    if buf.numel() != msg.value.numel() or buf.dtype != msg.value.dtype:
                        raise P2PGroupError(
                            f"recv on rank {d} from rank {s}: the receive buffer is "
                            f"{tuple(buf.shape)} {dtype_name(buf.dtype)} but rank {s} sent "
                            f"{tuple(msg.value.shape)} {dtype_name(msg.value.dtype)}; real ranks "
                            "need the same number of elements of the same dtype"
                        )
                    # Real ranks move the bytes: a (1,) buffer receives a 0-dim tensor (the
                    # warm-up of torch 2.11/2.12's pipeline schedules sends one).
                    buf.copy_(msg.value.reshape(buf.shape))
                    if isinstance(tensor, LocalTensor):
                        # The group's other ranks are simulated by other threads; here they mirror
                        # the receiver, so rank-independent code (a received size) stays consistent.
                        for r in g:
                            if r != d and r in tensor._local_tensors:
                                tensor._local_tensors[r].copy_(msg.value.reshape(buf.shape))
                got.append(msg)
            sim.on_recv(self.thread, got, id(tensor))
            done[0] = True
            return True

        return dist.distributed_c10d.Work.boxed(PythonCallbackWork(wait))


class P2PGroupError(RuntimeError):
    """A send or recv the threaded simulation cannot map onto its threads."""
