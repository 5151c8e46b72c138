"""Hugging Face accelerate: its per-process singletons, one per simulated rank.

accelerate keeps the state of "this process" in Borg singletons: ``PartialState`` (which process
this is: ``process_index``, ``num_processes``, the distributed type, the device),
``AcceleratorState`` and ``GradientState``, each a class-level ``_shared_state`` dict that every
instance uses as its ``__dict__``. On real ranks each process has its own.

- Under ``sv.use("threads")`` each rank thread holds its own contents of those dicts (swapped in
  with the rank's turn, ``capture.torch.register_process_dict``), so ``Accelerator(cpu=True)`` on
  rank r finds rank r's process group and is process r of N, as under torchrun.
- The lockstep simulator runs every rank in one process: there is no one ``process_index`` to
  give, and accelerate would fall back to a single process without a word. ``PartialState()``
  (which ``Accelerator()`` makes) is refused there with the way out.

Imported only once accelerate is (``shardviz.capture.adapters``); it reads accelerate from
``sys.modules`` and never imports it.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

from ...errors import PerRankValueError
from .. import adapters
from .. import torch as _torch

NAME = "accelerate"
_STATE = "accelerate.state"
_SINGLETONS = ("PartialState", "AcceleratorState", "GradientState")

_lock = threading.Lock()
_hooked = False


def activate() -> None:
    """Nothing up front: accelerate's state is hooked when ``accelerate.state`` is loaded."""


def module_loaded(name: str) -> None:
    if name == _STATE:
        _hook_state()


def recording_started(rec: adapters.Recording) -> None:
    """Nothing to do: the singletons are per rank thread, and refused in lockstep when made."""


def handles(obj: object) -> bool:
    return False  # accelerate has no sharded tensor type of its own


def handles_spec(spec: object) -> bool:
    return False


def explain_error(error: BaseException, where: list[tuple[str, str]], lockstep: bool) -> str | None:
    return None  # its refusal below says everything


REFUSAL = (
    "accelerate's PartialState (which Accelerator() makes) is the state of one process: it "
    "reads this process's rank and the world size once (process_index, num_processes, the "
    "distributed type, the device), and accelerate code then branches on them (is_main_process, "
    "split_between_processes, the data each process loads). The lockstep simulator runs every rank "
    "at once in one process, so it has no one process_index to give, and accelerate would silently "
    "run as a single process (DistributedType.NO). Run accelerate code with one thread per rank, "
    "where each rank is a process of its own with its own PartialState: "
    "sv.use('threads', world_size=N), then sv.run(fn) or a %%spmd cell (or on real ranks: "
    "sv.use('gloo', world_size=N))."
)


def _hook_state() -> None:
    """Register the singletons' dicts as per-process, and refuse PartialState in lockstep."""
    global _hooked
    module = sys.modules.get(_STATE)
    if module is None or _hooked:
        return
    with _lock:
        if _hooked:
            return
        for cls_name in _SINGLETONS:
            cls = getattr(module, cls_name, None)
            if cls is not None and isinstance(cls.__dict__.get("_shared_state"), dict):
                _torch.register_process_dict(f"accelerate's {cls_name}", functools.partial(_shared, cls))
        partial = getattr(module, "PartialState", None)
        if partial is not None:
            original = partial.__init__

            @functools.wraps(original)
            def init(self: Any, *args: Any, **kwargs: Any) -> None:
                rec = adapters.recording()
                if rec is not None and rec.rank is None:
                    raise PerRankValueError(REFUSAL)
                original(self, *args, **kwargs)

            partial.__init__ = init
        _hooked = True


def _shared(cls: type) -> dict[str, Any]:
    state: dict[str, Any] = cls.__dict__["_shared_state"]
    return state
