"""Watching ``DTensor.to_local`` and ``DTensor.from_local`` (Python calls no dispatch mode sees)
while a recording runs, and memoising DTensor's redistribute plan strings meanwhile."""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class UserCallWatch:
    """Call back around ``DTensor.to_local`` and ``DTensor.from_local`` while a simulation is
    recorded: they are Python calls, not dispatched ops, so a dispatch mode cannot see them. Each
    callback gets the calling frame, to tell user code from torch's own calls.

    While any recording runs, DTensor's redistribute plan strings are also memoised: DTensor
    formats one for every redistribute it reports to a DebugMode, and in a loop it is the same
    string every time. The wrappers are made once and installed while a watch is open.
    """

    def __init__(self, on_to_local: Any, on_from_local: Any) -> None:
        self.callbacks = (on_to_local, on_from_local)

    def __enter__(self) -> None:
        if not _watches:
            _swap_watch("wrapper")
        _watches.append(self.callbacks)

    def __exit__(self, *exc: object) -> None:
        _watches.remove(self.callbacks)
        if not _watches:
            _swap_watch("original")


_watches: list[tuple[Any, Any]] = []
_watch_originals: dict[str, Any] = {}


def _swap_watch(which: str) -> None:
    """Put the watch's ``"wrapper"`` or ``"original"`` functions in place."""
    if not _watch_originals:
        from torch.distributed.tensor._redistribute import DTensorRedistributePlanner

        _make_watch_wrappers(DTensorRedistributePlanner)
    w = _watch_originals[which]
    DTensor.to_local = w["to_local"]  # type: ignore[method-assign]
    DTensor.from_local = w["from_local"]  # type: ignore[method-assign]
    _watch_originals["planner"].stringify_transform_infos = w["stringify"]


def _make_watch_wrappers(planner: Any) -> None:
    orig_to_local = DTensor.to_local
    orig_from_local = DTensor.__dict__["from_local"]
    orig_stringify = planner.__dict__["stringify_transform_infos"]
    stringify = orig_stringify.__func__
    plans: dict[Any, str] = {}

    @functools.wraps(orig_to_local)
    def to_local(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig_to_local(self, *args, **kwargs)
        if torch.compiler.is_compiling():
            return out  # traced: a compiled region's calls are no user's to watch
        for on_to_local, _ in list(_watches):
            on_to_local(self, out, sys._getframe(1))
        return out

    @functools.wraps(orig_from_local.__func__)
    def from_local(*args: Any, **kwargs: Any) -> Any:
        out = orig_from_local.__func__(*args, **kwargs)
        if torch.compiler.is_compiling():
            return out
        for _, on_from_local in list(_watches):
            on_from_local(out, sys._getframe(1))
        return out

    @functools.wraps(stringify)
    def stringify_memo(
        mesh: Any,
        transform_infos: Any,
        src_placement: Any,
        src_shard_order: Any = None,
        use_strided_shard_as_shard_order: bool = False,
    ) -> str:
        # The string depends on the placements, the shard order and each step's kind, mesh dims
        # and placements, not on the mesh itself unless strided shards are normalised with it.
        if use_strided_shard_as_shard_order:
            return stringify(mesh, transform_infos, src_placement, src_shard_order, True)
        try:
            key = (
                mesh.ndim,
                tuple(src_placement),
                src_shard_order,
                tuple(
                    (type(t), t.mesh_dim, t.src_dst_placements, getattr(t, "original_mesh_dims", None))
                    for t in transform_infos
                ),
            )
            hit = plans.get(key)
        except TypeError:  # something unhashable: no memo
            return stringify(mesh, transform_infos, src_placement, src_shard_order)
        if hit is None:
            hit = stringify(mesh, transform_infos, src_placement, src_shard_order)
            if len(plans) > 4096:
                plans.clear()
            plans[key] = hit
        return hit

    _watch_originals.update(
        planner=planner,
        original={
            "to_local": orig_to_local,
            "from_local": orig_from_local,  # a staticmethod, as in the class
            "stringify": orig_stringify,
        },
        wrapper={
            "to_local": to_local,
            "from_local": staticmethod(from_local),
            "stringify": staticmethod(stringify_memo),
        },
    )
