"""Each row of the engine notes' redistribute table on 1-D, 2-D and 3-D meshes.

The redistribute runs over one mesh dim (the others Replicate). Expected ops, groups and mesh
dims are written out by hand; per-rank values are computed with plain torch on the global tensor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import shardviz as sv

# (mesh shape, mesh dim redistributed, its groups written out, its name)
CASES = [
    ((4,), 0, ((0, 1, 2, 3),), "x"),
    ((2, 2), 1, ((0, 1), (2, 3)), "tp"),
    ((2, 2), 0, ((0, 2), (1, 3)), "dp"),
    ((2, 2, 2), 2, ((0, 1), (2, 3), (4, 5), (6, 7)), "tp"),
    ((2, 2, 2), 1, ((0, 2), (1, 3), (4, 6), (5, 7)), "cp"),
]
NAMES = {1: ("x",), 2: ("dp", "tp"), 3: ("pp", "cp", "tp")}
X = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def setup(mesh_shape):
    n = int(np.prod(mesh_shape))
    sv.use("local", world_size=n)
    with sv.record():
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=NAMES[len(mesh_shape)])
    return mesh


def placements(mesh_shape, dim, p):
    return [p if i == dim else Replicate() for i in range(len(mesh_shape))]


def coord(mesh_shape, rank, dim):
    return np.unravel_index(rank, mesh_shape)[dim]


def group_of(groups, rank):
    return next(g for g in groups if rank in g)


def only_collective(trace, op):
    cols = trace.collectives()
    assert [c.op for c in cols] == [op], str(trace)
    return cols[0]


@pytest.mark.parametrize("mesh_shape, dim, groups, name", CASES, ids=lambda c: str(c))
def test_distribute_scatters_shard_dims_and_broadcasts_replicate_dims(mesh_shape, dim, groups, name):
    mesh = setup(mesh_shape)
    with sv.record() as trace:
        distribute_tensor(X, mesh, placements(mesh_shape, dim, Shard(0)))
    ops = [(c.op, c.mesh_dim) for c in trace.collectives()]
    expected = [("scatter" if i == dim else "broadcast", i) for i in range(len(mesh_shape))]
    assert ops == expected, str(trace)
    scatter = trace.collectives()[dim]
    assert scatter.groups == groups and scatter.mesh_dim_name == name and scatter.root == 0
    n = mesh_shape[dim]
    for r in range(int(np.prod(mesh_shape))):
        np.testing.assert_array_equal(
            scatter.outputs[r].values, X.chunk(n, 0)[coord(mesh_shape, r, dim)].numpy()
        )


@pytest.mark.parametrize("mesh_shape, dim, groups, name", CASES, ids=lambda c: str(c))
def test_shard_to_replicate_all_gathers(mesh_shape, dim, groups, name):
    mesh = setup(mesh_shape)
    with sv.record():
        dt = distribute_tensor(X, mesh, placements(mesh_shape, dim, Shard(0)))
    with sv.record() as trace:
        out = dt.redistribute(mesh, placements(mesh_shape, dim, Replicate()))
    (red,) = trace.redistributes()
    c = only_collective(trace, "all_gather")
    assert (c.parent, c.groups, c.mesh_dim, c.mesh_dim_name) == (red.id, groups, dim, name)
    assert c.impl == "_c10d_functional.all_gather_into_tensor" and red.explicit
    for r in range(int(np.prod(mesh_shape))):
        np.testing.assert_array_equal(
            c.inputs[r].values, X.chunk(mesh_shape[dim], 0)[coord(mesh_shape, r, dim)].numpy()
        )
        np.testing.assert_array_equal(c.outputs[r].values, X.numpy())
    assert torch.equal(out.to_local()._local_tensors[0], X)


def partial_input(mesh, mesh_shape, dim):
    """A Partial(sum) DTensor whose rank r holds (r + 1) * X."""
    local = sv.per_rank(lambda r: X * (r + 1))
    return DTensor.from_local(local, mesh, placements(mesh_shape, dim, Partial()), run_check=False)


@pytest.mark.parametrize("mesh_shape, dim, groups, name", CASES, ids=lambda c: str(c))
def test_partial_to_replicate_all_reduces(mesh_shape, dim, groups, name):
    mesh = setup(mesh_shape)
    with sv.record() as trace:
        dt = partial_input(mesh, mesh_shape, dim)
        dt.redistribute(mesh, placements(mesh_shape, dim, Replicate()))
    c = only_collective(trace, "all_reduce")
    assert (c.reduce_op, c.groups, c.mesh_dim, c.mesh_dim_name) == ("sum", groups, dim, name)
    for r in range(int(np.prod(mesh_shape))):
        expected = sum(X * (g + 1) for g in group_of(groups, r))
        np.testing.assert_array_equal(c.inputs[r].values, (X * (r + 1)).numpy())
        np.testing.assert_array_equal(c.outputs[r].values, expected.numpy())


@pytest.mark.parametrize("mesh_shape, dim, groups, name", CASES, ids=lambda c: str(c))
def test_partial_to_shard_reduce_scatters(mesh_shape, dim, groups, name):
    mesh = setup(mesh_shape)
    with sv.record() as trace:
        dt = partial_input(mesh, mesh_shape, dim)
        dt.redistribute(mesh, placements(mesh_shape, dim, Shard(0)))
    c = only_collective(trace, "reduce_scatter")
    assert (c.reduce_op, c.groups, c.mesh_dim) == ("sum", groups, dim)
    for r in range(int(np.prod(mesh_shape))):
        total = sum(X * (g + 1) for g in group_of(groups, r))
        expected = total.chunk(mesh_shape[dim], 0)[coord(mesh_shape, r, dim)]
        np.testing.assert_array_equal(c.outputs[r].values, expected.numpy())


@pytest.mark.parametrize("mesh_shape, dim, groups, name", CASES, ids=lambda c: str(c))
def test_shard_to_other_shard_all_to_all(mesh_shape, dim, groups, name):
    mesh = setup(mesh_shape)
    with sv.record():
        dt = distribute_tensor(X, mesh, placements(mesh_shape, dim, Shard(0)))
    with sv.record() as trace:
        out = dt.redistribute(mesh, placements(mesh_shape, dim, Shard(1)))
    c = only_collective(trace, "all_to_all")
    assert (c.impl, c.groups, c.mesh_dim) == ("_dtensor.shard_dim_alltoall", groups, dim)
    n = mesh_shape[dim]
    # The buffers are padded so the new shard dim divides evenly (6 columns over 4 ranks -> 8).
    cols = -(-X.shape[1] // n) * n
    padded = torch.nn.functional.pad(X, (0, cols - X.shape[1]))
    for r in range(int(np.prod(mesh_shape))):
        i = coord(mesh_shape, r, dim)
        np.testing.assert_array_equal(c.inputs[r].values, padded.chunk(n, 0)[i].numpy())
        np.testing.assert_array_equal(c.outputs[r].values, padded.chunk(n, 1)[i].numpy())
        size = -(-X.shape[1] // n)  # torch.chunk's size; trailing ranks may get nothing
        assert torch.equal(out.to_local()._local_tensors[r], X[:, i * size : (i + 1) * size])


@pytest.mark.parametrize("mesh_shape, dim, groups, name", CASES[:2], ids=lambda c: str(c))
def test_replicate_to_shard_needs_no_communication(mesh_shape, dim, groups, name):
    mesh = setup(mesh_shape)
    with sv.record():
        dt = distribute_tensor(X, mesh, placements(mesh_shape, dim, Replicate()))
    with sv.record() as trace:
        out = dt.redistribute(mesh, placements(mesh_shape, dim, Shard(0)))
    (red,) = trace.events
    assert red.kind == "redistribute" and trace.collectives() == []
    assert red.after == sv.layout(
        tuple(X.shape),
        mesh_shape,
        [str(p) for p in ["R"] * dim + ["S(0)"]] + ["R"] * (len(mesh_shape) - dim - 1),
        NAMES[len(mesh_shape)],
    )
    assert torch.equal(
        out.to_local()._local_tensors[1], X.chunk(mesh_shape[dim], 0)[coord(mesh_shape, 1, dim)]
    )


def test_replicate_to_partial_is_refused_and_nothing_is_left_active():
    mesh = setup((4,))
    with sv.record():
        dt = distribute_tensor(X, mesh, [Replicate()])
    with pytest.raises(RuntimeError), sv.record():
        dt.redistribute(mesh, [Partial()])
    from shardviz.capture import torch as _torch

    assert _torch.active_local_mode() is None and _torch.dispatch_mode_stack() == []


def test_2d_shard_to_replicate_gathers_over_each_mesh_dim():
    mesh = setup((2, 2))
    with sv.record():
        dt = distribute_tensor(X, mesh, [Shard(0), Shard(1)])
    with sv.record() as trace:
        dt.redistribute(mesh, [Replicate(), Replicate()])
    (red,) = trace.redistributes()
    assert red.plan == "S(0)S(1)->S(0)R->RR"
    gathers = trace.collectives()
    assert [(g.op, g.mesh_dim_name, g.parent) for g in gathers] == [
        ("all_gather", "tp", red.id),
        ("all_gather", "dp", red.id),
    ]
    np.testing.assert_array_equal(gathers[1].outputs[3].values, X.numpy())
    sv.use("local", world_size=4)
