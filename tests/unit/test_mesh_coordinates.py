"""A sub-mesh's coordinates are its own, even when it takes the id of a mesh that died.

torch 2.13's LocalTensorMode caches each mesh's per-rank coordinates by ``id(mesh)``; a new mesh
that reused a dead one's id got the dead one's coordinates (a ``mesh["tp"]``'s answered for a
``mesh["dp"]``): ``sv.diff`` of a vocab-parallel embedding whose offset came from the wrong group
then found nothing, in about one run of six. Whether CPython hands a dead mesh's id to the next one
is up to its allocator, so the test checks the cause directly too: once a mesh dies, the cache
holds nothing under its id. Expectation: the row-major coordinates of a (2, 4) mesh, by hand.
"""

from __future__ import annotations

import gc

from torch.distributed.device_mesh import init_device_mesh

import shardviz as sv
from shardviz.capture import torch as _torch

DP = [0, 0, 0, 0, 1, 1, 1, 1]
TP = [0, 1, 2, 3, 0, 1, 2, 3]


def _per_rank(v):
    return [int(v)] * 8 if isinstance(v, int) else _torch.per_rank_ints(v)


def test_a_sub_mesh_never_answers_with_a_dead_meshs_coordinates():
    sv.use("local", world_size=8)
    with sv.record(values="none"):
        # torch's own cache, keyed by id(mesh) on 2.13 (by what the coordinates come from on 2.14+)
        cache = _torch.active_local_mode()._coordinate_cache
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        for _ in range(8):
            tp = mesh["tp"]
            assert _per_rank(tp.get_local_rank()) == TP
            dead = id(tp)
            del tp
            gc.collect()
            assert dead not in cache  # gone with its mesh, before any new mesh can take the id
            dp = mesh["dp"]
            assert _per_rank(dp.get_local_rank()) == DP
            del dp
            gc.collect()
