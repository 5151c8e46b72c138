"""Each simulated rank is a process of its own for what it starts and holds (issue 32): threads and
executors it starts run in its world, process-wide registries (global module hooks, the
environment, the intra-op thread count) are its own, an async collective's future holds its
tensors; what the simulator cannot give a started thread is refused by name. In the lockstep
simulator: executor tasks run inside the simulation, started threads are refused there, the
launcher's environment is what it can honestly be, and torch's visualize_sharding prints what rank
0 prints.

Expectations are hand-written values, plain torch on the whole tensor, or what the same code gives
on real ranks (measured on gloo, and compared there in tests/cluster/test_real_code_gloo.py).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.debug import visualize_sharding

import shardviz as sv
from shardviz.capture.processes import SimulatedThreadError
from shardviz.errors import PerRankValueError

N = 4
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def threads():
    sv.use("threads", world_size=N)
    yield
    sv.use("local", world_size=N)


@pytest.fixture
def lockstep():
    sv.use("local", world_size=N)
    yield


# --- executors ------------------------------------------------------------------------------------


def _executor_job():
    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        sizes = list(pool.map(lambda _: dist.get_world_size(), range(3)))
        rank = pool.submit(dist.get_rank).result()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        coords = pool.submit(lambda: (mesh.get_local_rank("dp"), mesh.get_local_rank("tp"))).result()
        t = torch.full((2,), float(rank + 1))
        pool.submit(dist.all_reduce, t).result()  # a collective in a task: the rank's own
    return sizes, rank, coords, t


def test_an_executor_of_a_rank_runs_in_that_ranks_world(threads):
    # Before: "Could not resolve the process group registered under the name 0" (the task's thread
    # had no process group). On real ranks the task sees its process's.
    trace = sv.run(_executor_job)
    for r in range(N):
        sizes, rank, coords, t = trace.results[r]
        assert sizes == [N] * 3 and rank == r and coords == (r // 2, r % 2)
        assert t.tolist() == [10.0, 10.0]  # 1 + 2 + 3 + 4
    (reduce,) = [c for c in trace.collectives() if c.op == "all_reduce"]
    assert reduce.groups == ((0, 1, 2, 3),)
    # the same every run: tasks run in the rank's turn, in submission order
    again = sv.run(_executor_job)
    assert [(e.kind, getattr(e, "op", None)) for e in again.events] == [
        (e.kind, getattr(e, "op", None)) for e in trace.events
    ]


def test_an_executor_tasks_error_is_its_futures(threads):
    def fn():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(lambda: 1 / 0)
            assert future.done() and isinstance(future.exception(), ZeroDivisionError)
            with pytest.raises(ZeroDivisionError):
                future.result()
            pool.shutdown()
            with pytest.raises(RuntimeError, match="after shutdown"):
                pool.submit(print)
        return "ok"

    assert sv.run(fn).results == dict.fromkeys(range(N), "ok")


def test_lockstep_runs_executor_tasks_inside_the_simulation(lockstep):
    # Before: the task's thread ran the simulated tensors outside LocalTensorMode (a different
    # error on each run, or a silently wrong value).
    def fn():
        t = sv.per_rank(lambda r: torch.full((2,), float(r + 1)))
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            pool.submit(dist.all_reduce, t).result()
            doubled = pool.submit(lambda: t * 2).result()
        return doubled

    trace = sv.run(fn)
    for r in range(N):
        assert trace.results[r].tolist() == [20.0, 20.0]
    assert [c.op for c in trace.collectives()] == ["all_reduce"]


# --- threads a rank starts ------------------------------------------------------------------------


def test_a_thread_a_rank_starts_is_in_that_ranks_world(threads, capsys):
    def fn():
        seen = []

        def child():
            mesh = init_device_mesh("cpu", (N,))
            seen.append((dist.get_rank(), dist.get_world_size(), mesh.size(), os.environ["RANK"]))
            print("from the child")

        t = threading.Thread(target=child)
        t.start()
        t.join()
        return seen

    trace = sv.run(fn)
    for r in range(N):
        assert trace.results[r] == [(r, N, N, str(r))]
    out = capsys.readouterr().out
    assert all(f"[rank {r}] from the child" in out for r in range(N))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_collective_in_a_thread_a_rank_started_is_refused(threads):
    def fn():
        errors = []

        def child():
            try:
                dist.all_reduce(torch.ones(2))
            except SimulatedThreadError as e:
                errors.append(e)
                raise

        t = threading.Thread(target=child)
        t.start()
        t.join()
        return len(errors)

    with pytest.raises(SimulatedThreadError, match=r"a thread that rank \d started called c10d") as info:
        sv.run(fn)
    assert "rank's own thread" in str(info.value) and "ThreadPoolExecutor" in str(info.value)


def _in_a_thread(work):
    def fn():
        out = []
        t = threading.Thread(target=lambda: out.append(work()))
        t.start()
        t.join()
        return out

    return fn


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_a_rank_started_draws_only_from_its_own_generator(threads):
    def own():
        return torch.rand(2, generator=torch.Generator().manual_seed(dist.get_rank()))

    trace = sv.run(_in_a_thread(own))
    for r in range(N):
        (drawn,) = trace.results[r]
        assert torch.equal(drawn, torch.rand(2, generator=torch.Generator().manual_seed(r)))
    # the process's default generator holds whichever rank runs at that moment: refused
    with pytest.raises(SimulatedThreadError, match="default generator"):
        sv.run(_in_a_thread(lambda: torch.rand(2)))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_thread_started_in_lockstep_is_refused_on_simulated_tensors(lockstep):
    with pytest.raises(SimulatedThreadError, match="lockstep simulator") as info, sv.record():
        t = sv.per_rank(lambda r: torch.full((2,), float(r)))
        worker = threading.Thread(target=lambda: t + 1)
        worker.start()
        worker.join()
    assert "sv.use('threads'" in str(info.value)
    # a thread that touches no simulated tensor runs as it is
    with sv.record():
        box = []
        worker = threading.Thread(target=lambda: box.append(torch.ones(2).sum().item()))
        worker.start()
        worker.join()
    assert box == [2.0]


# --- process-wide registries ----------------------------------------------------------------------


def test_global_module_hooks_are_per_rank(threads):
    # Before: a hook rank 0 registered fired in every rank's forward (CommDebugMode's module
    # tracker raised "Module hierarchy tracking is wrong").
    from torch.nn.modules.module import _global_forward_hooks, register_module_forward_hook

    before = dict(_global_forward_hooks)
    model = nn.Linear(2, 2)

    def fn():
        calls = []
        handle = None
        if dist.get_rank() == 0:
            handle = register_module_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
        dist.barrier()  # every rank's forward runs after rank 0 registered
        model(torch.ones(2))
        dist.barrier()
        if handle is not None:
            handle.remove()
        return calls

    trace = sv.run(fn)
    assert trace.results == {0: ["Linear"], 1: [], 2: [], 3: []}
    assert dict(_global_forward_hooks) == before


def test_the_environment_and_thread_count_are_per_rank(threads):
    os.environ.pop("SV_TEST_PER_RANK", None)
    threads_before = torch.get_num_threads()

    def set_mine():
        os.environ["SV_TEST_PER_RANK"] = f"rank {dist.get_rank()}"
        os.environ["MASTER_PORT"] = "29999"  # what accelerate sets when it finds none
        torch.set_num_threads(1)

    def read_mine():
        return os.environ.get("SV_TEST_PER_RANK"), os.environ.get("SV_TEST_NOTEBOOK"), torch.get_num_threads()

    saved_port = os.environ.get("MASTER_PORT")
    sv.run(set_mine)
    assert "SV_TEST_PER_RANK" not in os.environ and os.environ.get("MASTER_PORT") == saved_port
    assert torch.get_num_threads() == threads_before
    os.environ["SV_TEST_NOTEBOOK"] = "set later in the notebook"
    try:
        trace = sv.run(read_mine)
    finally:
        del os.environ["SV_TEST_NOTEBOOK"]
    for r in range(N):
        assert trace.results[r] == (f"rank {r}", "set later in the notebook", 1)


# --- async collectives ----------------------------------------------------------------------------


def test_an_async_collectives_future_holds_its_tensors(threads):
    # What gloo's futures hold (measured): all_reduce and broadcast the tensor, all_gather every
    # output, barrier an empty list. Before: None, and DDP's reducer failed on it.
    def fn():
        rank = dist.get_rank()
        t = torch.full((2,), float(rank + 1))
        reduced = dist.all_reduce(t, async_op=True).get_future().wait()
        outs = [torch.empty(2) for _ in range(N)]
        gathered = dist.all_gather(outs, torch.full((2,), float(rank)), async_op=True).get_future().wait()
        barrier = dist.barrier(async_op=True).get_future().wait()
        return reduced[0] is t, t, [g.tolist() for g in gathered], barrier

    for same, t, gathered, barrier in sv.run(fn).results.values():
        assert same and t.tolist() == [10.0, 10.0]
        assert gathered == [[float(q)] * 2 for q in range(N)]
        assert barrier == []


# --- the lockstep simulator: the launcher's environment, rank 0's printing ----------------------


def test_lockstep_sets_the_world_size_and_refuses_a_rank_read_from_the_environment(lockstep):
    saved = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    with sv.record():
        assert os.environ["WORLD_SIZE"] == str(N) and os.environ["LOCAL_WORLD_SIZE"] == str(N)
        assert "RANK" in os.environ and "LOCAL_RANK" in os.environ
        with pytest.raises(
            PerRankValueError, match=r"os.environ\['LOCAL_RANK'\] is read here \(.*line \d+\)"
        ):
            int(os.environ.get("LOCAL_RANK", 0))  # silently 0 on every rank before
        with pytest.raises(PerRankValueError, match="sv.use\\('threads'"):
            os.getenv("RANK")
        assert "RANK" not in dict(os.environ)  # no one string to copy into a child process
    assert {k: os.environ.get(k) for k in saved} == saved


# rank 0's printout on real ranks (tabulate), hand-written: 4 rows of one rank each
SHARD0_4x4 = """\
         Col 0-3
-------  ---------
Row 0-0  cpu:0
Row 1-1  cpu:1
Row 2-2  cpu:2
Row 3-3  cpu:3
"""


def test_visualize_sharding_prints_what_rank_zero_prints(lockstep, capsys):
    pytest.importorskip("tabulate", reason="torch's visualize_sharding needs tabulate (the test extra)")
    # Before: nothing at all (its rank-0 test compared a per-rank value inside torch).
    with sv.record():
        mesh = init_device_mesh("cpu", (N,))
        visualize_sharding(distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)]))
    assert capsys.readouterr().out == SHARD0_4x4

    sv.use("threads", world_size=N)
    try:

        def fn():
            mesh = init_device_mesh("cpu", (N,))
            visualize_sharding(distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)]))

        sv.run(fn)
    finally:
        sv.use("local", world_size=N)
    assert capsys.readouterr().out == "".join(f"[rank 0] {line}\n" for line in SHARD0_4x4.splitlines())
