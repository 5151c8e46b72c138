"""Redistribute plans without tensors: which collectives, over which groups, moving how many bytes.

``sv.plan(shape, mesh_shape, src, dst)`` answers for model-size tensors on hundreds of ranks in
milliseconds, with no process group, no simulation and no allocation. It follows DTensor's greedy
planner step by step (the same plan string as the recorder sees), derives each step's per-rank
buffer shapes from the pure geometry (padding included, as DTensor pads uneven shards), and
returns a Trace whose snapshots carry shapes and bytes but no values — so every view of a
recorded trace works on a plan too.

The other way round, ``plan_steps`` reads a recorded redistribute's plan string back into steps
(the layouts around each and the collective that ran it) for the views that draw it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..geometry import mesh as _mesh
from ..geometry.layout import Layout
from ..geometry.layout import compute as compute_layout
from ..geometry.placement import Placement, normalize
from ..geometry.placement import parse as parse_placement
from .events import CollectiveEvent, Event, RedistributeEvent, TensorSnapshot, dtype_size
from .trace import Trace

_IMPL = {
    "all_gather": "_c10d_functional.all_gather_into_tensor",
    "all_reduce": "_c10d_functional.all_reduce",
    "reduce_scatter": "_c10d_functional.reduce_scatter_tensor",
    "all_to_all": "_dtensor.shard_dim_alltoall",
}


@dataclass(frozen=True, slots=True)
class Step:
    """One transform of the plan: mesh dim ``mesh_dim`` goes from ``src`` to ``dst``."""

    mesh_dim: int
    src: Placement
    dst: Placement

    @property
    def op(self) -> str | None:
        """The collective this step needs, or None for a local step (e.g. Replicate -> Shard)."""
        if self.src.kind == "partial" and self.dst.kind == "replicate":
            return "all_reduce"
        if self.src.kind == "partial" and self.dst.is_shard:
            return "reduce_scatter"
        if self.src.is_shard and self.dst.kind == "replicate":
            return "all_gather"
        if self.src.is_shard and self.dst.is_shard:
            return "all_to_all"
        return None


def greedy_steps(src: Sequence[Placement], dst: Sequence[Placement], mesh_shape: Sequence[int]) -> list[Step]:
    """DTensor's greedy plan: replicate misaligned nested shards inner-to-outer, then go outer-to-inner."""
    current, target = list(src), list(dst)
    if len(mesh_shape) == 1:
        return [Step(0, current[0], target[0])] if current[0] != target[0] else []
    steps: list[Step] = []
    num_shards = math.prod(n for p, n in zip(current, mesh_shape, strict=True) if p.is_shard)
    if num_shards > 1:
        for m in reversed(range(len(current))):
            cur, tgt = current[m], target[m]
            if tgt.kind == "shard":
                before_cur = [i for i in range(m) if current[i].kind == "shard" and current[i].dim == tgt.dim]
                before_tgt = [i for i in range(m) if target[i].kind == "shard" and target[i].dim == tgt.dim]
                if before_cur != before_tgt:
                    tgt = Placement("replicate")
            if cur != tgt:
                steps.append(Step(m, cur, tgt))
                current[m] = tgt
    for m, (cur, tgt) in enumerate(zip(current, target, strict=True)):
        if cur != tgt:
            steps.append(Step(m, cur, tgt))
            current[m] = tgt
    return steps


def plan_string(src: Sequence[Placement], steps: Sequence[Step]) -> str:
    """The plan as DTensor prints it, e.g. ``S(0)[0]S(0)[1]->S(0)R->RR``."""
    current = list(src)
    order: dict[int | None, list[int]] = {}  # mesh dims sharding each tensor dim, in order
    for m, p in enumerate(current):
        if p.is_shard:
            order.setdefault(p.dim, []).append(m)

    def state() -> str:
        out = ""
        for m, p in enumerate(current):
            dims = order.get(p.dim, []) if p.is_shard else []
            out += f"{p}[{dims.index(m)}]" if len(dims) > 1 else str(p)
        return out

    parts = [state()]
    for s in steps:
        if s.src.is_shard:
            order[s.src.dim].pop()
        if s.dst.is_shard:
            order.setdefault(s.dst.dim, []).append(s.mesh_dim)
        current[s.mesh_dim] = s.dst
        parts.append(state())
    return "->".join(parts)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _buffers(
    step: Step, layout: Layout, mesh_shape: Sequence[int]
) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per-rank (input shape, output shape) of the collective a step issues, padding included."""
    n = mesh_shape[step.mesh_dim]
    shapes = {s.rank: s.shape for s in layout.shards}
    groups = _mesh.dim_groups(mesh_shape, step.mesh_dim, layout.mesh_ranks)
    out: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for g in groups:
        for r in g:
            local = list(shapes[r])
            if step.op == "all_gather":
                d = step.src.dim
                assert d is not None
                logical = sum(shapes[q][d] for q in g)
                local[d] = _ceil(logical, n)
                gathered = list(local)
                gathered[0] *= n
                out[r] = (tuple(local), tuple(gathered))
            elif step.op == "all_reduce":
                out[r] = (tuple(local), tuple(local))
            elif step.op == "reduce_scatter":
                d = step.dst.dim
                assert d is not None
                # The input is padded to a multiple of n along d; for d != 0 DTensor stacks the n
                # chunks along dim 0 so the collective always scatters dim 0.
                chunk = _ceil(local[d], n)
                scattered = list(local)
                scattered[d] = chunk
                stacked = list(scattered)
                stacked[0] *= n
                out[r] = (tuple(stacked), tuple(scattered))
            elif step.op == "all_to_all":
                i, j = step.src.dim, step.dst.dim
                assert i is not None and j is not None
                # Both dims are padded: the old shard dim to the full chunk, the new one to a
                # multiple of n.
                local[i] = _ceil(sum(shapes[q][i] for q in g), n)
                local[j] = _ceil(local[j], n) * n
                moved = list(local)
                moved[j] //= n
                moved[i] *= n
                out[r] = (tuple(local), tuple(moved))
    return out


def plan(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    src: Sequence[str | Placement],
    dst: Sequence[str | Placement],
    mesh_dim_names: Sequence[str] | None = None,
    *,
    dtype: str = "float32",
) -> Trace:
    """The redistribute ``src -> dst`` of a ``shape`` tensor as a Trace, computed without tensors.

    One redistribute event (layouts before and after, the plan string) and one collective per step
    that communicates, with its groups, mesh dim, per-rank buffer shapes and bytes (no values).
    """
    before = compute_layout(shape, mesh_shape, src, mesh_dim_names, dtype=dtype)
    after = compute_layout(shape, mesh_shape, dst, mesh_dim_names, dtype=dtype)
    srcp = normalize(src, len(before.global_shape), len(before.mesh_shape))
    dstp = normalize(dst, len(before.global_shape), len(before.mesh_shape))
    if any(p.kind == "strided" for p in (*srcp, *dstp)):
        raise ValueError(
            "sv.plan covers Shard, Replicate and Partial; for _StridedShard DTensor searches a graph of "
            "plans at run time: record the redistribute under sv.record() instead"
        )
    if any(p.kind == "partial" for p in dstp) and any(
        s.kind != "partial" and d.kind == "partial" for s, d in zip(srcp, dstp, strict=True)
    ):
        raise ValueError(
            f"cannot plan {[str(p) for p in srcp]} -> {[str(p) for p in dstp]}: DTensor refuses to turn "
            "a Shard or Replicate placement into Partial"
        )
    steps = greedy_steps(srcp, dstp, before.mesh_shape)
    trace = Trace(before.world_size, "plan", "none")
    names = before.mesh_dim_names
    trace.meshes.append(
        {
            "mesh_shape": list(before.mesh_shape),
            "mesh_dim_names": list(names) if names else None,
            "ranks": list(before.mesh_ranks),
        }
    )
    events: list = [
        RedistributeEvent(
            id=0,
            src=before.placements,
            dst=after.placements,
            plan=plan_string(srcp, steps),
            explicit=True,
            before=before,
            after=after,
        )
    ]
    current = list(srcp)
    layout = before
    size = dtype_size(dtype)
    for step in steps:
        if step.op is not None:
            bufs = _buffers(step, layout, before.mesh_shape)
            m = step.mesh_dim
            events.append(
                CollectiveEvent(
                    id=len(events),
                    parent=0,
                    op=step.op,
                    impl=_IMPL[step.op],
                    reduce_op=step.src.reduce_op if step.src.kind == "partial" else None,
                    groups=tuple(tuple(g) for g in _mesh.dim_groups(before.mesh_shape, m, before.mesh_ranks)),
                    mesh_dim=m,
                    mesh_dim_name=names[m] if names else None,
                    inputs={r: TensorSnapshot(i, dtype) for r, (i, _) in bufs.items()},
                    outputs={r: TensorSnapshot(o, dtype) for r, (_, o) in bufs.items()},
                    nbytes={r: math.prod(i) * size for r, (i, _) in bufs.items()},
                )
            )
        current[step.mesh_dim] = step.dst
        layout = compute_layout(shape, mesh_shape, current, mesh_dim_names, dtype=dtype)
    trace.events = events
    return trace


# ---- reading a recorded plan string -------------------------------------------------------------

_TOKEN = re.compile(r"(_S\(-?\d+,\s*(?:sf=)?\d+\)|S\(-?\d+\)|R|P(?:\(\w+\))?)(?:\[(\d+)\])?")


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One transform of a recorded redistribute's plan, read from its plan string, with the
    layouts around it when they are known (:class:`Step` is the planner's, with placements)."""

    index: int
    mesh_dim: int | None
    src: str
    dst: str
    op: str | None  # the collective, None for a local step (e.g. R -> S)
    before: Layout | None = None
    after: Layout | None = None
    event: int | None = None  # the child collective that ran this step


def parse_plan_string(plan: str) -> list[list[tuple[str, int | None]]] | None:
    """The states of a plan string as DTensor prints it (the reverse of :func:`plan_string`):
    per state, per mesh dim, the placement and its shard order (``S(0)[1]`` -> ``("S(0)", 1)``);
    None when the text is not such a plan (another torch version's format, say)."""
    states = []
    for text in plan.split("->"):
        toks, pos = [], 0
        for m in _TOKEN.finditer(text):
            if m.start() != pos:
                return None
            pos = m.end()
            toks.append((m.group(1), int(m.group(2)) if m.group(2) else None))
        if pos != len(text) or not toks:
            return None
        states.append(toks)
    if len(states) < 2 or any(len(s) != len(states[0]) for s in states):
        return None
    return states


def _state_layout(e: RedistributeEvent, state: list[tuple[str, int | None]]) -> Layout | None:
    """The layout of one state of the plan (shard order included), from the event's geometry."""
    ref = e.before or e.after
    if ref is None:
        return None
    placements = [p for p, _ in state]
    order: dict[int, list[tuple[int, int]]] = {}
    for m, (p, k) in enumerate(state):
        if k is not None:
            d = parse_placement(p).dim
            if d is not None:
                order.setdefault(d, []).append((k, m))
    shard_order = {d: [m for _, m in sorted(v)] for d, v in order.items()} or None
    try:
        return compute_layout(
            ref.global_shape,
            ref.mesh_shape,
            placements,
            ref.mesh_dim_names,
            dtype=ref.dtype,
            mesh_ranks=ref.mesh_ranks,
            shard_order=shard_order,
        )
    except (ValueError, TypeError):
        return None


def plan_steps(e: RedistributeEvent, children: Sequence[Event] = ()) -> list[PlanStep]:
    """The plan string of a redistribute as steps (one mesh dim each), with the layout before and
    after each step and the child collective that ran it; [] when the plan cannot be read."""
    states = parse_plan_string(e.plan) if e.plan else None
    if states is None:
        return []
    layouts = [_state_layout(e, s) for s in states]
    if e.before is not None:
        layouts[0] = e.before
    if e.after is not None and [p for p, _ in states[-1]] == list(e.after.placements):
        layouts[-1] = e.after
    cols = [c for c in children if isinstance(c, CollectiveEvent)]
    used: set[int] = set()
    out = []
    for i in range(len(states) - 1):
        a, b = states[i], states[i + 1]
        changed = [m for m in range(len(a)) if a[m][0] != b[m][0]]
        m = changed[0] if changed else None
        src = "".join(p for p, _ in a) if m is None else a[m][0]
        dst = "".join(p for p, _ in b) if m is None else b[m][0]
        op = None
        if m is not None:
            try:
                op = Step(m, parse_placement(src), parse_placement(dst)).op
            except ValueError:
                op = None
        child = None
        if op is not None:
            for c in cols:
                if c.id not in used and c.op == op and (c.mesh_dim is None or c.mesh_dim == m):
                    child = c.id
                    used.add(c.id)
                    break
        out.append(PlanStep(i, m, src, dst, op, layouts[i], layouts[i + 1], child))
    return out
