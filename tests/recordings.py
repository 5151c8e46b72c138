"""Recordings several test folders draw from (tests/ is on the path of every test module)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardviz as sv
from shardviz.data.trace import Trace


def every_collective() -> Trace:
    """The 03_collectives notebook's recording: every collective once on 4 ranks, each rank's
    values told apart (rank r holds arange + 10 r)."""
    sv.use("local", world_size=4)

    def mine(n: int) -> torch.Tensor:
        return sv.per_rank(lambda r: torch.arange(n, dtype=torch.float32) + 10 * r)

    with sv.record() as t:
        dist.all_reduce(mine(4))
        dist.broadcast(mine(3), src=2)
        dist.all_gather_into_tensor(torch.zeros(8), mine(2))
        dist.reduce_scatter_tensor(torch.zeros(2), mine(8))
        dist.all_to_all_single(torch.zeros(8), mine(8))
        dist.scatter(torch.zeros(2), [torch.full((2,), float(k)) for k in range(4)], src=0)
        dist.gather(mine(2), [torch.zeros(2) for _ in range(4)], dst=0)
        dist.reduce(mine(2), dst=0)
        dist.barrier()
    return t
