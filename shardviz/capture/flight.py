"""Writing this process's PyTorch Flight Recorder buffer to a file, for ``sv.load`` to align.

Reading and aligning the dumps of every rank is ``shardviz.data.flight``'s; this is the one step
that needs the live process group.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import torch as _torch
from .job import rank_and_world


def dump(folder: str | Path, rank: int | None = None) -> Path:
    """Write this process's Flight Recorder buffer as JSON to ``folder/flight00003.json``
    (atomically: a temporary file, then a rename). Needs ``TORCH_FR_BUFFER_SIZE`` set before the
    process group was made, else the buffer is empty."""
    rank = rank_and_world()[0] if rank is None else rank
    path = Path(folder) / f"flight{rank:05d}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(_torch.flight_recorder_dump())
    os.replace(tmp, path)
    return path
