"""The version gate: every private torch API shardviz builds on, looked up once at import behind
a version check, so that a torch release that moves one fails with a message naming what moved
instead of an obscure AttributeError deep in a notebook. What moved between supported releases
is detected here too."""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING, Any

import torch

MIN_TORCH = (2, 13)
TESTED_UP_TO = (2, 15)  # `make test-compat` runs the suite on this one

_private: dict[str, Any] = {}

# (module, attribute) pairs shardviz relies on; checked together at import time.
_REQUIRED = {
    "LocalTensor": ("torch.distributed._local_tensor", "LocalTensor"),
    "LocalTensorMode": ("torch.distributed._local_tensor", "LocalTensorMode"),
    "LocalIntNode": ("torch.distributed._local_tensor", "LocalIntNode"),
    "ConstantIntNode": ("torch.fx.experimental._constant_symnode", "ConstantIntNode"),
    "local_tensor_mode": ("torch.distributed._local_tensor", "local_tensor_mode"),
    "StridedShard": ("torch.distributed.tensor.placement_types", "_StridedShard"),
    "DebugMode": ("torch.utils._debug_mode", "DebugMode"),
    "debug_mode_module": ("torch.utils._debug_mode._mode", None),
    "TorchDispatchMode": ("torch.utils._python_dispatch", "TorchDispatchMode"),
    "disable_current_modes": ("torch.utils._python_dispatch", "_disable_current_modes"),
    "dispatch_mode_stack": ("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack"),
    "resolve_process_group": ("torch.distributed.distributed_c10d", "_resolve_process_group"),
    "storage_use_count": ("torch._C", "_storage_Use_Count"),
    "DisableTorchDispatch": ("torch._C", "_DisableTorchDispatch"),
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
    for key, (mod_name, attr) in _REQUIRED.items():
        try:
            mod = importlib.import_module(mod_name)
            _private[key] = mod if attr is None else getattr(mod, attr)
        except (ImportError, AttributeError) as e:
            missing.append(f"{mod_name}{'.' + attr if attr else ''} ({type(e).__name__})")
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
