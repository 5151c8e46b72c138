"""A rank's own state while its process group lives: who it is, its spin limit, its ``sv.show`` parts.

One per engine, set by ``startup.setup`` and cleared by ``teardown``; the other modules read it as
``state.current`` (never a copy of the name, which would miss a later setup).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ...errors import BackendError


@dataclass
class RankState:
    rank: int
    world_size: int
    backend: str
    local_rank: int
    timeout_s: float
    spin_limit: float = math.inf
    on_spin: str = "warn"
    shows: dict[int, dict[str, Any]] = field(default_factory=dict)
    displayed: set[int] = field(default_factory=set)
    next_show: int = 0
    running: bool = False  # a cell or sv.run function runs here: sv.show gathers for the client


current: RankState | None = None


def require() -> RankState:
    """This rank's state, or an error saying how to get a process group back."""
    if current is None or not dist.is_initialized():
        raise BackendError("this engine has no shardviz process group; run sv.restart() in the notebook")
    return current
