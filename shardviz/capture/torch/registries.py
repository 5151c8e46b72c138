"""Process-wide registries that each rank thread holds as its own (``sv.use("threads")``).

A real rank is a process: whatever a library keeps at module or class level (torch's global
module hooks, which ``CommDebugMode`` registers; DTensor's random-number tracker; accelerate's
``PartialState`` singleton; the environment; the intra-op thread count) is that rank's alone. The
rank threads share one process, and one rank runs at a time, so each rank's contents are swapped
in with the baton (``rank_threads.process_state``): ``save()`` takes what the running rank holds,
``restore()`` puts a rank's back. A registry dict keeps its identity (handles and instances hold
it); only its contents change hands.

Framework adapters register their own singletons with ``register_process_dict`` when their
framework is imported (``shardviz.capture.adapters``).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# torch.nn.Module's global hooks (register_module_forward_hook and its kin): module-level dicts,
# and one flag that register_module_full_backward_hook rebinds.
_MODULE = "torch.nn.modules.module"
_MODULE_HOOK_DICTS = (
    "_global_buffer_registration_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_backward_pre_hooks",
    "_global_backward_hooks",
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs",
)
# Module attributes a process rebinds: the full-backward-hook flag, DTensor's RNG tracker (made
# on a rank's mesh by the first random op on a DTensor).
_ATTRIBUTES = (
    (_MODULE, "_global_is_full_backward_hook"),
    ("torch.distributed.tensor._random", "_rng_tracker"),
)


@dataclass(frozen=True)
class _Dict:
    name: str  # for messages: "accelerate's PartialState"
    get: Callable[[], dict[Any, Any]]  # the live dict
    initial: dict[Any, Any]  # its contents when registered: what a rank that never touched it holds


_lock = threading.Lock()
_dicts: dict[str, _Dict] = {}


def register_process_dict(name: str, get: Callable[[], dict[Any, Any]]) -> None:
    """``get()`` is a dict whose contents belong to a process (a framework's singleton state): from
    now on each rank thread holds its own. Registering the same name again is a no-op."""
    with _lock:
        if name not in _dicts:
            _dicts[name] = _Dict(name, get, dict(get()))


def process_dict_names() -> list[str]:
    return sorted(_dicts)


# --- the environment ------------------------------------------------------------------------------
# Each rank sees the notebook's environment plus what it set or removed itself (accelerate sets
# RANK, MASTER_PORT, ...). ``_base`` is the notebook's, taken when the first rank switches in;
# ``_applied`` the running rank's changes over it (None: the notebook's own state is in place),
# ``_target`` the environment that made. Compared as os.environ's own bytes mapping (a dict
# comparison, ~1 us), so a switch that changes nothing costs nothing: decoding the whole
# environment on every switch cost ~0.2 ms.
_NOTEBOOK = None
Changes = dict[bytes, bytes | None]
_base: dict[bytes, bytes] = {}
_applied: Changes | None = None
_target: dict[bytes, bytes] = {}


def _raw() -> dict[bytes, bytes]:
    data: dict[bytes, bytes] = os.environ._data  # type: ignore[attr-defined]
    return data


def _environ_changes() -> Changes | None:
    if _applied is None:
        return _NOTEBOOK
    now = _raw()
    if now == _target:
        return _applied
    changes: Changes = {k: v for k, v in now.items() if _base.get(k) != v}
    changes.update({k: None for k in _base if k not in now})
    return changes


def _set_environ(changes: Changes | None) -> None:
    global _base, _applied, _target
    if _applied is None:
        if changes is None:
            return
        _base = dict(_raw())
    want = dict(_base)
    for k, v in (changes or {}).items():
        if v is None:
            want.pop(k, None)
        else:
            want[k] = v
    now = _raw()
    if now != want:
        decode = os.fsdecode
        for k in [k for k in now if k not in want]:
            del os.environ[decode(k)]
        for k, v in want.items():
            if now.get(k) != v:
                os.environ[decode(k)] = decode(v)
    _applied = changes
    _target = want


# --- saving and restoring -------------------------------------------------------------------------


@dataclass(frozen=True)
class Registries:
    """What one process holds in the registries, as plain copies."""

    hooks: dict[str, dict[Any, Any]]
    attributes: dict[tuple[str, str], Any]
    dicts: dict[str, dict[Any, Any]]
    environ: Changes | None
    threads: int

    def for_a_rank(self) -> Registries:
        """A rank's starting state from the notebook's: the same contents, its own copies (and the
        notebook's environment, with no change of its own yet)."""
        return Registries(
            {k: dict(v) for k, v in self.hooks.items()},
            dict(self.attributes),
            {k: dict(v) for k, v in self.dicts.items()},
            dict(self.environ or {}),
            self.threads,
        )


def save() -> Registries:
    module = sys.modules[_MODULE]
    attributes = {}
    for mod, attr in _ATTRIBUTES:
        owner = sys.modules.get(mod)
        if owner is not None:
            attributes[(mod, attr)] = getattr(owner, attr, None)
    return Registries(
        {name: dict(hooks) for name in _MODULE_HOOK_DICTS if (hooks := getattr(module, name))},
        attributes,
        {name: dict(d.get()) for name, d in list(_dicts.items())},
        _environ_changes(),
        torch.get_num_threads(),
    )


def _refill(live: dict[Any, Any], contents: dict[Any, Any]) -> None:
    if not live and not contents:
        return
    if live != contents or list(live) != list(contents):
        live.clear()
        live.update(contents)


def restore(saved: Registries) -> None:
    module = sys.modules[_MODULE]
    for name in _MODULE_HOOK_DICTS:
        _refill(getattr(module, name), saved.hooks.get(name, {}))
    for (mod, attr), value in saved.attributes.items():
        owner = sys.modules.get(mod)
        if owner is not None and getattr(owner, attr, None) is not value:
            setattr(owner, attr, value)
    for mod, attr in _ATTRIBUTES:  # imported since this state was saved: as it started
        if (mod, attr) not in saved.attributes and mod in sys.modules and mod != _MODULE:
            setattr(sys.modules[mod], attr, None)
    for name, d in list(_dicts.items()):
        _refill(d.get(), saved.dicts.get(name, d.initial))
    _set_environ(saved.environ)
    if torch.get_num_threads() != saved.threads:
        torch.set_num_threads(saved.threads)
