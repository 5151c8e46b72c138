"""FSDP2 in the simulator against FSDP2 on real gloo ranks: the same collectives, groups and values
(issue 15)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CELL = """
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 4))  # 10 rows: uneven over 4
mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
for m in (model[0], model[2], model):
    fully_shard(m, mesh=mesh)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = sv.per_rank(lambda rank: torch.arange(24.0).reshape(3, 8) / (rank + 1))
model(x).sum().backward()
opt.step()
w = model[2].weight.full_tensor()
"""


def test_fsdp2_step_simulated_equals_gloo(ip, gloo):
    ip.run_cell("import shardviz as sv")
    gloo(4)
    c = ip.run_cell_magic("spmd", "--compare", CELL + "w")
    assert c.ok, str(c)
    ops = [(e.op, e.mesh_dim_name) for e in c.real.collectives() if e.phase]
    assert ops.count(("all_gather", "dp")) == 4 and ops.count(("reduce_scatter", "dp")) == 2, ops
    assert [(e.op, e.groups, e.module) for e in c.real.collectives()] == [
        (e.op, e.groups, e.module) for e in c.simulated.collectives()
    ]
