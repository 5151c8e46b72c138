"""What each rank's buffers hold before and after one step, as parts of the drawn grid: the
chunks a collective moves, a list's slots, the padding a redistribute adds or drops (from its
plan), a point-to-point pair's send and receive, and what stays in place; with their JSON."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..data import flow as _flow
from ..data.events import CollectiveEvent, Event, LocalEvent, TensorSnapshot
from ..data.plan import PlanStep
from ..geometry.placement import parse as _parse_placement
from .grid import Buffer, Part, grid_json, grid_shape

# Pad rectangles per part; past this the padding is only named in the notes.
PAD_RECTS = 64


def snapshots_of(s: TensorSnapshot | list[TensorSnapshot] | None) -> list[TensorSnapshot]:
    if s is None:
        return []
    return list(s) if isinstance(s, list) else [s]


def _band(shape: Sequence[int], dim: int, start: int, stop: int) -> tuple[int, int, int, int] | None:
    """Grid box of elements [start, stop) along ``dim``; None when that is not one band."""
    rows, cols = grid_shape(shape)
    if dim == 0 and shape:
        return (start, stop, 0, cols)
    if dim == 1 and len(shape) >= 2:
        inner = math.prod(shape[2:])
        return (0, rows, start * inner, stop * inner)
    return None


def _pad_rects(
    box: tuple[int, int, int, int], part_shape: Sequence[int], valid: Sequence[int] | None
) -> tuple[tuple[int, int, int, int], ...]:
    """The padding of a part whose sub-tensor has ``part_shape`` and real data ``valid`` (per dim,
    counted from the part's start), as grid rectangles: exact for padding along dims 0-2."""
    if valid is None or len(valid) != len(part_shape) or not part_shape:
        return ()
    v = [min(max(int(x), 0), n) for x, n in zip(valid, part_shape, strict=True)]
    if v == list(part_shape):
        return ()
    r0, r1, c0, c1 = box
    out: list[tuple[int, int, int, int]] = []
    if v[0] < part_shape[0]:
        out.append((r0 + v[0], r1, c0, c1))
    if len(part_shape) >= 2 and v[0] > 0:
        inner = math.prod(part_shape[2:])
        if v[1] < part_shape[1]:
            out.append((r0, r0 + v[0], c0 + v[1] * inner, c1))
        if len(part_shape) >= 3 and v[1] > 0:
            inner2 = math.prod(part_shape[3:])
            if v[2] < part_shape[2]:
                for j in range(v[1]):
                    if len(out) >= PAD_RECTS:
                        break
                    base = c0 + j * inner
                    out.append((r0, r0 + v[0], base + v[2] * inner2, base + inner))
    return tuple(out)


def _chunks(
    shape: Sequence[int],
    dim: int,
    n: int,
    sizes: Sequence[int] | None,
    origins: Sequence[int | None],
    reduced: bool,
    valid: Sequence[Sequence[int] | None] | None,
) -> tuple[Part, ...]:
    """n parts of a tensor cut along ``dim`` (equal, or ``sizes``); () if they are not bands."""
    if not shape or dim >= len(shape) or n <= 0:
        return ()
    if sizes:
        if len(sizes) != n or sum(sizes) != shape[dim]:
            return ()
        sz = list(sizes)
    else:
        step = shape[dim] // n
        if step * n != shape[dim]:
            return ()
        sz = [step] * n
    parts = []
    start = 0
    for k in range(n):
        box = _band(shape, dim, start, start + sz[k])
        if box is None:
            return ()
        sub = list(shape)
        sub[dim] = sz[k]
        pad = _pad_rects(box, sub, valid[k] if valid else None)
        parts.append(Part(k, None, box, origins[k], reduced, pad))
        start += sz[k]
    return tuple(parts)


def _slots(
    slots: Sequence[tuple[int, ...]], origins: Sequence[int | None], reduced: bool
) -> tuple[Part, ...]:
    parts = []
    for k, shape in enumerate(slots):
        rows, cols = grid_shape(shape)
        parts.append(Part(k, k, (0, rows, 0, cols), origins[k] if k < len(origins) else None, reduced))
    return tuple(parts)


def valid_shapes(
    e: CollectiveEvent, step: PlanStep | None
) -> tuple[dict[int, list[tuple[int, ...]]], dict[int, list[tuple[int, ...]]]] | None:
    """Per rank, the real (unpadded) shape of each input / output part, from the layouts around
    the plan step this collective ran; None when the step or its layouts are unknown."""
    if step is None or step.before is None or step.after is None or step.mesh_dim is None:
        return None
    lb, la = step.before, step.after
    try:
        src, dst = _parse_placement(step.src), _parse_placement(step.dst)
    except ValueError:
        return None
    ins: dict[int, list[tuple[int, ...]]] = {}
    outs: dict[int, list[tuple[int, ...]]] = {}
    try:
        for grp in e.groups:
            before = [lb.shard(r).shape for r in grp]
            after = [la.shard(r).shape for r in grp]
            for i, r in enumerate(grp):
                if e.op == "all_gather":
                    ins[r] = [before[i]]
                    outs[r] = list(before)
                elif e.op == "reduce_scatter":
                    ins[r] = list(after)
                    outs[r] = [after[i]]
                elif e.op == "all_to_all" and src.dim is not None and dst.dim is not None:
                    a, b = src.dim, dst.dim  # gather along a, split along b

                    def mix(
                        x: tuple[int, ...], y: tuple[int, ...], a: int = a, b: int = b
                    ) -> tuple[int, ...]:
                        out = list(x)
                        out[b] = y[b]
                        out[a] = x[a]
                        return tuple(out)

                    ins[r] = [mix(before[i], after[k]) for k in range(len(grp))]
                    outs[r] = [mix(before[k], after[i]) for k in range(len(grp))]
                else:
                    return None
    except KeyError:
        return None
    return ins, outs


def step_buffers(
    e: CollectiveEvent | LocalEvent, valid: tuple[dict, dict] | None = None
) -> dict[int, dict[str, Buffer | None]]:
    """Every rank's input and output buffer with the parts the op moves."""
    out: dict[int, dict[str, Buffer | None]] = {}
    if isinstance(e, LocalEvent):
        for r in sorted(set(e.inputs) | set(e.outputs)):
            out[r] = {"in": _plain(e.inputs.get(r), (), r), "out": _plain(e.outputs.get(r), (), r)}
        return out
    op, p = e.op, e.params
    if op in ("send", "recv"):
        return _p2p_buffers(e)
    for grp in e.groups:
        n = len(grp)
        root = grp[e.root] if e.root is not None and e.root < n else None
        for r in grp:
            ins, outs = e.inputs.get(r), e.outputs.get(r)
            vin = valid[0].get(r) if valid else None
            vout = valid[1].get(r) if valid else None
            b_in = _plain(ins, (), r, whole_valid=vin[0] if vin and len(vin) == 1 else None)
            b_out = _plain(outs, (), None, whole_valid=vout[0] if vout and len(vout) == 1 else None)
            members: list[int | None] = list(grp)
            if op == "all_gather":
                b_out = _split(outs, 0, n, None, members, False, vout) or b_out
            elif op == "reduce_scatter":
                b_in = _split(ins, 0, n, None, [r] * n, False, vin) or b_in
                b_out = _plain(outs, (), None, reduced=True, whole_valid=vout[0] if vout else None)
            elif op == "all_reduce":
                b_out = _plain(outs, (), None, reduced=True)
            elif op == "all_to_all":
                if "gather_dim" in p and "shard_dim" in p:
                    b_in = _split(ins, p["shard_dim"], n, None, [r] * n, False, vin) or b_in
                    b_out = _split(outs, p["gather_dim"], n, None, members, False, vout) or b_out
                else:
                    b_in = _split(ins, 0, n, p.get("input_split_sizes"), [r] * n, False, None) or b_in
                    b_out = _split(outs, 0, n, p.get("output_split_sizes"), members, False, None) or b_out
            elif op == "broadcast":
                b_out = _plain(outs, (), root)
            elif op == "scatter":
                if r == root:
                    b_in = _split(ins, 0, n, None, [r] * n, False, None) or b_in
                else:
                    b_in = _with(b_in, role="ignored")
                b_out = _plain(outs, (), root)
            elif op == "gather":
                if r == root:
                    b_out = _split(outs, 0, n, None, members, False, None) or b_out
                else:
                    b_out = _with(b_out, role="undefined")
            elif op == "reduce":
                b_out = _plain(outs, (), None, reduced=True) if r == root else _with(b_out, role="undefined")
            else:  # barrier: no buffers
                b_out = _plain(outs, (), r)
            out[r] = {"in": b_in, "out": b_out}
    return out


def p2p_pairs(e: CollectiveEvent) -> list[tuple[int, int]]:
    """(source, destination) of each message of a send or recv. The recorded ``root`` is the index
    of the peer in each pair: the destination for a send, the source for a recv."""
    if e.op not in ("send", "recv") or e.root not in (0, 1):
        return []
    i = 1 - e.root if e.op == "send" else e.root
    return [(grp[i], grp[1 - i]) for grp in e.groups if len(grp) == 2]


def _p2p_buffers(e: CollectiveEvent) -> dict[int, dict[str, Buffer | None]]:
    """A send draws the source's buffer and, at the destination, what is on its way there (it lands
    in the matching recv); a recv draws what was sent and what arrived."""
    out: dict[int, dict[str, Buffer | None]] = {}
    for src, dst in p2p_pairs(e):
        sent = e.inputs.get(src)
        out.setdefault(src, {"in": None, "out": None})["in"] = _plain(sent, (), src)
        if e.op == "send":
            arrives = _with(_plain(sent, (), src), role="pending")
        else:
            arrives = _plain(e.outputs.get(dst), (), src)
        out.setdefault(dst, {"in": None, "out": None})["out"] = arrives
    return out


def buffer_json(b: Buffer | None, group_size: int) -> dict[str, Any] | None:
    if b is None:
        return None
    out = b.as_json()
    grid = grid_json(b, group_size)
    if grid is not None:
        out["grid"] = grid
    return out


def _with(b: Buffer | None, **changes: Any) -> Buffer | None:
    if b is None:
        return None
    fields_ = {f: getattr(b, f) for f in Buffer.__slots__}
    fields_.update(changes)
    return Buffer(**fields_)


def _plain(
    s: TensorSnapshot | list[TensorSnapshot] | None,
    parts: tuple[Part, ...],
    origin: int | None,
    *,
    reduced: bool = False,
    whole_valid: Sequence[int] | None = None,
) -> Buffer | None:
    snaps = snapshots_of(s)
    if not snaps:
        return None
    listed = isinstance(s, list)
    shape = snaps[0].shape if not listed else (len(snaps),)
    pad: tuple[tuple[int, int, int, int], ...] = ()
    if not listed and whole_valid is not None:
        rows, cols = grid_shape(shape)
        pad = _pad_rects((0, rows, 0, cols), shape, whole_valid)
    return Buffer(
        shape=tuple(shape),
        dtype=snaps[0].dtype,
        slots=tuple(x.shape for x in snaps) if listed else None,
        values=all(x.values is not None for x in snaps),
        parts=parts,
        origin=origin,
        reduced=reduced,
        pad=pad,
    )


def _split(
    s: TensorSnapshot | list[TensorSnapshot] | None,
    dim: int,
    n: int,
    sizes: Sequence[int] | None,
    origins: Sequence[int | None],
    reduced: bool,
    valid: Sequence[Sequence[int]] | None,
) -> Buffer | None:
    """A buffer cut into n parts: list slots when it is a list, else chunks along ``dim``."""
    snaps = snapshots_of(s)
    if not snaps:
        return None
    if isinstance(s, list):
        if len(snaps) != n:
            return None
        return _plain(s, _slots([x.shape for x in snaps], origins, reduced), None, reduced=reduced)
    parts = _chunks(
        snaps[0].shape, dim, n, sizes, origins, reduced, valid if valid and len(valid) == n else None
    )
    if not parts:
        return None
    return _plain(s, parts, None, reduced=reduced)


def stays(e: CollectiveEvent) -> list[_flow.Transfer]:
    """What each rank keeps of its own input (drawn dashed): the transfers a rank makes to itself,
    which ``flow.transfers`` leaves out."""
    T = _flow.Transfer
    out: list[_flow.Transfer] = []
    for grp in e.groups:
        n = len(grp)
        root = e.root if e.root is not None and e.root < n else None
        for i, r in enumerate(grp):
            if e.op == "all_gather":
                out.append(T(r, r, None, i))
            elif e.op == "reduce_scatter":
                out.append(T(r, r, i, None, True))
            elif e.op == "all_reduce":
                out.append(T(r, r, None, None, True))
            elif e.op == "all_to_all":
                out.append(T(r, r, i, i))
            elif e.op == "broadcast" and i == root:
                out.append(T(r, r))
            elif e.op == "scatter" and i == root:
                out.append(T(r, r, i, None))
            elif e.op == "gather" and i == root:
                out.append(T(r, r, None, i))
            elif e.op == "reduce" and i == root:
                out.append(T(r, r, None, None, True))
    return out


def transfer_json(t: _flow.Transfer) -> list[Any]:
    return [t.src, t.dst, t.src_part, t.dst_part, t.reduce]


def check_json(c: _flow.FlowCheck) -> dict[str, Any]:
    errors = {str(r): (e if math.isfinite(e) else None) for r, e in sorted(c.max_error.items())}
    return {"ok": c.ok, "checked": c.checked, "max_error": errors, "note": c.note}


def source_json(e: Event) -> dict[str, Any] | None:
    if e.source is None:
        return None
    return {"file": Path(e.source.file).name, "line": e.source.line, "text": e.source.text}


def rle(values: Sequence[int]) -> list[int]:
    """Run-length code: [value, count, value, count, ...] (rows of one module come in runs)."""
    out: list[int] = []
    for v in values:
        if out and out[-2] == v:
            out[-1] += 1
        else:
            out += [v, 1]
    return out
