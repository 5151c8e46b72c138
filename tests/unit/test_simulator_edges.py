"""Issue 30: the simulator never crashes on code that runs under torch's own LocalTensorMode, and
every per-rank value lockstep cannot run is a PerRankValueError naming the user's line and the way
out, on every entry point; where torch raises first, its error is kept and explained.

Expectations come from plain torch on the global tensors, or are written out by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

import shardviz as sv

pytestmark = pytest.mark.timeout(240)


# --- 1. work on the to_local() of a reduce-scatter output ------------------------------------------


def test_local_work_on_a_reduce_scatter_output_is_recorded_per_rank():
    """``to_local()`` of a collective's output is an AsyncCollectiveTensor around every rank's
    LocalTensor: the recorder reads each rank's value, never one reconciled value (which
    raised 'LocalTensor shards must be the same to reconcile')."""
    sv.use("local", world_size=4)
    torch.manual_seed(0)
    lin, x0 = nn.Linear(8, 16), torch.randn(2, 8, 8)
    want = lin(x0).detach()  # plain torch, the global output
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (4,))
        parallelize_module(lin, mesh, RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)))
        x = DTensor.from_local(lin(x0), mesh, [Shard(1)])
        y = x.to_local().pow(2)  # a fused sequence-parallel norm starts like this
    pieces = want.chunk(4, dim=1)
    got = _torch_per_rank(y)
    for r in range(4):
        torch.testing.assert_close(got[r], pieces[r].pow(2))
    (local,) = [e for e in trace.events if e.kind == "local"]
    assert local.name == "aten.pow.Tensor_Scalar"
    for r in range(4):
        np.testing.assert_allclose(local.inputs[r].values, pieces[r].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(local.outputs[r].values, pieces[r].pow(2).numpy(), rtol=1e-5, atol=1e-6)


def _torch_per_rank(t):
    from shardviz.capture import torch as _torch

    return {r: v.detach() for r, v in _torch.local_tensors(_torch.settled(t)).items()}
