"""Issue 26: ``sv.diff`` on real ranks (gloo): each rank reports its own pieces, the notebook
assembles them; the same function in the simulator against the real ranks; a bug found there."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def mlp() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    # torch's own modules: the engines unpickle the model by importing them.
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)), torch.randn(8, 16)


def tp(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def drifting_bias(model: nn.Module) -> nn.Module:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    drift = sv.per_rank(lambda rank: torch.full((16,), 1e-3 if rank == 2 else 0.0))
    with torch.no_grad():
        model[2].bias.add_(DTensor.from_local(drift, mesh, [Replicate()], run_check=False))
    return model


def test_real_ranks_against_plain_torch_and_against_the_simulator(gloo):
    gloo(4)
    model, x = mlp()
    report = sv.diff(model, tp, x)
    assert report.ok, str(report)
    assert report.parallel == "tp on gloo (4 ranks)" and report.world_size == 4
    # Each rank reported its own shard: the full weight is assembled from four of them.
    w = report.row("Sequential.0", "weight at start")
    assert w.layout is not None and w.layout.placements == ("S(0)",) and w.status == "ok"
    both = sv.diff(model, tp, x, against="simulator")
    assert both.ok, str(both)
    assert both.reference == "tp on local (4 ranks)"


def test_a_drifting_bias_on_real_ranks_is_found_at_the_module(gloo):
    gloo(4)
    model, x = mlp()
    report = sv.diff(model, drifting_bias, x)
    first = report.first
    assert first is not None
    assert (first.module, first.what, first.status) == ("Sequential.2", "bias at start", "replicas")
    assert first.disagreements[0].groups == ((0, 1, 3), (2,))
    # The events named are the real ranks' merged trace's.
    for e in report.row("Sequential.2", "output").events:
        assert report.trace.events[e.id].kind == e.kind


def test_a_function_held_in_the_closure_of_a_run_sees_the_imports(gloo):
    gloo(2)

    def helper() -> int:
        return init_device_mesh("cpu", (2,)).size()  # a name this module imported

    def fn() -> int:
        return helper()  # held in fn's closure, not in its globals

    assert sv.run(fn).results == {0: 2, 1: 2}
