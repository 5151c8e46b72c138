"""The simulator's own tensor ops never show up in the user's dispatch modes.

torch's ``CommDebugMode`` (``noise_level=3``) and ``DebugMode`` list every aten op the user's code
runs. Two of the simulator's reads ran aten ops under them: shardviz reading a mesh's shape
(``mesh.mesh`` computes the tensor with ``eq``, ``nonzero``, ``item``) the first time it recorded an
op on that mesh, and LocalTensorMode computing each rank's coordinates on a mesh's first use. A
threads run listed them on whichever rank got there first, once in a few runs under load.

Expectation: the ops real gloo ranks list for the same code (``torchrun --nproc-per-node 4``,
torch 2.13), written out by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

import shardviz as sv
from shardviz.capture import torch as _torch

# What gloo ranks list, by hand: the scatter of distribute_tensor, then the all-gather.
REAL_OPS = [
    "aten.detach.default",
    "aten.split.Tensor",
    "aten.empty_like.default",
    "c10d.scatter_.default",
    "_c10d_functional.all_gather_into_tensor.default",
    "_c10d_functional._wrap_tensor_autograd.default",
    "_c10d_functional.wait_tensor.default",
]


def _ops_listed(table: str) -> list[str]:
    return [line.split("**", 1)[1].split("\x1b")[0] for line in table.splitlines() if "**" in line]


def _first_use_in_mode() -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    x = torch.arange(16.0).reshape(4, 4)
    with CommDebugMode() as comm:
        distribute_tensor(x, tp, [Shard(0)]).redistribute(tp, [Replicate()])
    return comm.generate_comm_debug_tracing_table(noise_level=3)


@pytest.mark.parametrize("backend", ["local", "threads"])
def test_a_meshs_first_use_lists_only_the_users_ops(backend):
    sv.use(backend, world_size=4)
    tables = sv.run(_first_use_in_mode, values="none").results
    for rank in range(4):
        assert _ops_listed(tables[rank]) == REAL_OPS, rank


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def test_reading_a_new_meshs_shape_runs_no_op_the_user_sees():
    sv.use("local", world_size=4)
    with sv.record(values="none"):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tp = mesh["tp"]
        with _Ops() as spy:
            shape, names, ranks = _torch.mesh_info(tp)
    assert spy.seen == []
    assert (shape, names, ranks) == ((2,), ("tp",), (0, 1))
