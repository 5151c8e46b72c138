"""Pipelining in a threaded run: ``torch.distributed.pipelining``'s stage class patched to report
each stage's compute and its sends and receives, and to know its rank in the pipeline group."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

# A stage's compute methods, and the name each one's ComputeEvent carries.
STAGE_COMPUTE_NAMES = {
    "forward_one_chunk": "forward",
    "backward_one_chunk": "backward",
    "backward_weight_one_chunk": "backward_weight",
}
_STAGE_METHODS = tuple(STAGE_COMPUTE_NAMES)
# A stage's methods that list the P2POps it is about to run, and the phase that traffic is in.
STAGE_OPS_PHASES = {
    "get_fwd_send_ops": "forward",
    "get_fwd_recv_ops": "forward",
    "get_bwd_send_ops": "backward",
    "get_bwd_recv_ops": "backward",
}
_STAGE_OPS = tuple(STAGE_OPS_PHASES)


@contextlib.contextmanager
def pipeline_stage_hooks(group_rank: Any, on_compute: Any, on_ops: Any) -> Iterator[None]:
    """While a threaded run lasts, patch ``torch.distributed.pipelining``'s stage class:
    ``group_rank(group)`` gives a new stage its rank in the pipeline group (``dist.get_rank`` is
    0, or a per-rank value, in the simulator); ``on_compute(stage_index, method, chunk)`` is a
    context manager around each forward / backward chunk; ``on_ops(stage_index, method, chunk,
    ops)`` sees the P2POps a stage is about to send or receive."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        yield
        return
    originals: dict[str, Any] = {}
    init = _PipelineStageBase.__dict__["__init__"]

    @functools.wraps(init)
    def stage_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.group_rank = group_rank(self.group)

    originals["__init__"] = init
    _PipelineStageBase.__init__ = stage_init  # type: ignore[method-assign]

    def compute(name: str, orig: Any) -> Any:
        @functools.wraps(orig)
        def wrapped(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            with on_compute(int(self.stage_index), name, int(chunk)):
                return orig(self, chunk, *args, **kwargs)

        return wrapped

    def ops(name: str, orig: Any) -> Any:
        @functools.wraps(orig)
        def wrapped(self: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            out = orig(self, chunk, *args, **kwargs)
            on_ops(int(self.stage_index), name, int(chunk), [op.tensor for op in out])
            return out

        return wrapped

    for name in (*_STAGE_METHODS, *_STAGE_OPS):
        orig = _PipelineStageBase.__dict__.get(name)
        if orig is None:
            continue
        originals[name] = orig
        setattr(_PipelineStageBase, name, (compute if name in _STAGE_METHODS else ops)(name, orig))
    try:
        yield
    finally:
        for name, orig in originals.items():
            setattr(_PipelineStageBase, name, orig)
