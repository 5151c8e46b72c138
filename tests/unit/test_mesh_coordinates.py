"""A sub-mesh's coordinates are its own, even when it takes the id of a mesh that died.

torch 2.13's LocalTensorMode caches each mesh's per-rank coordinates by ``id(mesh)``; a new mesh
that reused a dead one's id got the dead one's coordinates (a ``mesh["tp"]``'s answered for a
``mesh["dp"]``): ``sv.diff`` of a vocab-parallel embedding whose offset came from the wrong group
then found nothing, in about one run of six. Expectation: the row-major coordinates of a (2, 4)
mesh, written out by hand.
"""

from __future__ import annotations

import gc

import pytest
from torch.distributed.device_mesh import init_device_mesh

import shardviz as sv
from shardviz.capture import torch as _torch

DP = [0, 0, 0, 0, 1, 1, 1, 1]
TP = [0, 1, 2, 3, 0, 1, 2, 3]


def _per_rank(v):
    return [int(v)] * 8 if isinstance(v, int) else _torch.per_rank_ints(v)


@pytest.mark.slow  # ~40 s: sub-meshes are built until a dead one's id is taken
@pytest.mark.timeout(240)
def test_a_sub_mesh_never_answers_with_a_dead_meshs_coordinates():
    sv.use("local", world_size=8)
    reused = 0
    with sv.record(values="none"):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        for _ in range(100):  # until a dead mesh's id is taken by the next one, twice
            tp = mesh["tp"]
            assert _per_rank(tp.get_local_rank()) == TP
            dead = id(tp)
            del tp
            gc.collect()
            dp = mesh["dp"]
            reused += id(dp) == dead
            assert _per_rank(dp.get_local_rank()) == DP
            del dp
            gc.collect()
            if reused >= 2:
                break
    assert reused > 0, "no id was reused: the test did not reach the case it is for"
