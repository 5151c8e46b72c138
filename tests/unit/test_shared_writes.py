"""Issue 26 found these: writes of per-rank values into a tensor that every simulated rank shares.

A DTensor made from a plain tensor (a RowwiseParallel bias, a SequenceParallel norm weight) and
a plain parameter no parallel style touched are one storage for all simulated ranks. An optimizer
step on them used to run once per rank on that storage, so the update landed world-size times.
Expectations are plain torch's, computed on the unsharded model.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.capture.recorder import SharedLocalWriteError

pytestmark = pytest.mark.timeout(120)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), nn.Linear(8, 4))


def values(p: torch.Tensor) -> dict[int, torch.Tensor]:
    """Each rank's full value of a parameter (a DTensor's full tensor, or a plain one's own)."""
    full = p.full_tensor() if _torch.is_dtensor(p) else p
    return _torch.local_tensors(full) or {0: full}


def test_an_sgd_step_on_a_rowwise_bias_and_a_plain_layer_lands_once():
    sv.use("local", world_size=4)
    plain = mlp()
    model = copy.deepcopy(plain)
    x = torch.randn(5, 8)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        # layer 2's bias is replicated by RowwiseParallel; layer 3 stays a plain nn.Linear.
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(x).sum().backward()
        opt.step()
        got = {name: values(p) for name, p in model.named_parameters()}
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    plain(x).sum().backward()
    ref_opt.step()
    for name, want in plain.named_parameters():
        for rank, t in got[name].items():
            torch.testing.assert_close(t, want.detach(), rtol=1e-5, atol=1e-6, msg=f"{name} on rank {rank}")


def test_per_rank_values_written_into_a_shared_local_tensor_are_refused():
    sv.use("local", world_size=4)
    shared = torch.zeros(3)
    with pytest.raises(SharedLocalWriteError, match="every simulated rank shares"), sv.record():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(shared, mesh, [Replicate()])
        d.to_local().add_(sv.per_rank(lambda r: torch.full((3,), float(r))))
    # Nothing landed: before, every rank's value was added to the one tensor (0+1+2+3).
    assert shared.tolist() == [0.0, 0.0, 0.0]


def test_the_same_values_from_every_rank_are_written_once():
    sv.use("local", world_size=4)
    shared = torch.ones(3)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(shared, mesh, [Replicate()])
        d.to_local().mul_(sv.per_rank(lambda r: torch.full((3,), 2.0)))
        got = values(d)
    for rank, t in got.items():
        assert t.tolist() == [2.0, 2.0, 2.0], rank  # doubled once, not 2**4 times


def test_an_in_place_dtensor_write_gives_each_rank_its_own_copy():
    sv.use("local", world_size=4)
    made_outside = torch.zeros(3)  # one plain tensor: what every rank's local starts as
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        d = distribute_tensor(made_outside, mesh, [Replicate()])
        drift = sv.per_rank(lambda r: torch.full((3,), float(r)))
        d.add_(DTensor.from_local(drift, mesh, [Replicate()], run_check=False))
        local = _torch.local_tensors(_torch.local_of(d))
    assert local is not None
    assert {r: t.tolist() for r, t in local.items()} == {r: [float(r)] * 3 for r in range(4)}
    assert made_outside.tolist() == [0.0, 0.0, 0.0]
