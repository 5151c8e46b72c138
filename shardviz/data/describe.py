"""Events and shapes in words: the one place each formatting rule lives.

Every text that names an event (a trace's lines, the player's step labels, a merge error, the
memory view's peaks) is built here from the same pieces, so they use the same words. Plain data
in, strings out: no torch, no views.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from .events import CollectiveEvent, Event, LocalEvent, OpEvent, RedistributeEvent, TensorSnapshot

# --- shapes and sizes ----------------------------------------------------------------------------

BYTE_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def byte_unit(n: float) -> tuple[int, str]:
    """The unit ``bytes_text`` writes ``n`` bytes in: (its size in bytes, its name)."""
    size, unit = 1, "B"
    for k, name in enumerate(BYTE_UNITS, 1):
        if abs(n) < 1024**k:
            break
        size, unit = 1024**k, name
    return size, unit


def bytes_text(n: float) -> str:
    """Bytes in words, the one rule for every view and table: exact below 1 KiB (``"768 B"``),
    else one decimal in the largest binary unit, a trailing ``.0`` dropped (``"1.5 KiB"``,
    ``"2 GiB"``); rounded half up. ``bytesText`` in views/static/common.js is the same rule."""
    if n < 0:
        return "-" + bytes_text(-n)
    size, unit = byte_unit(n)
    if size == 1:
        return f"{math.floor(n + 0.5)} B"
    tenths = math.floor(n / size * 10 + 0.5) / 10
    text = repr(tenths)
    return f"{text.removesuffix('.0')} {unit}"


def bytes_exact(n: int) -> str:
    """Exact bytes, and in words past 1 KiB: ``"1536 B (1.5 KiB)"``."""
    n = int(n)
    return f"{n} B" if n < 1024 else f"{n} B ({bytes_text(n)})"


def dims(shape: Sequence[int]) -> str:
    """A shape in an event's line: ``(4,8)``, compact; ``()`` for a scalar."""
    return "(" + ",".join(str(d) for d in shape) + ")"


def shape_tuple(shape: Sequence[int]) -> str:
    """A shape as Python writes the tuple: ``(32, 16)``, ``(8,)``; the model map's columns."""
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def extent(shape: Sequence[int]) -> str:
    """A shape in a picture's label: ``4×8``, ``scalar`` (common.js's ``shapeText`` matches)."""
    return "×".join(str(d) for d in shape) if shape else "scalar"


def snapshot_dims(s: TensorSnapshot | list[TensorSnapshot] | None) -> str:
    """A snapshot's shape, or a list's: ``3x(4,8)`` when they agree, each one when not."""
    if s is None:
        return "-"
    if isinstance(s, list):
        if not s:
            return "[]"
        first = s[0]
        if all(x.shape == first.shape for x in s):
            return f"{len(s)}x{dims(first.shape)}"
        return "[" + ", ".join(dims(x.shape) for x in s) + "]"
    return dims(s.shape)


def rank_runs(ranks: Iterable[int]) -> list[str]:
    """Ranks in order as runs of consecutive ones: ``["0-3", "6", "8-9"]``."""
    out: list[str] = []
    rs = sorted(ranks)
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        out.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return out


def rank_list(ranks: Iterable[int]) -> str:
    """Ranks as ranges: ``0-3, 6, 8-9``."""
    return ", ".join(rank_runs(ranks))


# --- the pieces of an event -----------------------------------------------------------------------


def group(g: Sequence[int]) -> str:
    """``[0,1,2,3]``; past 16 ranks as ranges (``[0-511]``), and past 8 ranges the first 4 and a
    count, so that a group of a million ranks is one short line."""
    if len(g) <= 16:
        return "[" + ",".join(str(r) for r in g) + "]"
    pieces = rank_runs(g)
    if len(pieces) > 8:
        pieces = [*pieces[:4], f"... {len(g)} ranks"]
    return "[" + ",".join(pieces) + "]"


def groups(e: CollectiveEvent) -> str:
    """``groups [0,1] [2,3]``; the first two and a count past four."""
    if not e.groups:
        return "groups []"
    if len(e.groups) <= 4:
        return "groups " + " ".join(group(g) for g in e.groups)
    head = " ".join(group(g) for g in e.groups[:2])
    return f"groups {head} ... ({len(e.groups)} groups of {len(e.groups[0])})"


def collective_head(e: CollectiveEvent, root: bool = True) -> str:
    """``all_reduce sum``, ``broadcast root=1``, ``send 0->1`` (a send or recv names its source and
    destination: its recorded ``root`` is the peer's index in the pair, which reads backwards)."""
    head = e.op + (f" {e.reduce_op}" if e.reduce_op else "")
    if e.op in ("send", "recv") and e.root in (0, 1) and e.groups and len(e.groups[0]) == 2:
        i = 1 - e.root if e.op == "send" else e.root
        src, dst = e.groups[0][i], e.groups[0][1 - i]
        more = f" (+{len(e.groups) - 1} pairs)" if len(e.groups) > 1 else ""
        return f"{head} {src}->{dst}{more}" if root else head
    return head + (f" root={e.root}" if root and e.root is not None else "")


def mesh_dim(e: CollectiveEvent) -> str:
    """The mesh dim a collective ran on: its name, ``dim 1``, or ``""`` when unknown."""
    if e.mesh_dim_name:
        return e.mesh_dim_name
    return f"dim {e.mesh_dim}" if e.mesh_dim is not None else ""


def per_rank_dims(snaps: dict[int, Any]) -> str:
    """Every rank's shape when they agree: ``(2,4)``; when they differ (uneven shards), each
    shape with its ranks: ``{0-1:(3), 2-3:(2)}``, so that no rank's shape stands for all."""
    if not snaps:
        return "-"
    by_shape: dict[str, list[int]] = {}
    for rank in sorted(snaps):
        by_shape.setdefault(snapshot_dims(snaps[rank]), []).append(rank)
    if len(by_shape) == 1:
        return next(iter(by_shape))
    parts = [f"{','.join(rank_runs(ranks))}:{shape}" for shape, ranks in by_shape.items()]
    if len(parts) > 4:
        parts = [*parts[:3], f"... {len(parts)} shapes"]
    return "{" + ", ".join(parts) + "}"


def io_shapes(e: Event, arrow: str = "->") -> str:
    """The ranks' input and output shapes: ``(2,4)->(8,4)``; ``""`` with neither."""
    inputs = getattr(e, "inputs", {})
    outputs = getattr(e, "outputs", {})
    if not inputs and not outputs:
        return ""
    return f"{per_rank_dims(inputs)}{arrow}{per_rank_dims(outputs)}"


def dtype(e: CollectiveEvent) -> str:
    """The dtype of the first snapshot that has one."""
    for snaps in (e.inputs, e.outputs):
        for v in snaps.values():
            s = v[0] if isinstance(v, list) and v else v
            if s is not None and not isinstance(s, list):
                return s.dtype
    return ""


def placements(pl: Sequence[str], sep: str = ", ") -> str:
    return "[" + sep.join(pl) + "]"


def context_brackets(e: Event) -> str:
    """`` [Block.ffn forward]``: a trace line's module and pass; ``""`` with neither."""
    ctx = [p for p in (e.module, e.phase) if p]
    return f" [{' '.join(ctx)}]" if ctx else ""


def context(e: Event) -> str:
    """``in Block.ffn (forward)``; ``""`` outside any module or pass."""
    where = f"in {e.module}" if e.module else ""
    phase = f"({e.phase})" if e.phase else ""
    return " ".join(p for p in (where, phase) if p)


# --- whole events --------------------------------------------------------------------------------


def line(e: Event) -> str:
    """One event in full, without nesting or source: a trace's text line."""
    if e.kind == "collective":
        e = cast("CollectiveEvent", e)
        parts = [collective_head(e), groups(e)]
        where = mesh_dim(e)
        if where:
            parts.append(f"mesh {where}")
        shapes = io_shapes(e)
        if shapes:
            parts.append(shapes)
        dt = dtype(e)
        if dt:
            parts.append(dt)
        return " ".join(parts)
    if e.kind == "redistribute":
        e = cast("RedistributeEvent", e)
        kind = "redistribute" if e.explicit else "redistribute (implicit)"
        shape = f" {dims(e.before.global_shape)}" if e.before is not None else ""
        plan = f" plan {e.plan}" if e.plan else ""
        return f"{kind}{shape} {placements(e.src)} -> {placements(e.dst)}{plan}"
    if e.kind == "local":
        e = cast("LocalEvent", e)
        return f"local {e.name} {io_shapes(e) or '-->-'} on every rank"
    if e.kind == "op":
        e = cast("OpEvent", e)
        ins = " ".join(placements(p, ",") for p in e.input_placements)
        outs = " ".join(placements(p, ",") for p in e.output_placements)
        return f"op {e.name} {ins} -> {outs or '-'}"
    if e.kind == "compute":
        parts = [getattr(e, "name", "") or "compute"]
        stage = getattr(e, "stage", None)
        if stage is not None:
            parts.append(f"stage {stage}")
        microbatch = getattr(e, "microbatch", None)
        if microbatch is not None:
            parts.append(f"microbatch {microbatch}")
        return " ".join(parts) + f" on ranks {list(getattr(e, 'ranks', ()))}"
    return e.kind


def short(e: Event) -> str:
    """One short line for a timeline's step (a detail panel shows the rest)."""
    if e.kind == "collective":
        e = cast("CollectiveEvent", e)
        parts = [collective_head(e), mesh_dim(e), io_shapes(e, "→")]
        return " · ".join(p for p in parts if p)
    if e.kind == "redistribute":
        e = cast("RedistributeEvent", e)
        kind = "redistribute" if e.explicit else "redistribute (implicit)"
        return f"{kind} {placements(e.src)} → {placements(e.dst)}"
    if e.kind == "local":
        e = cast("LocalEvent", e)
        return f"local {e.name}"
    if e.kind == "op":
        e = cast("OpEvent", e)
        outs = " ".join(placements(p) for p in e.output_placements)
        return f"{e.name} → {outs}" if outs else e.name
    return e.kind


def brief(e: Event, group_too: bool = True) -> str:
    """What an event is and the user's line that ran it, for error messages."""
    if e.kind == "collective":
        e = cast("CollectiveEvent", e)
        what = collective_head(e, root=False)
        if e.groups and group_too:
            what += " on group " + group(e.groups[0])
    elif e.kind == "redistribute":
        e = cast("RedistributeEvent", e)
        what = f"redistribute {list(e.src)} -> {list(e.dst)}"
    elif e.kind == "op":
        e = cast("OpEvent", e)
        what = e.name
    else:
        what = e.kind
    if e.source is not None:
        what += f" (line {e.source.line}: {e.source.text})"
    return what


def label(e: Event) -> str:
    """What an event is and where it ran, in a few words: ``all_gather in Block.ffn (forward)``."""
    if e.kind == "collective":
        e = cast("CollectiveEvent", e)
        what = e.op
    elif e.kind == "redistribute":
        e = cast("RedistributeEvent", e)
        what = "redistribute"
    elif e.kind == "op":
        e = cast("OpEvent", e)
        what = e.name
    else:
        what = e.kind
    where = context(e)
    return f"{what} {where}" if where else what
