"""Every memo the recorder keeps from one recording to the next, in one place.

Recording the same program again (a loop, a training step, the next cell) meets the same source
lines, ops, redistributes and groups; remembering what each stands for keeps the per-event cost
low. What a group name stands for holds only while the world that named it lives: ``per_world``
starts afresh with a new world group (``sv.use``, ``sv.restart``), and ``clear`` forgets all.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from ...data.events import Source
from .. import torch as _torch

T = TypeVar("T")

# The user's source line, by code position (code object, instruction offset).
SOURCES: dict[tuple[Any, int], Source] = {}
# Layouts before and after a redistribute, by (id of the source spec, target mesh, placements);
# each entry holds the spec, so that its id is not reused while the entry lives.
LAYOUTS: dict[tuple[Any, ...], tuple[Any, Any]] = {}
# The (position, name) of each argument an op writes, by op.
WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}
# What a code object is to the walk to the user's line (``frames``), by code object.
CODE_KINDS: dict[Any, int] = {}

_WORLD: dict[tuple[Any, ...], Any] = {}
_WORLD_OWNER: list[Any] = [None]  # the world group _WORLD belongs to (held: its id stays its own)
_MEMOS: list[Any] = []  # functools caches, cleared with the rest


def remember(table: dict[Any, Any], key: Any, value: T, limit: int) -> T:
    """Store ``value`` under ``key``, forgetting the whole table first once it holds ``limit``
    entries: a long session stays bounded without the cost of tracking recency."""
    if len(table) >= limit:
        table.clear()
    table[key] = value
    return value


def per_world(key: tuple[Any, ...], make: Callable[[], T]) -> T:
    """What a group name stands for (its rank tiling, its description), kept across recordings for
    as long as the world group lives. A new world can reuse the old names for other groups."""
    world = _torch.dist.group.WORLD
    if _WORLD_OWNER[0] is not world:
        _WORLD.clear()
        _WORLD_OWNER[0] = world
    hit = _WORLD.get(key)
    if hit is None:
        hit = remember(_WORLD, key, make(), 2048)
    return hit


def memo(maxsize: int | None) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """``functools.lru_cache`` (``maxsize=None``: unbounded), registered so that ``clear`` empties it."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        _MEMOS.append(cached)
        return cached

    return wrap


def clear() -> None:
    """Forget everything remembered (tests, and a world torn down)."""
    for table in (SOURCES, LAYOUTS, WRITTEN, CODE_KINDS, _WORLD):
        table.clear()
    _WORLD_OWNER[0] = None
    for cached in _MEMOS:
        cached.cache_clear()
