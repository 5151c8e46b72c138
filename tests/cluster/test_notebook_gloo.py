"""One notebook of %%spmd cells executed by nbclient in a real kernel, under local and under gloo.

The kernel attaches to the session's cluster (``profile_dir=`` / ``cluster_id=``), as a notebook
attaches to engines started by ``ipcluster``. Only the ``%shardviz use`` line differs; what the cells
show is the same, except that real ranks each print their own line, tagged with the rank.
"""

from __future__ import annotations

import pytest
from nbcells import run_cells, text

import shardviz as sv

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CELLS = [
    "import torch\nimport torch.distributed as dist\n"
    "from torch.distributed.device_mesh import init_device_mesh\n"
    "from torch.distributed.tensor import Replicate, Shard, distribute_tensor\n"
    "import shardviz as sv\n%load_ext shardviz",
    "USE",
    (
        "%%spmd\n"
        "mesh = init_device_mesh('cpu', (2,))\n"
        "dt = distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])\n"
        "full = dt.redistribute(mesh, [Replicate()])\n"
        "sv.layout(dt).placements"
    ),
    "t = sv.last_trace()\nprint(t.backend, t.world_size, [c.op for c in t.collectives()])",
    "%%spmd\nprint('local rows:', int(dt.to_local().shape[0]))",
    "%%spmd\nsv.show(dt)",
    "%%spmd\nfull.to_local().sum()",
    "%%spmd\nraise KeyError('inside the cell')",
    "%%spmd\nt2 = torch.ones(2)\ndist.all_reduce(t2)\nt2",
    "print(sv.device_type(), type(sv.last_trace()).__name__)",
]


def execute(use: str, tmp_path):
    return run_cells([use if c == "USE" else c for c in CELLS], tmp_path)


def test_the_same_cells_under_local_and_gloo(cluster, tmp_path):
    sv.use("local")  # the kernel below re-initialises the engines' process group
    conn = cluster.connection
    local = execute("%shardviz use local 2", tmp_path)
    real = execute(
        f"%shardviz use gloo 2 timeout=10 progress=False profile_dir={conn['profile_dir']} "
        f"cluster_id={conn['cluster_id']}",
        tmp_path,
    )
    assert "local backend, 2 ranks" in text(local[1])
    assert "gloo backend, 2 ranks" in text(real[1])
    for out in (local, real):
        assert text(out[2]) == "('S(0)',)"
        assert text(out[6]) == "LocalTensor(\n  0: 28.0,\n  1: 28.0\n)"
        assert text(out[8]) == "LocalTensor(\n  0: tensor([2., 2.]),\n  1: tensor([2., 2.])\n)"
    assert text(local[3]).strip() == "local 2 ['scatter', 'all_gather']"
    assert text(real[3]).strip() == "gloo 2 ['scatter', 'all_gather']"
    assert text(local[4]) == "local rows: 2\n"
    assert text(real[4]) == "[rank 0] local rows: 2\n[rank 1] local rows: 2\n"  # rank order
    widget = "application/vnd.jupyter.widget-view+json"
    assert widget in local[5][0].data and widget in real[5][0].data
    assert text(real[5]) == text(local[5]) and "values: ranks 0-1" in text(real[5])
    assert text(local[7]).startswith("KeyError:")
    assert text(real[7]).startswith("RankError: ranks 0, 1 raised KeyError: 'inside the cell'")
    assert "<spmd-cell-" in text(real[7]) and "raise KeyError('inside the cell')" in text(real[7])
    assert text(local[9]).strip() == "cpu Trace"
    assert text(real[9]).strip() == "cpu Trace"
