"""What a threads run gives back: each rank's printed output, tagged by rank; its ``sv.show`` parts,
drawn together; its value, as the other backends give it."""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass
from typing import Any

import torch

from ...capture import threadpg
from ...capture import torch as _torch
from ...capture.recorder import split_per_rank


class RankStreams:
    """While a run lasts, what each rank prints is kept apart; afterwards it is written out rank
    by rank, each line tagged ``[rank r]`` (as the real backends show it)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], io.StringIO] = {}
        self.saved: tuple[Any, Any] | None = None

    def __enter__(self) -> RankStreams:
        self.saved = (sys.stdout, sys.stderr)
        sys.stdout = _RankStream(self, "stdout", sys.stdout)
        sys.stderr = _RankStream(self, "stderr", sys.stderr)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.saved is not None
        sys.stdout, sys.stderr = self.saved

    def replay(self) -> None:
        for (name, rank), buf in sorted(self.buffers.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            text = buf.getvalue()
            if text:
                out = sys.stdout if name == "stdout" else sys.stderr
                out.write("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()))
        self.buffers.clear()
        sys.stdout.flush()


class _RankStream(io.TextIOBase):
    def __init__(self, owner: RankStreams, name: str, original: Any) -> None:
        self.owner = owner
        self.name_ = name
        self.original = original

    def write(self, s: str) -> int:
        rank = threadpg.current_rank()
        if rank is None:
            return int(self.original.write(s))
        return self.owner.buffers.setdefault((self.name_, rank), io.StringIO()).write(s)

    def flush(self) -> None:
        if threadpg.current_rank() is None:
            self.original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


@dataclass(frozen=True)
class Shown:
    """What ``sv.show`` returns on a rank: the run draws every rank's part in its place."""

    id: int

    def __repr__(self) -> str:
        return f"<shardviz show #{self.id}>"


def draw_shows(shows: dict[int, dict[int, Any]]) -> dict[int, Any]:
    from ..cluster import draw_show

    return {sid: draw_show(payloads) for sid, payloads in sorted(shows.items())}


def swap_markers(value: Any, widgets: dict[int, Any]) -> Any:
    if isinstance(value, Shown):
        return widgets.get(value.id, value)
    if isinstance(value, list):
        return [swap_markers(v, widgets) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(swap_markers(v, widgets) for v in value)
    if isinstance(value, dict):
        return {k: swap_markers(v, widgets) for k, v in value.items()}
    return value


def cell_value(values: dict[int, Any], widgets: dict[int, Any]) -> Any:
    """A cell's value as the other backends give it: a tensor per rank is a LocalTensor (a DTensor
    its local shards), a value every rank agrees on is that value, others a PerRank dict."""
    from ..cluster import PerRank, same_value

    ranks = sorted(values)
    vals = [split_per_rank(values[r], [r])[r] for r in ranks]
    if all(v is None for v in vals):
        return None
    if all(isinstance(v, torch.Tensor) for v in vals):
        return _torch.new_local_tensor(dict(zip(ranks, vals, strict=True)))
    if all(same_value(vals[0], v) for v in vals[1:]):
        return swap_markers(vals[0], widgets)
    return PerRank({r: swap_markers(v, widgets) for r, v in zip(ranks, vals, strict=True)})
