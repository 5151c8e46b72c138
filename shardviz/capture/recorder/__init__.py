"""Capture: the dispatch mode that turns a simulated (or one real rank's) SPMD run into a Trace.

- ``mode``: the Recorder, a dispatch mode that sees every op and makes the events;
- ``specs``: how to read each collective op's arguments;
- ``frames``: the user's source line for each event;
- ``snapshot``: per-rank snapshots of the tensors, under one value budget;
- ``c10d``: what the simulation does for the collectives LocalTensorMode lacks or gets wrong;
- ``redistribute``: DTensor's redistributes as scopes around their collectives;
- ``caches``: every memo kept from one recording to the next.
"""

from .c10d import PlainTensorCollectiveError
from .mode import Recorder, SharedLocalWriteError, mesh_dim
from .snapshot import ValueBudget, split_per_rank, to_numpy

__all__ = [
    "PlainTensorCollectiveError",
    "Recorder",
    "SharedLocalWriteError",
    "ValueBudget",
    "mesh_dim",
    "split_per_rank",
    "to_numpy",
]
