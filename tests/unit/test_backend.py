"""The local backend: sv.use / restart / device_type / record leave no mode behind."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import shardviz as sv
from shardviz.backends import choose, session
from shardviz.capture import torch as _torch
from shardviz.errors import BackendError, WorldSizeError


def no_modes_left():
    return _torch.active_local_mode() is None and _torch.dispatch_mode_stack() == []


def test_use_sets_up_a_fake_group_and_no_mode():
    sv.use("local", world_size=4)
    assert dist.is_initialized() and dist.get_backend() == "fake" and dist.get_world_size() == 4
    assert no_modes_left()
    assert type(torch.ones(2)) is torch.Tensor


def test_same_arguments_are_a_no_op_other_arguments_rebuild():
    sv.use("local", world_size=4)
    before = choose.current()
    sv.use("local", world_size=4)
    assert choose.current() is before
    sv.use("local", world_size=2)
    assert choose.current() is not before and dist.get_world_size() == 2
    sv.use("local", world_size=4)


def test_default_is_local_4():
    choose.current().close()
    session.install(None)
    assert sv.device_type() == "cpu"
    assert choose.current().key() == ("local", 4)


def test_restart_rebuilds_same_size():
    sv.use("local", world_size=3)
    old = choose.current()
    sv.restart()
    assert choose.current() is not old and choose.current().world_size == 3
    assert dist.get_world_size() == 3
    sv.use("local", world_size=4)


@pytest.mark.parametrize(
    "args, error, match",
    [
        (("tpu", 4), ValueError, "unknown backend"),
        (("local", 0), ValueError, "positive int"),
        (("local", "4"), ValueError, "positive int"),
        ((3,), ValueError, "unknown backend"),
    ],
)
def test_bad_use_arguments(args, error, match):
    with pytest.raises(error, match=match):
        sv.use(*args)


def test_local_rejects_options():
    with pytest.raises(TypeError, match="takes no options but check_capacity, engine"):
        sv.use("local", world_size=2, profile="x")
    with pytest.raises(ValueError, match="unknown simulator engine 'vectorised'"):
        sv.use("local", world_size=2, engine="vectorised")


def test_record_simulates_and_leaves_nothing_behind():
    sv.use("local", world_size=4)
    with sv.record():
        x = torch.ones(2)
        assert isinstance(x, _torch.LocalTensor)
        assert set(_torch.local_tensors(x)) == {0, 1, 2, 3}
    assert no_modes_left()
    assert type(torch.ones(2)) is torch.Tensor


def test_record_leaves_nothing_behind_when_the_body_raises():
    sv.use("local", world_size=4)

    class Boom(Exception):
        pass

    with pytest.raises(Boom), sv.record():
        torch.ones(2)
        raise Boom("inside")
    assert no_modes_left()


def test_dtensors_stay_usable_in_later_blocks():
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    with sv.record():
        full = dt.full_tensor()
    assert torch.equal(full.reconcile(), torch.arange(8.0))


def test_mesh_coordinates_are_kept_from_cell_to_cell():
    # Recomputing them costs ~N^2 small ops per mesh (seconds at 256 ranks), and a torch.compile
    # trace that has to recompute them fails. torch 2.13 keys the cache by id(mesh), 2.14 on by
    # the mesh's rank map and layout: a live mesh's entries must survive either way.
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        distribute_tensor(torch.arange(8.0), mesh, [Shard(0), Shard(0)])
        tp = mesh["tp"]
        distribute_tensor(torch.arange(8.0), tp, [Shard(0)])
    cache = choose.current()._mode._coordinate_cache
    kept = dict(cache)
    assert len(kept) >= 2  # the mesh and its tp slice
    with sv.record():
        pass
    assert all(cache.get(k) is v for k, v in kept.items())


def test_mesh_smaller_than_world_is_explained():
    sv.use("local", world_size=4)
    with pytest.raises(AssertionError, match=r"covers 2 ranks, but the simulation runs 4") as e, sv.record():
        mesh = init_device_mesh("cpu", (2,))
        distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    assert "sv.use('local', world_size=2)" in str(e.value)
    assert no_modes_left()


def test_mesh_larger_than_world_is_explained():
    sv.use("local", world_size=4)
    with pytest.raises(RuntimeError, match=r"sv.use\('local', world_size=<mesh size>\)"), sv.record():
        init_device_mesh("cpu", (8,))
    assert no_modes_left()


def test_uneven_3d_scatter_bug_is_explained():
    # engine notes, pitfall 4: 7x5x3 as [S1, S0, S0] on (2, 3, 4) fails inside torch.
    sv.use("local", world_size=24)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 3, 4))
    x = torch.arange(105.0).reshape(7, 5, 3)
    with pytest.raises(AssertionError, match="src_data_rank=None"), sv.record():
        distribute_tensor(x, mesh, [Shard(1), Shard(0), Shard(0)])
    # The way out the message names works and gives the pure geometry's shards.
    with sv.record():
        dt = distribute_tensor(x, mesh, [Shard(1), Shard(0), Shard(0)], src_data_rank=None)
    lay = sv.layout(dt)
    assert lay == sv.layout((7, 5, 3), (2, 3, 4), ["S(1)", "S(0)", "S(0)"])
    locals_ = _torch.local_tensors(dt._local_tensor)
    assert {r: tuple(t.shape) for r, t in locals_.items()} == {s.rank: s.shape for s in lay.shards}
    sv.use("local", world_size=4)


def test_an_inner_mode_of_another_size_is_refused():
    sv.use("local", world_size=4)
    with pytest.raises(WorldSizeError, match="silently skip ranks"), _torch.LocalTensorMode(3), sv.record():
        pass
    assert no_modes_left()


def test_foreign_process_group_is_not_clobbered():
    sv.use("local", world_size=4)
    choose.current().close()
    session.install(None)
    dist.init_process_group("fake", rank=0, world_size=3)
    try:
        with pytest.raises(BackendError, match="already initialized"):
            sv.use("local", world_size=4)
        sv.use("local", world_size=3)  # a matching fake group is adopted
        assert dist.get_world_size() == 3
    finally:
        session.install(None)
        dist.destroy_process_group()
    sv.use("local", world_size=4)


def test_a_new_world_does_not_reuse_dtensors_shardings_of_an_old_one():
    """DTensor caches shardings by specs whose mesh compares by value: an equal (dp, tp) mesh of
    a later world got the old world's mesh back, whose group names then named other groups."""
    from torch.distributed.tensor import Replicate

    x = torch.arange(64.0).reshape(8, 8)

    def step():
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        d = distribute_tensor(x, mesh["tp"], [Shard(0)])
        return (d + 1).redistribute(mesh["tp"], [Replicate()]).to_local()

    sv.use("local", world_size=8)
    with sv.record():
        step()
    sv.use("local", world_size=4)
    with sv.record():
        init_device_mesh("cpu", (2, 2))
    sv.use("local", world_size=8)
    with sv.record() as trace:
        init_device_mesh("cpu", (2, 2, 2))  # its groups take the names the old tp group had
        again = step()
    for rank, t in _torch.local_tensors(again).items():
        torch.testing.assert_close(t, x + 1, msg=f"rank {rank}")
    assert trace.collectives()[-1].groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    sv.use("local", world_size=4)
