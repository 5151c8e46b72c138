"""DistributedDataParallel in the lockstep simulator: refused at construction, with the way out.

DDP's reducer is C++: at construction it checks every parameter's storage across the processes,
and in the backward it copies the gradients into buckets of its own storage and all-reduces them
through the process group directly. A lockstep tensor holds every rank's value side by side (a
LocalTensor, whose storage holds no data), so torch fails inside DDP with "The tensor has a
non-zero number of elements, but its data is not allocated yet", or another error depending on
the model. Refused before that, the same way every time, naming what runs DDP: one thread per rank,
where each rank's tensors are plain (DDP's all-reduces are recorded there), or real process groups.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from ...errors import LockstepLimitError
from .modes import active_local_mode

REFUSAL = (
    "DistributedDataParallel cannot run in the lockstep simulator: its reducer is C++ code that checks "
    "the parameters' storage across processes and copies gradients into buckets of its own storage, "
    "and a lockstep tensor holds every rank's value side by side with no single storage (torch would "
    "fail inside DDP with 'data is not allocated yet'). Run DDP with one thread per rank, where each "
    "rank's tensors are plain and DDP's gradient all-reduces are recorded: "
    "sv.use('threads', world_size=N), then sv.run(fn) or a %%spmd cell (or on real ranks: "
    "sv.use('gloo', world_size=N)). In the lockstep simulator, FSDP2's fully_shard runs data "
    "parallel training."
)

_lock = threading.Lock()
_depth = 0
_original: dict[str, Any] = {}


def _refused_init(original: Any) -> Any:
    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        if active_local_mode() is not None:
            raise LockstepLimitError(REFUSAL)
        original(self, *args, **kwargs)

    return init


@contextlib.contextmanager
def ddp_refused() -> Iterator[None]:
    """While the lockstep simulation runs, ``DistributedDataParallel(...)`` raises (see above)."""
    global _depth
    with _lock:
        if _depth == 0:
            _original["init"] = DistributedDataParallel.__dict__["__init__"]
            DistributedDataParallel.__init__ = _refused_init(_original["init"])  # type: ignore[method-assign]
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                DistributedDataParallel.__init__ = _original.pop("init")  # type: ignore[method-assign]
