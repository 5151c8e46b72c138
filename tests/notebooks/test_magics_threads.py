"""%shardviz use threads N and %%spmd cells (one thread per rank), run in a real kernel by nbclient."""

from __future__ import annotations

import pytest
from nbcells import run_cells
from nbcells import text as cell_text

CELLS = [
    "import shardviz as sv\n%load_ext shardviz",
    "%shardviz use threads 4",
    (
        "%%spmd\n"
        "import torch\n"
        "import torch.distributed as dist\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Shard, Replicate, distribute_tensor\n"
        "rank = dist.get_rank()\n"
        "mesh = init_device_mesh('cpu', (4,))\n"
        "dt = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])\n"
        "if rank == 0:\n"
        "    print('only rank', rank)\n"
        "sv.layout(dt).placements"
    ),
    "print('dt' in dir(), [c.op for c in sv.last_trace().collectives()])",
    "%%spmd\nfull = dt.redistribute(mesh, [Replicate()])\nsv.show(dt)",
    "%%spmd\nfull.to_local()[rank].tolist()",
    "%%spmd\nif rank == 1:\n    raise KeyError('inside the cell')",
    "%shardviz status",
    (
        "%%spmd --compare\n"
        "import torch\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Shard, Replicate, distribute_tensor\n"
        "m = init_device_mesh('cpu', (4,))\n"
        "distribute_tensor(torch.ones(4, 4), m, [Shard(1)]).redistribute(m, [Replicate()]).to_local().sum()"
    ),
]


@pytest.mark.timeout(180)
def test_spmd_cells_on_one_thread_per_rank(tmp_path):
    out = run_cells(CELLS, tmp_path)

    def text(i):
        return cell_text(out[i])

    assert "threads backend, 4 ranks" in text(1)
    assert text(2) == "[rank 0] only rank 0\n('S(0)',)"  # the rank's print, then the cell's value
    assert text(3).strip() == "False ['scatter']"  # names live on the ranks, the trace here
    # the layout view of every rank's shard, drawn in the notebook (its text form here)
    assert text(4).startswith("Layout (5, 2) float32 on mesh (4,) placements [S(0)]")
    assert text(4).endswith("values: ranks 0-3")
    per_rank = " ".join(text(5).split())  # a value per rank (pretty-printed over lines)
    assert per_rank == "rank 0: [0.0, 1.0] rank 1: [2.0, 3.0] rank 2: [4.0, 5.0] rank 3: [6.0, 7.0]"
    assert text(6).startswith("KeyError:") and "inside the cell" in text(6)
    assert "ThreadsBackend(world_size=4)" in text(7)
    assert "simulator vs threads, 4 ranks" in text(8) and "no differences" in text(8)
