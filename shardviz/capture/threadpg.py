"""One thread per rank: where the ranks' collectives and messages meet (``sv.use("threads")``).

Each rank runs the user's code in a Python thread of its own, with plain tensors and plain ints:
it has its own fake process group (rank r of N) in a c10d world of its own, so ``dist.get_rank()``
is r, ``init_device_mesh`` builds the rank's mesh, and ``if rank == 0:`` means what it says. A
fake process group does nothing itself: every c10d and functional collective is dispatched, and
``MeetingMode`` takes it to the meeting point here. The k-th collective of each member of a group
meets the others' k-th; the last to arrive checks that all called the same collective (op,
reduction, root, shapes, dtypes, group) and computes every member's result with plain torch, the
reductions exactly as the lockstep simulator does them (same order, same bits). Sends are buffered
and receives wait for them, as on gloo.

Why shardviz's own meeting point rather than torch's threaded process group
(``multi_threaded_pg``): that one pairs whatever the ranks call at the same step without checking
it, has no point-to-point, and hangs on a deadlock. Here one rank runs at a time (a baton passed
when the running rank blocks or finishes, in rank order), which

- makes a run deterministic: the same program gives the same trace, event for event;
- keeps torch's process-wide state (the default generator, DTensor's caches, module hooks, the
  recorder's memos) free of races; each rank's generator state and ``RANK``/``WORLD_SIZE``
  environment are swapped in with the baton, as if each rank were a process of its own;
- turns a deadlock into an error at once: when the running rank blocks and no other rank can go
  on, none ever will, and every rank's position (op, group, source line) is known.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import queue
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import BackendError, DeadlockError, RankExitError, ShardvizError
from . import processes, stopping
from . import torch as _torch
from .meetings import (
    RUN,
    Call,
    CollectiveMismatchError,
    Meeting,
    Message,
    ThreadsUnsupportedError,
    dims,
    disagreement,
    done_work,
)
from .recorder import frames
from .recorder.specs import COLLECTIVES

__all__ = [
    "CollectiveMismatchError",
    "MeetingMode",
    "RankThreads",
    "current_rank",
]


class _Aborted(BaseException):
    """Raised in a rank's thread when another rank failed first: the run ends with that error.

    A BaseException, so that user code's ``except Exception`` does not swallow it."""


# --- where each thread stands ----------------------------------------------------------------

_local = threading.local()


def current_rank() -> int | None:
    """The rank whose thread this is, while it runs a job (None elsewhere)."""
    return getattr(_local, "rank", None) if getattr(_local, "busy", False) else None


def current_threads() -> RankThreads | None:
    return getattr(_local, "pool", None) if getattr(_local, "busy", False) else None


def current_mode() -> MeetingMode | None:
    """The rank's meeting mode, while it runs a job: the recorder hears from it."""
    return getattr(_local, "mode", None) if getattr(_local, "busy", False) else None


def rank_context() -> tuple[int, RankThreads] | None:
    """The rank (and its threads) whose code runs in this thread, for a thread it starts."""
    rank, pool = current_rank(), current_threads()
    return None if rank is None or pool is None else (rank, pool)


def adopt_rank_context(context: tuple[int, RankThreads]) -> None:
    """In a thread a rank started: it belongs to that rank (its printing, ``sv.show``, its rank)."""
    _local.rank, _local.pool = context
    _local.busy = True


def _rank_child() -> Callable[[], Any] | None:
    """In a rank's thread that starts a thread: what that thread runs first to be in the rank's
    world (``shardviz.capture.processes``)."""
    context = rank_context()
    if context is None:
        return None
    world = _torch.thread_world()
    guard = processes.guard(lockstep=False, rank=context[0])

    def setup() -> None:
        adopt_rank_context(context)
        _torch.enter_thread_world(world)
        guard()

    return setup


processes.register_kind("threads", _rank_child)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _where(frame: Any) -> str:
    src = frames.user_source(frame) if frame is not None else None
    return f", at line {src.line}: {src.text}" if src is not None else ""


# --- the scheduler -----------------------------------------------------------------------------


@dataclass(eq=False)
class _Wait:
    """What a blocked rank waits for: ``ready()`` once it can go on, ``what()`` in words,
    ``needs()`` the ranks that could make it ready, and the group of its collective (if one)."""

    ready: Callable[[], bool]
    what: Callable[[], str]
    needs: Callable[[], list[int]]
    group: tuple[int, ...] | None = None
    group_key: str | None = None


@dataclass
class _Job:
    fn: Callable[[int], Any]
    results: dict[int, Any] = field(default_factory=dict)


class RankThreads:
    """``world_size`` threads, one per rank, alive as long as the backend: each keeps its own c10d
    world (its default process group, its meshes' groups) and its own names from job to job.

    ``run(fn)`` calls ``fn(rank)`` in every rank's thread, one rank at a time, and returns each
    rank's value; the first error (a rank's exception, a deadlock, a mismatched collective) ends
    the run and is raised here, the other ranks stopped where they were.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        # One lock; the notebook's thread waits on ``cond``, each rank on its own condition, so
        # that a hand-over wakes the one rank whose turn it is, not every rank thread.
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        self._wake = [threading.Condition(lock) for _ in range(world_size)]
        self._inbox: list[queue.SimpleQueue[_Job | None]] = [queue.SimpleQueue() for _ in range(world_size)]
        self._clock = itertools.count()
        self._state: dict[int, tuple[Any, ...]] = {}  # each rank's process-wide torch state
        self._holding: int | None = None  # the rank whose state the process holds now
        self._env = {
            r: {
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "TORCH_DIST_INIT_BARRIER": "0",  # a store barrier would wait on this rank's own store
            }
            for r in range(world_size)
        }
        self._reset()
        start = _torch.process_state()  # every rank starts from the same state, as processes would
        for r in range(world_size):
            self._state[r] = _torch.rank_process_state(start)
        self._busy: set[int] = set()  # ranks whose thread is in a job (a stopped run's may still be)
        self.stop = stopping.Stop(_Aborted)
        _torch.settle_cuda_guard()
        self.closed = False
        self._threads: list[threading.Thread] = []
        try:
            for r in range(world_size):
                t = threading.Thread(target=self._main, args=(r,), name=f"shardviz-rank-{r}", daemon=True)
                t.start()
                self._threads.append(t)
        except RuntimeError as e:  # the OS refused a thread: end the ones started, then say so
            self._end_threads()
            raise BackendError(
                f"could not start the thread of rank {len(self._threads)} of {world_size} ({e}); the "
                f"{len(self._threads)} started are stopped again. This machine cannot run that many "
                "threads now: use a smaller world, or the lockstep simulator, which needs no thread "
                f"per rank: sv.use('local', world_size={world_size})"
            ) from e
        try:
            self.run(self._join_world)
        except BaseException:
            self.close()
            raise

    # --- state of one run ----------------------------------------------------------------------

    def _reset(self) -> None:
        self.turn: int | None = 0
        self.finished: set[int] = set()
        self.waiting: dict[int, _Wait] = {}
        self.error: BaseException | None = None
        self.error_rank: int | None = None
        self.meetings: dict[tuple[str, int], Meeting] = {}
        self.seqs: dict[tuple[int, str], int] = {}
        self.meeting_ids = itertools.count()
        self.message_ids = itertools.count()
        self.queues: dict[tuple[str, int, int, int], list[Message]] = {}
        self.messages: list[Message] = []
        self.idents: dict[int, int] = {}
        self.started: set[int] = set()
        self.positions: dict[int, str] = {}  # where each rank was when the run failed

    def tick(self) -> int:
        """The run's clock: events of all ranks are ordered by it."""
        return next(self._clock)

    # --- the threads -----------------------------------------------------------------------------

    def _join_world(self, rank: int) -> None:
        """Each rank's own default process group: rank ``rank`` of ``world_size``, a fake one
        (``_torch.rank_backend``) whose collectives this module carries out."""
        if not dist.is_initialized():
            hook = sys.excepthook  # init_process_group wraps it to tag tracebacks with a rank
            backend = _torch.rank_backend()
            dist.init_process_group(backend, rank=rank, world_size=self.world_size, store=dist.HashStore())
            sys.excepthook = hook

    def _leave_world(self, rank: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def _main(self, rank: int) -> None:
        _local.rank = rank
        _local.pool = self
        while True:
            try:
                job = self._inbox[rank].get()
                if job is None:
                    return
                self._serve(rank, job)
            except _Aborted:  # a stop that came as the job ended: the thread serves on
                continue

    def _serve(self, rank: int, job: _Job) -> None:
        cond = self.cond
        stopping.enrol(self.stop)
        try:
            with cond:
                self.idents[rank] = threading.get_ident()
                while self.turn != rank and self.error is None:
                    self._wake[rank].wait()
            if self.error is not None:
                raise _Aborted()
            self.started.add(rank)
            self._switch_in(rank)
            _local.busy = True
            try:
                with MeetingMode(self, rank) as mode:
                    _local.mode = mode
                    job.results[rank] = job.fn(rank)
            finally:
                _local.busy = False
                _local.mode = None
                self._switch_out(rank)
        except _Aborted:
            pass
        except BaseException as e:  # the rank's own error: the run ends with it
            with cond:
                self._fail(e, rank)
        finally:
            stopping.leave()
            self._settle(rank)

    def _settle(self, rank: int) -> None:
        """The rank's job is over: noted, and the baton passed on. A stop raised in this thread
        after its job ended (Ctrl-C as it finished) is taken back, or met here and retried, so
        that the bookkeeping always happens."""
        while True:
            try:
                with self.cond:
                    stopping.clear_pending(threading.get_ident())
                    self.finished.add(rank)
                    self.waiting.pop(rank, None)
                    self._busy.discard(rank)
                    self._pass_baton(rank)
                    self._notify()
                    self.cond.notify_all()  # the notebook's thread, waiting for the run's end
                return
            except _Aborted:
                continue

    def _fail(self, error: BaseException, rank: int | None) -> None:
        """With the lock held: the run ends with ``error`` (the first one only), and where every
        other rank stood is kept for the message."""
        if self.error is not None:
            return
        self.positions = {r: self.where(r) for r in range(self.world_size) if r != rank}
        self.error, self.error_rank = error, rank
        self.stop.set()  # a rank sleeping in time.sleep wakes and stops

    def _notify(self) -> None:
        """With the lock held, after the turn moved or the run failed: wake the rank whose turn it
        is (one thread), or, once the run failed, every rank, so that each stops."""
        if self.error is not None:
            for wake in self._wake:
                wake.notify()
        elif self.turn is not None:
            self._wake[self.turn].notify()

    def _switch_in(self, rank: int) -> None:
        """This rank takes the baton: its torch state (generator, default dtype, DTensor's op
        handlers) and its ``RANK``/``WORLD_SIZE`` environment come back."""
        _torch.restore_process_state(self._state[rank])
        os.environ.update(self._env[rank])
        self._holding = rank

    def _switch_out(self, rank: int) -> None:
        """This rank lets go: the process state is its own, kept for when it runs again (a rank
        stopped while waiting holds none, and keeps what it had)."""
        if self._holding == rank:
            self._state[rank] = _torch.process_state()
            self._holding = None

    def _next(self, rank: int) -> int | None:
        """The rank to run after ``rank`` stops: round robin, one not finished and not waiting for
        something that is not there. Deterministic, so runs and their traces are too."""
        n = self.world_size
        for k in range(1, n + 1):
            u = (rank + k) % n
            if u in self.finished:
                continue
            waiting = self.waiting.get(u)
            if waiting is None or waiting.ready():
                return u
        return None

    def _pass_baton(self, rank: int) -> None:
        """With the lock held, when ``rank`` finished: the next rank runs, or nobody can."""
        self.turn = self._next(rank)
        if self.turn is None and self.error is None and len(self.finished) < self.world_size:
            self._fail(DeadlockError(self._deadlock_text()), None)

    def block(self, rank: int, wait: _Wait) -> None:
        """Wait (letting other ranks run) until ``wait.ready()``."""
        if wait.ready():
            return
        cond = self.cond
        self._switch_out(rank)
        with cond:
            while not wait.ready():
                if self.error is not None:
                    raise _Aborted()
                self.waiting[rank] = wait
                nxt = self._next(rank)
                if nxt is None:
                    self._fail(DeadlockError(self._deadlock_text()), None)
                    self.turn = None
                    self._notify()
                    cond.notify_all()
                    raise _Aborted()
                self.turn = nxt
                self._notify()
                while self.turn != rank and self.error is None:
                    self._wake[rank].wait()
                self.waiting.pop(rank, None)
            if self.error is not None:
                raise _Aborted()
        self._switch_in(rank)

    def _frame(self, rank: int) -> Any:
        ident = self.idents.get(rank)
        return sys._current_frames().get(ident) if ident is not None else None

    def where(self, rank: int) -> str:
        """What a rank is doing now, for error messages."""
        if rank in self.waiting:
            return self.waiting[rank].what()
        if rank in self.finished:
            return "finished"
        if rank not in self.started:
            return "had not started"
        return f"running{_where(self._frame(rank))}"

    def _deadlock_text(self) -> str:
        lines = [
            "deadlock: no rank can go on, so on real process groups this program would hang here. "
            "Where each rank is:"
        ]
        for r in range(self.world_size):
            lines.append(f"  rank {r}: {self.where(r)}")
        for r in sorted(self.waiting):
            w = self.waiting[r]
            needs = w.needs()
            gone = [q for q in needs if q in self.finished]
            if gone:
                lines.append(
                    f"rank {r} waits for {_ranks(gone)}, which finished without taking part: a collective "
                    "or send that only some ranks call (code that branches on the rank around it)."
                )
            for q in needs:
                other = self.waiting.get(q)
                if other is None:
                    continue
                if w.group is not None and other.group is not None and other.group_key != w.group_key:
                    lines.append(
                        f"rank {r} waits for rank {q} in a collective over {list(w.group)}, but rank {q} "
                        f"is in one over {list(other.group)}: the ranks called collectives on different "
                        "groups at this step."
                    )
                elif q > r and r in other.needs():
                    lines.append(f"ranks {r} and {q} wait for each other.")
        lines.append(
            "Make every rank of a group call the same collectives in the same order, and every recv "
            "match a send (e.g. even ranks send first and odd ranks receive first, or use isend/irecv "
            "or batch_isend_irecv so that no rank blocks before its own sends)."
        )
        return "\n".join(lines)

    # --- running a job ---------------------------------------------------------------------------

    def run(self, fn: Callable[[int], Any]) -> dict[int, Any]:
        """``fn(rank)`` in every rank's thread; each rank's value, or the run's first error."""
        if self.closed:
            raise ShardvizError("these rank threads are closed; sv.use('threads', ...) makes new ones")
        if current_threads() is not None:
            raise ShardvizError(
                "sv.run and %%spmd cannot run inside a rank's own code under sv.use('threads'): the "
                "code already runs on every rank; call the function directly"
            )
        job = _Job(fn)
        self._wait_idle()
        main_state = _torch.process_state()
        saved_env = {k: os.environ.get(k) for k in self._env[0]}
        with self.cond:
            self._reset()
            self.stop = stopping.Stop(_Aborted)
            self._busy = set(range(self.world_size))
        try:
            with (
                _torch.thread_local_c10d(),
                _torch.tracking_meshes(),
                _torch.premul_sum_factors(),
                stopping.stoppable_sleeps(),
                processes.simulated_processes(),  # threads a rank starts are in its world
            ):
                for box in self._inbox:
                    box.put(job)
                try:
                    self._wait_all()
                except KeyboardInterrupt as e:  # the run ends with it (``_failure``)
                    self._stop_on(e)
        finally:
            _torch.restore_process_state(main_state)
            for k, v in saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        if self.error is not None:
            raise self._failure()
        return job.results

    def _wait_all(self) -> None:
        with self.cond:
            while len(self.finished) < self.world_size:
                self.cond.wait(0.1)

    def _stop_on(self, error: KeyboardInterrupt) -> None:
        """Ctrl-C: the ranks stop at their next line of Python (a sleep at once); one in a call
        Python cannot interrupt is left to end it, and named. A second Ctrl-C stops the waiting."""
        with contextlib.suppress(KeyboardInterrupt), self.cond:
            self._interrupt(error)
            deadline = time.monotonic() + STOP_WAIT
            while len(self.finished) < self.world_size and time.monotonic() < deadline:
                self.cond.wait(0.05)

    def _interrupt(self, error: KeyboardInterrupt) -> None:
        """Ctrl-C in the notebook: the rank that runs is stopped at its next line of Python (a
        sleep at once), and the others, which wait for their turn, with it."""
        self._fail(error, None)
        running = self.turn
        self._notify()
        self.cond.notify_all()
        if running is not None and running not in self.finished:
            ident = self.idents.get(running)
            if ident is not None:
                stopping.raise_in(ident, _Aborted)

    def _wait_idle(self) -> None:
        """Before a run: every rank thread is back from the last one (after Ctrl-C, one that was
        in a call Python cannot interrupt may still be there for a while)."""
        deadline = time.monotonic() + IDLE_WAIT
        with self.cond:
            while self._busy and time.monotonic() < deadline:
                self.cond.wait(0.05)
            if self._busy:
                where = "; ".join(f"rank {r}: {self.where(r)}" for r in sorted(self._busy))
                raise BackendError(
                    f"{_ranks(sorted(self._busy))} of the run stopped by Ctrl-C still "
                    f"{'runs' if len(self._busy) == 1 else 'run'} a call Python cannot interrupt ({where}), "
                    "so no new run can start on these threads. Wait for it to end, or call "
                    "sv.restart() for new rank threads."
                )

    def _failure(self) -> BaseException:
        e = self.error
        assert e is not None
        if isinstance(e, DeadlockError | CollectiveMismatchError):
            return e  # the meeting point's own errors name every rank already
        if isinstance(e, KeyboardInterrupt):
            where = "\n".join(f"  rank {r}: {self.positions.get(r, '?')}" for r in range(self.world_size))
            note = f"stopped by Ctrl-C (sv.use('threads')); where each rank was:\n{where}"
            left = [r for r in range(self.world_size) if r not in self.finished]
            if left:
                note += (
                    f"\n{_ranks(left)} had not stopped {STOP_WAIT:g} s later (in a call Python cannot "
                    "interrupt: a long torch op, a lock, I/O); the next run waits for it, and "
                    "sv.restart() starts new rank threads."
                )
            e.add_note(note)
            return e
        rank = self.error_rank
        others = [f"  rank {r}: {self.positions.get(r, '?')}" for r in range(self.world_size) if r != rank]
        if isinstance(e, SystemExit) and rank is not None:
            e = _exit_error(e, rank, self.world_size, "sv.use('threads')")
        note = f"raised on rank {rank} of {self.world_size} (sv.use('threads')); the run stopped there."
        if others:
            note += " The other ranks:\n" + "\n".join(others)
        e.add_note(note)
        return e

    def close(self) -> None:
        """Leave every rank's process group and end the threads (a thread still in a call Python
        cannot interrupt is not waited for: it ends with that call)."""
        if self.closed:
            return
        with contextlib.suppress(BaseException):
            self.run(self._leave_world)
        self.closed = True
        self._end_threads()

    def _end_threads(self) -> None:
        for r in range(len(self._threads)):
            self._inbox[r].put(None)
        stopping.wait_ended(
            [t for r, t in enumerate(self._threads) if r not in self._busy], time.monotonic() + 5
        )

    # --- meeting ---------------------------------------------------------------------------------

    def collective(self, call: Call) -> Any:
        """``call``'s part in its group's collective; returns what the op returns on this rank."""
        key = (call.group_key, call.seq)
        m = self.meetings.get(key)
        if m is None:
            m = self.meetings[key] = Meeting(key, call.group)
        for other in m.calls.values():
            why = disagreement(other, call)
            if why is not None:
                raise CollectiveMismatchError(self._mismatch_text(m, call, why))
        m.calls[call.rank] = call
        call.frame = sys._getframe(1)
        if len(m.calls) == len(m.group) and all(r in m.calls for r in m.group):
            calls = [m.calls[r] for r in m.group]
            with _torch.no_dispatch(), torch.no_grad():
                results = RUN[call.spec.op](calls)
            m.results = {c.rank: res for c, res in zip(calls, results, strict=True)}
            m.id = next(self.meeting_ids)
            m.stamp = self.tick()
            del self.meetings[key]
        else:
            self.block(
                call.rank,
                _Wait(
                    lambda: m.results is not None,
                    lambda: self._waiting_text(m, call),
                    lambda: [r for r in m.group if r not in m.calls],
                    m.group,
                    call.group_key,
                ),
            )
        call.frame = None
        assert m.results is not None and m.id is not None
        return m, m.results[call.rank]

    def _waiting_text(self, m: Meeting, call: Call) -> str:
        missing = [r for r in m.group if r not in m.calls]
        return (
            f"in {call.describe()} over ranks {list(m.group)} (its {_ordinal(call.seq)} collective on "
            f"that group){_where(call.frame)}; waiting for {_ranks(missing)}"
        )

    def _mismatch_text(self, m: Meeting, call: Call, why: str) -> str:
        lines = [
            f"mismatched collective: ranks of the group {list(m.group)} met at their "
            f"{_ordinal(call.seq)} collective on it with {why}. On real process groups this would hang "
            "or mix up data:"
        ]
        for c in sorted([*m.calls.values(), call], key=lambda c: c.rank):
            frame = c.frame if c is not call else sys._getframe(2)
            lines.append(f"  rank {c.rank}: {c.describe()}{_where(frame)}")
        lines.append(
            "Every rank of a group must call the same collectives, with the same shapes and dtypes, in "
            "the same order (code that branches on the rank around a collective breaks this)."
        )
        return "\n".join(lines)

    def send(
        self, rank: int, tensor: torch.Tensor, group: tuple[int, ...], group_key: str, dst: int, tag: int
    ) -> Message:
        with _torch.no_dispatch(), torch.no_grad():
            value = tensor.detach().clone()
        msg = Message(next(self.message_ids), rank, dst, tag, group, group_key, value, self.tick())
        self.queues.setdefault((group_key, rank, dst, tag), []).append(msg)
        self.messages.append(msg)
        return msg

    def recv(
        self,
        rank: int,
        buf: torch.Tensor,
        group: tuple[int, ...],
        group_key: str,
        src: int,
        tag: int,
        frame: Any,
    ) -> Message:
        q = self.queues.setdefault((group_key, src, rank, tag), [])

        def what() -> str:
            return (
                f"in recv from rank {src} (tag {tag}, group {list(group)}){_where(frame)}; nothing was sent"
            )

        self.block(rank, _Wait(lambda: bool(q), what, lambda: [src]))
        msg = q.pop(0)
        if buf.numel() != msg.value.numel() or buf.dtype != msg.value.dtype:
            raise CollectiveMismatchError(
                f"recv on rank {rank} from rank {src}: the receive buffer is {dims(buf)} but rank {src} "
                f"sent {dims(msg.value)}; real process groups need the same number of elements of "
                f"the same dtype{_where(frame)}"
            )
        with _torch.no_dispatch(), torch.no_grad():
            buf.copy_(msg.value.reshape(buf.shape))  # the bytes, as real ranks move them
        msg.received = True
        msg.stamp = self.tick()
        return msg


STOP_WAIT = 1.0  # seconds a Ctrl-C waits for the ranks to stop
IDLE_WAIT = 3.0  # seconds a run waits for a stopped run's threads


def _exit_error(error: SystemExit, rank: int, world_size: int, where: str) -> RankExitError:
    """A rank's ``sys.exit`` as an error naming the rank, the exit code and the line: raised as it
    is, it would end the notebook's script with that status (0: as if all went well)."""
    frames = traceback.extract_tb(error.__traceback__)
    at = f" at line {frames[-1].lineno} of {frames[-1].filename}: {frames[-1].line}" if frames else ""
    out = RankExitError(
        f"rank {rank} of {world_size} ({where}) called sys.exit({error.code!r}){at}. A real rank's "
        "process would end there and the others would wait for it; here the run stops, and the "
        "kernel or script goes on. (os._exit in a rank ends the whole process: the notebook's "
        "kernel with it.)",
        rank=rank,
        code=error.code,
    )
    out.__cause__ = error
    return out


def _ranks(ranks: Sequence[int]) -> str:
    rs = list(ranks)
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(str(r) for r in rs)


# --- the dispatch mode -------------------------------------------------------------------------

_COMM_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem")
_PASS = ("wait_tensor", "_wrap_tensor_autograd")


class MeetingMode(_torch.TorchDispatchMode):
    """Entered in each rank's thread under everything else: carries out the rank's collectives
    and point-to-point ops at the meeting point; every other op runs as it is."""

    def __init__(self, pool: RankThreads, rank: int) -> None:
        super().__init__()
        self.pool = pool
        self.rank = rank
        # What the recorder learns of each op: ("meeting" | "send", id, the run's clock then,
        # id() of the tensor sent, or None).
        self.on_meeting: Callable[[str, int, int, int | None], None] | None = None
        self.on_recv: Callable[[Message], None] | None = None  # set by the recorder for one recv

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        entry = COLLECTIVES.get(func)
        if entry is None:
            if func.namespace in _COMM_NAMESPACES and func.__name__.split(".")[0] not in _PASS:
                raise ThreadsUnsupportedError(
                    f"{func} is a communication op the threads simulator does not carry out; it would "
                    "silently do nothing on the rank's fake process group. Use the c10d or functional "
                    "collectives (torch.distributed.*, DTensor), or run this code on sv.use('gloo')."
                )
            return func(*args, **kwargs)
        spec, impl, names = entry
        bound = dict(zip(names, args, strict=False))
        bound.update(kwargs)
        group = bound.get(spec.group)
        ranks = tuple(_torch.process_group_ranks(group))
        gkey = _torch.process_group_key(group)
        if spec.op == "send":
            return self._send(bound, ranks, gkey)
        if spec.op == "recv":
            return self._recv(impl, bound, ranks, gkey)
        seq_key = (self.rank, gkey)
        seq = self.pool.seqs[seq_key] = self.pool.seqs.get(seq_key, 0) + 1
        call = Call(self.rank, spec, impl, bound, ranks, gkey, seq)
        if call.reduce() == "premul_sum":
            call.factor = _torch.premul_factor(bound["reduce_op"])
        meeting, out = self.pool.collective(call)
        if self.on_meeting is not None:
            self.on_meeting("meeting", meeting.id, meeting.stamp, None)
        return out

    def _send(self, bound: dict[str, Any], group: tuple[int, ...], gkey: str) -> Any:
        (tensor,) = bound["tensors"]
        dst = group[int(bound["dst"])]
        msg = self.pool.send(self.rank, tensor, group, gkey, dst, int(bound.get("tag", 0)))
        if self.on_meeting is not None:
            self.on_meeting("send", msg.id, msg.stamp, id(tensor))
        return done_work()

    def _recv(self, impl: str, bound: dict[str, Any], group: tuple[int, ...], gkey: str) -> Any:
        if impl.startswith("c10d.recv_any_source"):
            raise ThreadsUnsupportedError(
                "recv from any source (dist.recv(t) without src) is not simulated: pass src=<rank>"
            )
        (buf,) = bound["tensors"]
        src = group[int(bound["src"])]
        tag = int(bound.get("tag", 0))
        hook, self.on_recv = self.on_recv, None
        frame = sys._getframe(1)
        pool, rank = self.pool, self.rank
        done: list[Message] = []

        def wait(timeout: Any = None) -> bool:
            if not done:
                done.append(pool.recv(rank, buf, group, gkey, src, tag, frame))
                if hook is not None:
                    hook(done[0])
            return True

        return _torch.callback_work(wait)
