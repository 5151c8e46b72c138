"""The version gate: every private torch API shardviz builds on, looked up once at import behind
a version check, so that a torch release that moves one fails with a message naming what moved
instead of an obscure AttributeError deep in a notebook. What moved between supported releases
is detected here too."""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Any

import torch

MIN_TORCH = (2, 11)
TESTED_UP_TO = (2, 15)  # `make test-compat` runs the suite on this one

_private: dict[str, Any] = {}

# (module, attribute) pairs shardviz relies on; checked together at import time. A list holds the
# places one API has had across the supported releases, newest first.
_REQUIRED: dict[str, tuple[str, str | None] | list[tuple[str, str | None]]] = {
    "LocalTensor": ("torch.distributed._local_tensor", "LocalTensor"),
    "LocalTensorMode": ("torch.distributed._local_tensor", "LocalTensorMode"),
    "LocalIntNode": ("torch.distributed._local_tensor", "LocalIntNode"),
    "ConstantIntNode": ("torch.fx.experimental._constant_symnode", "ConstantIntNode"),
    "local_tensor_mode": ("torch.distributed._local_tensor", "local_tensor_mode"),
    "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard"),
    "DebugMode": ("torch.utils._debug_mode", "DebugMode"),
    # DebugMode's module (its active-mode counter): a package from 2.13, one file before
    "debug_mode_module": [("torch.utils._debug_mode._mode", None), ("torch.utils._debug_mode", None)],
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "disable_current_modes": ("torch.utils._python_dispatch", "_disable_current_modes"),
    "dispatch_mode_stack": ("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack"),
    "resolve_process_group": ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    "storage_use_count": ("torch._C", "_storage_Use_Count"),
    "DisableTorchDispatch": ("torch._C", "_DisableTorchDispatch"),
    "push_dispatch_mode": ("torch._C", "_push_on_torch_dispatch_stack"),
    "pop_dispatch_mode": ("torch._C", "_pop_torch_dispatch_stack"),
    "local_reduce": ("torch.distributed._local_tensor._c10d", "_local_reduce"),
    "local_tensor_module": ("torch.distributed._local_tensor", None),
}


class TorchVersionError(ImportError):
    """The installed torch lacks (or moved) an API that shardviz builds on."""


def _version(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _load() -> None:
    if _version(torch.__version__) < MIN_TORCH:
        raise TorchVersionError(
            f"shardviz needs torch>={MIN_TORCH[0]}.{MIN_TORCH[1]} (LocalTensorMode); this is torch "
            f"{torch.__version__}. Install it with: pip install 'torch=={MIN_TORCH[0]}.{MIN_TORCH[1]}.0'"
        )
    missing = []
    for key, places in _REQUIRED.items():
        tried = []
        for mod_name, attr in places if isinstance(places, list) else [places]:
            try:
                mod = importlib.import_module(mod_name)
                _private[key] = mod if attr is None else getattr(mod, attr)
                break
            except (ImportError, AttributeError) as e:
                tried.append(f"{mod_name}{'.' + attr if attr else ''} ({type(e).__name__})")
        else:
            missing.append(" or ".join(tried))
    if missing:
        raise TorchVersionError(
            f"torch {torch.__version__} moved or removed private APIs shardviz relies on: "
            + ", ".join(missing)
            + f". shardviz is tested with torch {MIN_TORCH[0]}.{MIN_TORCH[1]} to {TESTED_UP_TO[0]}."
            f"{TESTED_UP_TO[1]}; install one of those or report the torch version at the shardviz "
            "issue tracker."
        )


_load()

LocalTensor = _private["LocalTensor"]
LocalTensorMode = _private["LocalTensorMode"]
LocalIntNode = _private["LocalIntNode"]
ConstantIntNode = _private["ConstantIntNode"]
StridedShard = _private["StridedShard"]
DebugMode = _private["DebugMode"]
if TYPE_CHECKING:  # the class itself, for type checking: P2PMode and the Recorder derive from it
    from torch.utils._python_dispatch import TorchDispatchMode
else:
    TorchDispatchMode = _private["TorchDispatchMode"]

# What moved between the torch releases shardviz supports (2.13 to 2.15), detected rather than
# read off the version number, so that a backport or a nightly behaves as what it is:
# - 2.14 made LocalTensorMode patch ``dist.get_rank`` to return a per-rank SymInt (0 on every
#   rank before);
# - 2.14 keyed LocalTensorMode's mesh-coordinate cache by (ndim, rank map, layout) instead of
#   ``id(mesh)`` (see ``reuse_local_mode``).
GET_RANK_PER_RANK = "get_rank" in getattr(_private["local_tensor_module"], "_PATCHED_DIST_FUNCTIONS", ())


def strided_split_factor(p: Any) -> int:
    """A ``_StridedShard``'s split factor as an int: a method from 2.13 (the attribute may hold a
    symbolic value there), a plain attribute before."""
    read = getattr(p, "_split_factor_int", None)
    return int(read()) if read is not None else int(p.split_factor)


# torch.compile under the simulation: from 2.13 LocalTensorMode tells Dynamo to compile through it
# (``ignore_compile_internals``); on 2.11 and 2.12 Dynamo skips every frame while it is active,
# so compiled functions and modules run eagerly, uncompiled (right values, every op recorded at
# its own line; nothing about the compiled code is learnt there).
COMPILES_IN_SIMULATION = bool(LocalTensorMode.ignore_compile_internals())
