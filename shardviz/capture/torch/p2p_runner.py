"""Point-to-point in the simulator: runner threads, one LocalTensorMode each, and the dispatch
mode that moves sends and receives between them."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .c10d import fake_work, p2p_groups, process_group_desc
from .gate import LocalTensor, TorchDispatchMode, _private
from .modes import new_local_mode, no_dispatch
from .tensors import dtype_name

# Torch's own send/recv under LocalTensorMode (``local_p2p_op``) maps ranks wrongly on groups other
# than WORLD, replaces buffers instead of writing into them and hangs on a deadlock. Here N threads
# run under torch's LocalRunnerMode (one at a time), each with its own LocalTensorMode over the
# whole world; ``P2PMode`` on top of it moves the messages itself. Plain data out through hooks.


class P2PStuck(RuntimeError):
    """Every thread of a threaded simulation is finished or waiting for a message nobody sends."""


class P2PAborted(RuntimeError):
    """This thread stopped because another thread of the run failed first."""


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
        self._runner: Any = None
        self._local = threading.local()

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

        saved = _patched_globals()
        dist.distributed_c10d._check_not_self_rank = lambda *a, **k: None  # the fake PG is rank 0
        cond_box: list[Any] = []

        def main(t: int) -> None:
            try:
                body(t)
            except BaseException as e:
                if self.error is None and not isinstance(e, P2PAborted):
                    self.error = e
                cond_box[0].notify_all()

        def body(t: int) -> None:
            self._local.thread = t
            cond = cond_box[0]
            self._await_turn(t)
            self.check_stop()  # a thread that started late, after Ctrl-C, enters no mode
            try:
                with new_local_mode(self.world_size):
                    try:
                        with setup(t) if setup is not None else contextlib.nullcontext(), P2PMode(self, t):
                            self.results[t] = fn(t)
                    except BaseException as e:
                        if self.error is None and not isinstance(e, P2PAborted):
                            self.error = e
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
        runner = LocalRunnerMode(self.world_size, self.threads, main)
        cond_box.append(runner._run_cond)
        self._runner = runner
        try:
            try:
                runner.__enter__()  # starts the threads
                self._join(runner)
            except BaseException as e:
                # Ctrl-C (a KeyboardInterrupt here, in the calling thread) while the runners run:
                # they stop at their next operator or wait, and are joined before the globals they
                # run under are reset, so that a later run starts clean.
                self.interrupted = e
                self._join(runner)
                raise
        finally:
            # Not LocalRunnerMode.__exit__: it re-raises the first thread's error before resetting
            # its globals and leaves the other threads unjoined.
            if getattr(ltm_mod, "_LOCAL_RUNNER_MODE", None) is runner:
                ltm_mod._LOCAL_RUNNER_MODE = None
            ltm_mod._PROCESS_MODE = process_mode
            _restore_globals(saved)
        if self.error is not None:
            raise self.error
        return self.results

    @staticmethod
    def _join(runner: Any) -> None:
        """Wait for every runner thread that was started (a KeyboardInterrupt can come while
        ``LocalRunnerMode`` starts them)."""
        for thread in runner._runners:
            if thread.ident is not None:
                threading.Thread.join(thread)

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
                    if tuple(buf.shape) != tuple(msg.value.shape) or buf.dtype != msg.value.dtype:
                        raise P2PGroupError(
                            f"recv on rank {d} from rank {s}: the receive buffer is "
                            f"{tuple(buf.shape)} {dtype_name(buf.dtype)} but rank {s} sent "
                            f"{tuple(msg.value.shape)} {dtype_name(msg.value.dtype)}; "
                            "they must match, as on real ranks"
                        )
                    buf.copy_(msg.value)
                    if isinstance(tensor, LocalTensor):
                        # The group's other ranks are simulated by other threads; here they mirror
                        # the receiver, so rank-independent code (a received size) stays consistent.
                        for r in g:
                            if r != d and r in tensor._local_tensors:
                                tensor._local_tensors[r].copy_(msg.value)
                got.append(msg)
            sim.on_recv(self.thread, got, id(tensor))
            done[0] = True
            return True

        return dist.distributed_c10d.Work.boxed(PythonCallbackWork(wait))


class P2PGroupError(RuntimeError):
    """A send or recv the threaded simulation cannot map onto its threads."""
