"""The world a recording runs in never changes under it, and the simulator never gives the value of
a world of one: a backend switch inside ``sv.record`` / ``sv.run`` / ``%%spmd`` is refused, a
collective outside the simulation raises, ranks whose shapes disagree are named, and a trace that
names ranks outside its world is reported by ``check()`` and never written as a file ``sv.load``
refuses. Expectations are hand-written values (an all_reduce of ones over 4 ranks is 4)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.backends import choose, session
from shardviz.capture.threadpg import CollectiveMismatchError
from shardviz.data.events import CollectiveEvent, ComputeEvent, TensorSnapshot
from shardviz.data.trace import Trace
from shardviz.errors import BackendError, TraceFileError

N = 4
SWITCHES = [("local", 8), ("local", 2), ("threads", 2), ("gloo", 2)]


@pytest.fixture(autouse=True)
def local4():
    sv.use("local", world_size=N)
    yield
    sv.use("local", world_size=N)


def _ones_all_reduced() -> torch.Tensor:
    x = sv.per_rank(lambda r: torch.ones(2))
    dist.all_reduce(x)
    return x


def _assert_world_of_4(trace: Trace) -> None:
    (ev,) = trace.collectives()
    assert ev.groups == ((0, 1, 2, 3),)
    for r in range(N):
        np.testing.assert_array_equal(ev.outputs[r].values, [4.0, 4.0])
    assert trace.check() == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, size", SWITCHES)
def test_a_backend_switch_inside_a_record_block_is_refused_and_the_block_goes_on(name, size, tmp_path):
    before = choose.current()
    with sv.record() as trace:
        with pytest.raises(BackendError, match=r"inside sv\.record\(\).*'local' backend's 4 ranks"):
            sv.use(name, world_size=size)
        with pytest.raises(BackendError, match=r"sv\.restart\(\) inside sv\.record\(\)"):
            sv.restart()
        x = _ones_all_reduced()
    assert choose.current() is before
    for r in range(N):
        assert x._local_tensors[r].tolist() == [4.0, 4.0]
    _assert_world_of_4(trace)
    assert sv.load(trace.save(tmp_path / "t.svtrace")) == trace
    sv.use(name if name != "gloo" else "local", world_size=size)  # after the block: allowed


@pytest.mark.timeout(60)
def test_a_backend_switch_inside_sv_run_threaded_runs_and_cells_is_refused():
    def switching(*_):
        sv.use("local", world_size=8)

    with pytest.raises(BackendError, match=r"inside sv\.run\(fn\):"):
        sv.run(switching)
    with pytest.raises(BackendError, match=r"inside sv\.run\(fn, threads=2\):"):
        sv.run(switching, threads=2)
    shell = types.SimpleNamespace(user_ns={"sv": sv})
    with pytest.raises(BackendError, match=r"inside a %%spmd cell:"):
        choose.current().run_cell("sv.use('threads', world_size=2)", shell)
    assert choose.current().key() == ("local", N) and session.run_in_progress() is None
    _assert_world_of_4(sv.run(_ones_all_reduced))

    sv.use("threads", world_size=N)
    with pytest.raises(BackendError, match=r"inside sv\.run\(fn\): .*'threads' backend's 4 ranks"):
        sv.run(lambda: sv.use("local", world_size=8))
    with pytest.raises(BackendError, match=r"inside a %%spmd cell:"):
        choose.current().run_cell("sv.use('local', world_size=8)", shell)
    assert sv.run(lambda: dist.get_rank()).results == {0: 0, 1: 1, 2: 2, 3: 3}


@pytest.mark.timeout(60)
def test_the_same_backend_again_inside_a_recording_changes_nothing():
    with sv.record() as trace:
        sv.use("local", world_size=N)  # the same arguments: a no-op, as everywhere
        _ones_all_reduced()
    _assert_world_of_4(trace)


# --- outside a recording ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_raw_collective_outside_the_simulation_raises_an_explained_error():
    t = torch.ones(2)
    with pytest.raises(RuntimeError, match="FakeProcessGroup") as info:
        dist.all_reduce(t)
    note = "\n".join(info.value.__notes__)
    assert "ran outside the simulation" in note and "sv.record()" in note and "world of one" in note
    assert t.tolist() == [1.0, 1.0]
    # the same line inside the simulation: every rank's ones summed
    with sv.record():
        x = torch.ones(2)
        dist.all_reduce(x)
    assert [x._local_tensors[r].tolist() for r in range(N)] == [[4.0, 4.0]] * N


@pytest.mark.timeout(60)
def test_dtensor_ops_outside_the_simulation_raise_on_every_group_of_a_mesh():
    mesh = init_device_mesh("cpu", (N,))
    with pytest.raises(RuntimeError, match="FakeProcessGroup") as info:
        distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    assert "ran outside the simulation" in "\n".join(info.value.__notes__)
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):  # a mesh's sub-groups refuse too
        with pytest.raises(RuntimeError, match="FakeProcessGroup"):
            dist.all_reduce(torch.ones(1), group=mesh2.get_group(dim))
    local = DTensor.from_local(torch.ones(2), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="FakeProcessGroup"):
        local.redistribute(mesh, [Replicate()])
    # inside, the same DTensor code gives every rank the whole tensor
    with sv.record():
        m = init_device_mesh("cpu", (2, 2))
        full = distribute_tensor(torch.arange(8.0), m, [Shard(0), Shard(0)]).redistribute(
            m, [Replicate(), Replicate()]
        )
    for r in range(N):
        assert full.to_local()._local_tensors[r].tolist() == list(range(8))


@pytest.mark.timeout(60)
def test_plain_tensor_collectives_that_are_right_inside_the_simulation_still_run():
    outside = torch.full((3,), 5.0)
    with sv.record() as trace:
        dist.all_reduce(outside, op=dist.ReduceOp.MAX)  # every rank holds 5: the max is 5
        dist.broadcast(outside, 0)
        dist.barrier()
    assert outside.tolist() == [5.0, 5.0, 5.0]
    assert [e.op for e in trace.collectives()] == ["all_reduce", "broadcast", "barrier"]


# --- ranks whose shapes disagree -------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "call, op",
    [
        (lambda x: dist.all_reduce(x), "all_reduce"),
        (lambda x: dist.reduce(x, 0), "reduce"),
        (lambda x: dist.broadcast(x, 1), "broadcast"),  # rank 1's 3 ones would fill rank 0's 2
        (lambda x: dist.all_gather_into_tensor(torch.zeros(9), x), "all_gather_into_tensor"),
    ],
)
def test_per_rank_shapes_that_differ_are_named_in_the_lockstep_simulator(call, op):
    def fn():
        call(sv.per_rank(lambda r: torch.ones(3 if r == 1 else 2)))

    with pytest.raises(CollectiveMismatchError) as info:
        sv.run(fn)
    text = str(info.value)
    assert f"passed {op.split('_into')[0]} (" in text and "different shapes" in text
    assert "rank 0: float32[2]; rank 1: float32[3]; rank 2: float32[2]; rank 3: float32[2]" in text
    assert "at line " in text and f"dist.{op}" in text  # the user's line (here the lambda's)
    assert sv.last_trace().complete is False
    _assert_world_of_4(sv.run(_ones_all_reduced))  # and the next run is right


# --- traces naming ranks outside their world -------------------------------------------------


def _collective(eid: int, groups: tuple[tuple[int, ...], ...], ranks: list[int]) -> CollectiveEvent:
    snap = TensorSnapshot((2,), "float32", np.ones(2, np.float32))
    return CollectiveEvent(
        id=eid,
        parent=None,
        op="all_reduce",
        impl="c10d.allreduce_",
        reduce_op="sum",
        groups=groups,
        inputs={r: snap for r in ranks},
        outputs={r: snap for r in ranks},
        nbytes={r: 8 for r in ranks},
    )


def test_check_reports_events_naming_ranks_outside_the_world_and_save_refuses_them(tmp_path):
    trace = Trace(4)
    trace.events = [_collective(0, ((0, 1, 2, 3, 4, 5, 6, 7),), [0, 1, 2, 3])]
    found = trace.check()
    assert list(found) == [0] and "names ranks 4-7 outside this trace's world of 4 ranks" in found[0].note
    with pytest.raises(TraceFileError, match="not written: event #0 names ranks 4-7"):
        trace.save(tmp_path / "t.svtrace")
    assert not (tmp_path / "t.svtrace").exists()
    trace.events = [ComputeEvent(id=0, parent=None, name="forward", ranks=(0, 9))]
    assert "rank 9 outside" in trace.check()[0].note
    trace.events = [_collective(0, ((0, 1, 1),), [0, 1])]
    assert "names a rank twice" in trace.check()[0].note


@given(
    world=st.integers(1, 6),
    groups=st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4), min_size=1, max_size=3),
    ranks=st.lists(st.integers(0, 7), max_size=4, unique=True),
)
def test_every_trace_that_saves_loads(tmp_path_factory, world, groups, ranks):
    """A trace either saves and loads back equal, or is refused by save with the reason (and is
    then reported by check): never a file that sv.load refuses."""
    trace = Trace(world)
    trace.events = [_collective(0, tuple(tuple(g) for g in groups), ranks)]
    path = tmp_path_factory.mktemp("t") / "t.svtrace"
    try:
        trace.save(path)
    except TraceFileError:
        assert trace.outside_world() and not path.exists()
        return
    assert not trace.outside_world()
    assert sv.load(path) == trace
