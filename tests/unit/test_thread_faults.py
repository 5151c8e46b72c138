"""Fault injection: the threads backend (``sv.use("threads")``) and the lockstep simulator's
threaded runs (``sv.run(fn, threads=N)``) under a rank that raises, exits, spins, sleeps or waits in
a call Python cannot interrupt, one and two Ctrl-Cs, mismatched collectives and worlds larger than
the machine. Each case asserts: a named error (the rank or thread, and its line) within 2 s of the
fault or the Ctrl-C; no thread left behind; and the next run right (values written by hand).

Ctrl-C is a real SIGINT sent to the main thread once the faulty rank is where the case wants it."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import shardviz as sv
from shardviz.backends import choose
from shardviz.capture.threadpg import CollectiveMismatchError
from shardviz.errors import BackendError, P2PError, RankExitError

N = 4
FAULT_SECONDS = 2.0  # a named error within this long of the fault or the Ctrl-C


@pytest.fixture(params=["threads", "lockstep"])
def kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Both simulators, warmed up (the first run imports what a run needs: seconds on a busy CI)."""
    if request.param == "threads":
        sv.use("threads", world_size=N)
        sv.run(lambda: None)
    else:
        sv.use("local", world_size=N)
        sv.run(lambda t: None, threads=2)
    yield request.param
    sv.use("local", world_size=N)


def run(kind: str, fault: Callable[[int], Any]) -> Any:
    """``fault(rank)`` on every rank: each of the 4 ranks under threads, each of 2 threads (the
    second stands for ranks 2 and 3) in a lockstep threaded run; rank 1 / thread 1 misbehaves."""
    if kind == "threads":
        return sv.run(lambda: fault(dist.get_rank()))
    return sv.run(fault, threads=2)


def patched_now() -> list[Any]:
    """What the globals a LocalTensorMode patches while it is on are now (plain torch's, outside one)."""
    names = ("get_coordinate", "get_local_rank", "get_rank", "_is_current_rank_part_of_mesh")
    return [dist.get_rank, torch.manual_seed, *(getattr(DeviceMesh, n, None) for n in names)]


def next_run_is_right(kind: str) -> None:
    """A collective right after the fault: an all_reduce of each rank's rank + 1 over 4 ranks is 10."""
    if kind == "threads":

        def total() -> float:
            x = torch.tensor([float(dist.get_rank() + 1)])
            dist.all_reduce(x)
            return x.item()

        trace = sv.run(total)
        assert trace.results == {r: 10.0 for r in range(N)}
    else:

        def total_of(t: int) -> Any:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
            x = sv.per_rank(lambda r: torch.tensor([float(r + 1)]))
            dist.all_reduce(x, group=mesh.get_group("tp"))  # inside each thread's ranks: [0, 1], [2, 3]
            return x

        trace = sv.run(total_of, threads=2)
        assert {r: trace.results[r].item() for r in range(N)} == {0: 3.0, 1: 3.0, 2: 7.0, 3: 7.0}
    assert trace.complete


class CtrlC:
    """Sends SIGINT to the main thread ``times`` times once ``ready`` is set (the faulty rank is in
    place), ``gap`` seconds apart; a Ctrl-C that arrives after the run ended is absorbed."""

    def __init__(self, times: int = 1, gap: float = 0.3) -> None:
        self.ready = threading.Event()
        self.sent: float | None = None
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._go, args=(times, gap), daemon=True)
        self._thread.start()

    def _go(self, times: int, gap: float) -> None:
        if not self.ready.wait(30):
            return
        time.sleep(0.2)  # into its loop, sleep or wait
        self.sent = time.monotonic()
        for i in range(times):
            assert self._main is not None
            signal.pthread_kill(self._main, signal.SIGINT)
            if i + 1 < times:
                time.sleep(gap)

    def finish(self) -> None:
        while True:
            try:
                self._thread.join()
                time.sleep(0.05)  # a signal still on its way is handled here
                return
            except KeyboardInterrupt:
                continue


def threads_now() -> set[threading.Thread]:
    return set(threading.enumerate())


def no_thread_left(before: set[threading.Thread], grace: float = 0.5) -> None:
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and threads_now() - before:
        time.sleep(0.02)
    assert not (threads_now() - before), f"threads left: {threads_now() - before}"


def where_of(kind: str) -> str:
    return "rank 1: running, at line" if kind == "threads" else "thread 1 (ranks 2, 3): running, at line"


# --- a rank that fails on its own ------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_rank_that_raises(kind):
    def fault(rank: int) -> None:
        if rank == 1:
            raise ValueError("bad batch")

    before = threads_now()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="bad batch") as info:
        run(kind, fault)
    assert time.monotonic() - t0 < FAULT_SECONDS
    note = "\n".join(info.value.__notes__)
    assert ("raised on rank 1 of 4" if kind == "threads" else "raised on thread 1 (ranks 2, 3)") in note
    no_thread_left(before)
    next_run_is_right(kind)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", [0, 3, "bye"])
def test_a_rank_that_calls_sys_exit_is_a_named_error_and_the_process_goes_on(kind, code):
    def fault(rank: int) -> None:
        if rank == 1:
            sys.exit(code)

    before = threads_now()
    t0 = time.monotonic()
    with pytest.raises(RankExitError) as info:
        run(kind, fault)
    assert time.monotonic() - t0 < FAULT_SECONDS
    err = info.value
    assert isinstance(err.__cause__, SystemExit) and err.code == code
    assert err.rank == (1 if kind == "threads" else 2)
    assert f"called sys.exit({code!r}) at line" in str(err) and "sys.exit(code)" in str(err)
    assert "os._exit" in str(err)
    no_thread_left(before)
    next_run_is_right(kind)


@pytest.mark.timeout(60)
def test_mismatched_collectives_are_named(kind):
    if kind == "threads":

        def fault(rank: int) -> None:
            if rank == 1:
                dist.all_gather([torch.zeros(2) for _ in range(N)], torch.ones(2))
            else:
                dist.all_reduce(torch.ones(2))

        error: type[BaseException] = CollectiveMismatchError
        named = "rank 1: all_gather of float32[2]"
    else:

        def fault(t: int) -> None:  # a receive buffer that is not what was sent
            group = dist.new_group([0, 2])
            if t == 0:
                dist.send(sv.per_rank(lambda r: torch.ones(2)), 2, group=group)
            else:
                dist.recv(sv.per_rank(lambda r: torch.zeros(3)), 0, group=group)

        error, named = P2PError, "recv on rank 2 from rank 0: the receive buffer is (3,)"
    before = threads_now()
    t0 = time.monotonic()
    with pytest.raises(error) as info:
        run(kind, fault)
    assert time.monotonic() - t0 < FAULT_SECONDS
    assert named in str(info.value)
    no_thread_left(before)
    next_run_is_right(kind)


# --- Ctrl-C ----------------------------------------------------------------------------------


def _spin(ready: threading.Event) -> Callable[[int], None]:
    def fault(rank: int) -> None:
        if rank == 1:
            ready.set()
            n = 0
            while True:  # a Python loop that never reaches an operator
                n += 1

    return fault


def _sleep(ready: threading.Event) -> Callable[[int], None]:
    def fault(rank: int) -> None:
        if rank == 1:
            ready.set()
            time.sleep(30)

    return fault


def _spin_catching(ready: threading.Event) -> Callable[[int], None]:
    def fault(rank: int) -> None:
        if rank == 1:
            ready.set()
            while True:
                try:
                    time.sleep(0.01)
                except Exception:  # user code that swallows errors does not swallow the stop
                    pass

    return fault


@pytest.mark.timeout(60)
@pytest.mark.parametrize("behaviour", [_spin, _sleep, _spin_catching])
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_a_rank_that_spins_or_sleeps(kind, behaviour, presses):
    before = threads_now()
    ctrl_c = CtrlC(presses, gap=0.05)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            run(kind, behaviour(ctrl_c.ready))
        caught = time.monotonic()
    finally:
        ctrl_c.finish()
    assert ctrl_c.sent is not None and caught - ctrl_c.sent < FAULT_SECONDS
    note = "\n".join(info.value.__notes__)
    assert "stopped by Ctrl-C" in note and where_of(kind) in note
    if kind == "threads":
        assert "rank 0: in all_reduce" not in note  # rank 0 finished first in this case
        assert "rank 2: had not started" in note
    assert "had not stopped" not in note
    no_thread_left(before)
    next_run_is_right(kind)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_while_a_rank_is_in_a_call_python_cannot_interrupt(kind, presses):
    """A rank blocked in a C call (a lock, here) cannot stop at once: the run still ends within
    the bound, names it, and the next run waits for it and is right (two Ctrl-Cs used to leave the
    ranks in two runs at once: the next run lost rank 1's result or raised a false DeadlockError)."""
    lock = threading.Lock()
    lock.acquire()

    def fault(rank: int) -> None:
        if rank == 1:
            threading.Timer(1.8, lock.release).start()  # the call ends 1.8 s after it began
            ctrl_c.ready.set()
            lock.acquire()  # a blocking C call, on purpose
            lock.release()

    before = threads_now()
    ctrl_c = CtrlC(presses, gap=0.3)
    try:
        with pytest.raises(KeyboardInterrupt) as info:
            run(kind, fault)
        caught = time.monotonic()
    finally:
        ctrl_c.finish()
    assert ctrl_c.sent is not None and caught - ctrl_c.sent < FAULT_SECONDS
    note = "\n".join(info.value.__notes__)
    assert "stopped by Ctrl-C" in note and "lock.acquire()" in note
    assert "had not stopped 1 s later" in note
    next_run_is_right(kind)  # waits for the lock's holder to let go, then runs as it should
    no_thread_left(before, grace=2.0)


@pytest.mark.timeout(60)
def test_a_run_after_a_rank_that_does_not_stop_is_refused_until_it_does(kind, monkeypatch):
    """The next run waits for a rank still in an uninterruptible call only so long (here 0.3 s),
    then says so; once the call ends, runs are right again."""
    monkeypatch.setattr("shardviz.capture.threadpg.IDLE_WAIT", 0.3)
    monkeypatch.setattr("shardviz.capture.torch.p2p_runner.SETTLE_WAIT", 0.3)
    lock = threading.Lock()
    lock.acquire()
    released = threading.Event()

    def fault(rank: int) -> None:
        if rank == 1:
            ctrl_c.ready.set()
            lock.acquire()  # a blocking C call, on purpose
            lock.release()

    before_patch = patched_now()
    before = threads_now()
    ctrl_c = CtrlC()
    try:
        with pytest.raises(KeyboardInterrupt):
            run(kind, fault)
    finally:
        ctrl_c.finish()
    with pytest.raises(BackendError, match=r"(rank|thread) 1 .*cannot interrupt") as info:
        next_run_is_right(kind)
    assert "lock.acquire()" in str(info.value)
    threading.Timer(0.1, lambda: (lock.release(), released.set())).start()
    assert released.wait(10)
    # Once the straggler has ended, nothing it ran under stays patched for what runs next. On torch
    # >= 2.15 its leaving wrote another thread's LocalTensorMode ``dist.get_rank`` back, and every
    # sv.use('threads') run after it failed with "Unexpectedly not in LocalTensorMode".
    no_thread_left(before, grace=10)
    sv.use("threads", world_size=N)
    assert sv.run(lambda: dist.get_rank()).results == {r: r for r in range(N)}
    assert patched_now() == before_patch
    sv.use("local" if kind == "lockstep" else "threads", world_size=N)
    next_run_is_right(kind)


# --- worlds larger than the machine ----------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["threads", "local"])
def test_a_world_larger_than_the_machine_is_refused_before_anything_starts(name):
    before = threads_now()
    old = choose.current()
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"cannot run on this machine, so nothing was started") as info:
        sv.use(name, world_size=10**7)
    assert time.monotonic() - t0 < FAULT_SECONDS
    text = str(info.value)
    assert "10,000,000" in text and "check_capacity=False" in text
    assert ("threads, and the OS allows about" in text) == (name == "threads")
    assert choose.current() is old  # the backend in use stays
    no_thread_left(before)
    sv.use("local", world_size=4096)  # a world that fits, with more threads than it can hold
    with pytest.raises(BackendError, match=r"sv\.run\(fn, threads=4,096\) needs at least") as info:
        sv.run(lambda t: None, threads=4096)
    assert "sv.use('local', world_size=4096, check_capacity=False) first" in str(info.value)
    no_thread_left(before)


@pytest.mark.timeout(60)
def test_a_start_the_os_refuses_leaves_no_thread_behind(monkeypatch):
    """With the check skipped, the OS refusing the 4th thread (``can't start new thread``, as past
    its limit) stops the 3 started and says so; the next start is right."""
    sv.use("local", world_size=N)
    before = threads_now()
    start = threading.Thread.start
    count = [0]

    def refusing(self: threading.Thread) -> None:
        count[0] += 1
        if count[0] > 3:
            raise RuntimeError("can't start new thread")
        start(self)

    monkeypatch.setattr(threading.Thread, "start", refusing)
    with pytest.raises(
        BackendError, match=r"could not start the thread of rank 3 of 64 .*3 started are stopped"
    ):
        sv.use("threads", world_size=64, check_capacity=False)
    count[0] = 0
    with pytest.raises(BackendError, match=r"the OS refused to start a thread .* after 3 had started"):
        sv.run(lambda t: None, threads=4)
    monkeypatch.undo()
    no_thread_left(before)
    assert choose.current().key() == ("local", N)
    sv.use("threads", world_size=N)
    next_run_is_right("threads")
    sv.use("local", world_size=N)
    next_run_is_right("lockstep")
