"""The LocalTensor tutorial's DTensor examples 3 and 4 on real gloo ranks, through ``sv.run``.

Each example's ``with LocalTensorMode(n)`` becomes a function run on every rank, and
``reconcile()`` (which folds a simulated per-rank value) becomes ``full_tensor()`` / the rank's own
value. Random inputs are seeded on every rank, so each rank builds the same global tensor; the
expected values are plain torch on the global tensor, computed here in the test process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.compare import diff_traces

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def distribute_and_verify(world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    tensor = torch.arange(16).reshape(4, 4).float()
    dt_sharded = distribute_tensor(tensor, mesh, [Shard(0)])
    dt_replicated = distribute_tensor(tensor, mesh, [Replicate()])
    return dt_sharded.full_tensor(), dt_replicated.to_local()


def dtensor_matmul(world_size):
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world_size,))
    a = torch.randn(8, 4)
    b = torch.randn(4, 6)
    da = distribute_tensor(a, mesh, [Shard(0)])
    db = distribute_tensor(b, mesh, [Replicate()])
    dc = da @ db
    return dc.full_tensor(), sv.layout(dc).placements


def dtensor_linear_layer(world_size):
    torch.manual_seed(1)
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(16, 8)
    w = torch.randn(8, 4)
    b = torch.randn(4)
    dx = distribute_tensor(x, mesh, [Shard(0)])
    dw = distribute_tensor(w, mesh, [Replicate()])
    db = distribute_tensor(b, mesh, [Replicate()])
    dy = torch.relu(dx @ dw + db)
    return dy.full_tensor()


def dtensor_uneven_sharding(world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    tensor = torch.arange(10 * 4).reshape(10, 4).float()
    dt = distribute_tensor(tensor, mesh, [Shard(0)])
    rows = dt.to_local().shape[0]
    return rows, dt.full_tensor()


def test_example3_distribute_and_verify(gloo):
    gloo(4)
    trace = sv.run(distribute_and_verify, 4)
    expected = torch.arange(16).reshape(4, 4).float()
    assert sorted(trace.results) == [0, 1, 2, 3]
    for sharded, replicated in trace.results.values():
        assert torch.equal(sharded, expected) and torch.equal(replicated, expected)
    assert [c.op for c in trace.collectives()] == ["scatter", "broadcast", "all_gather"]
    # The same function in the simulator records the same collectives and buffers.
    sv.use("local", world_size=4)
    simulated = sv.run(distribute_and_verify, 4)
    assert diff_traces(simulated, trace) == []


def test_example3_matmul_and_linear_layer(gloo):
    gloo(4)
    torch.manual_seed(0)
    a, b = torch.randn(8, 4), torch.randn(4, 6)
    trace = sv.run(dtensor_matmul, 4)
    for actual, placements in trace.results.values():
        torch.testing.assert_close(actual, a @ b)
        assert placements == ("S(0)",)
    torch.manual_seed(1)
    x, w, bias = torch.randn(16, 8), torch.randn(8, 4), torch.randn(4)
    trace = sv.run(dtensor_linear_layer, 4)
    for actual in trace.results.values():
        torch.testing.assert_close(actual, torch.relu(x @ w + bias))


def test_example4_uneven_sharding_at_3_ranks(gloo):
    gloo(3)
    trace = sv.run(dtensor_uneven_sharding, 3)
    rows = {r: v[0] for r, v in trace.results.items()}
    assert rows == {0: 4, 1: 4, 2: 2}  # torch.chunk of 10 rows into 3
    for _, full in trace.results.values():
        assert torch.equal(full, torch.arange(40).reshape(10, 4).float())
    scatter = trace.collectives()[0]
    assert {r: s.shape for r, s in scatter.outputs.items()} == {0: (4, 4), 1: (4, 4), 2: (4, 4)}  # padded
    assert {s.rank: s.shape[0] for s in sv.layout((10, 4), (3,), ["S(0)"]).shards} == rows
