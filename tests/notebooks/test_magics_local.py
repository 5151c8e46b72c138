"""%load_ext shardviz, %shardviz use local N and %%spmd cells, run in a real kernel by nbclient."""

from __future__ import annotations

import pytest
from nbcells import run_cells
from nbcells import text as cell_text

CELLS = [
    "import shardviz as sv\n%load_ext shardviz",
    "%shardviz use local 4",
    (
        "%%spmd\n"
        "import torch\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Shard, Replicate, distribute_tensor\n"
        "mesh = init_device_mesh('cpu', (4,))\n"
        "dt = distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])\n"
        "full = dt.redistribute(mesh, [Replicate()])\n"
        "sv.layout(dt).placements"
    ),
    "print(type(dt).__name__, [c.op for c in sv.last_trace().collectives()])",
    "%%spmd --values=none\nfull.to_local() * 2;",
    "print([e.kind for e in sv.last_trace().events], type(torch.ones(1)).__name__)",
    "%%spmd\nraise KeyError('inside the cell')",
    "from shardviz.capture import torch as _torch\n"
    "print('modes left:', len(_torch.dispatch_mode_stack()), type(torch.ones(1)).__name__)",
    "%shardviz status",
]


@pytest.mark.timeout(180)
def test_spmd_cells_in_a_kernel(tmp_path):
    out = run_cells(CELLS, tmp_path)

    def text(i):
        return cell_text(out[i])

    assert "local backend, 4 ranks" in text(1)
    assert text(2) == "('S(0)',)"  # the cell's last expression is displayed
    assert text(3).strip() == "DTensor ['scatter', 'all_gather']"  # names land in the notebook
    assert text(4) == ""  # a trailing semicolon hides the value
    # to_local() is recorded, and so is the local compute on its result; outside, tensors are plain.
    assert text(5).strip() == "['op', 'local'] Tensor"
    assert text(6).startswith("KeyError:") and "inside the cell" in text(6)
    assert text(7).strip() == "modes left: 0 Tensor"
    assert "LocalBackend(world_size=4" in text(8)


def test_magic_argument_parsing():
    from shardviz.magics import parse_use, parse_values

    expected = ("gloo", 4, {"timeout": 10, "profile": "x"})
    assert parse_use(["gloo", "4", "timeout=10", "--profile=x"]) == expected
    assert parse_use(["local"]) == ("local", None, {})
    with pytest.raises(ValueError, match="whole number"):
        parse_use(["local", "four"])
    with pytest.raises(ValueError, match="usage"):
        parse_use([])
    assert parse_values("none") == "none" and parse_values("1000") == 1000
    with pytest.raises(ValueError, match="byte budget"):
        parse_values("lots")
