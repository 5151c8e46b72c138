"""Redistribute plans without tensors: which collectives, over which groups, moving how many bytes.

``sv.plan(shape, mesh_shape, src, dst)`` answers for model-size tensors on hundreds of ranks in
milliseconds, with no process group, no simulation and no allocation. It follows DTensor's greedy
planner step by step (the same plan string as the recorder sees), derives each step's per-rank
buffer shapes from the pure geometry (padding included, as DTensor pads uneven shards), and
returns a Trace whose snapshots carry shapes and bytes but no values — so every view of a
recorded trace works on a plan too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from . import mesh as _mesh
from .layout import Layout
from .layout import compute as compute_layout
from .placement import Placement, normalize
from .trace import CollectiveEvent, RedistributeEvent, TensorSnapshot, Trace, dtype_size

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
    order: dict[int, list[int]] = {}
    for m, p in enumerate(current):
        if p.is_shard:
            order.setdefault(p.dim, []).append(m)  # type: ignore[arg-type]

    def state() -> str:
        out = ""
        for m, p in enumerate(current):
            dims = order.get(p.dim, []) if p.is_shard else []  # type: ignore[arg-type]
            out += f"{p}[{dims.index(m)}]" if len(dims) > 1 else str(p)
        return out

    parts = [state()]
    for s in steps:
        if s.src.is_shard:
            order[s.src.dim].pop()  # type: ignore[index]
        if s.dst.is_shard:
            order.setdefault(s.dst.dim, []).append(s.mesh_dim)  # type: ignore[arg-type]
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
