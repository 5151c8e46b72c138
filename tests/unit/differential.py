"""The differential test's programs and the sides that run them.

A ``Program`` is a small random DTensor program as plain data: a mesh of 1 to 8 ranks (1-D to
3-D), an input (uneven and empty shards; Shard, Replicate, Partial and _StridedShard placements)
and a chain of steps (redistributes, pointwise ops, a matmul with a second input, reductions,
views), in float32 or bfloat16, with or without a backward. ``execute`` runs it: on full tensors
in plain torch when given no mesh, else on DTensors.

A side is a function ``Program -> Outcome``: the full values of the program's results and
gradients per rank, the trace it recorded (None for plain torch), or the error it raised.
``SIDES`` lists them; the first is the reference. Another engine joins the comparison with one
more line there.

Inputs are small multiples of 1/2, so that sums, products and means are exact (or rounded the
same way) in float32 and bfloat16 whatever the order of the reduction: a difference is a bug of
the simulation, not rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

import shardviz as sv
from shardviz.capture.torch.modes import BATCHED_FROM
from shardviz.data.events import CollectiveEvent, OpEvent, RedistributeEvent
from shardviz.data.trace import Trace

_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])

# --- programs ------------------------------------------------------------------------------------

WORLDS = (1, 2, 3, 4, 6, 8)
MESHES: dict[int, tuple[tuple[int, ...], ...]] = {
    1: ((1,), (1, 1)),
    2: ((2,), (1, 2), (2, 1)),
    3: ((3,), (1, 3)),
    4: ((4,), (2, 2), (1, 4), (2, 1, 2)),
    6: ((6,), (2, 3), (3, 2), (1, 2, 3)),
    8: ((8,), (2, 4), (4, 2), (2, 2, 2)),
}


@dataclass(frozen=True)
class Program:
    """A DTensor program as plain data (see the module's docstring)."""

    mesh: tuple[int, ...]
    dtype: str  # "float32" or "bfloat16"
    shape: tuple[int, ...]  # the input's global shape
    placements: tuple[str, ...]  # "R", "S(d)", "P", "_S(d,k)": one per mesh dim
    steps: tuple[tuple[Any, ...], ...]
    backward: bool
    seed: int

    def __str__(self) -> str:
        steps = "; ".join(" ".join(map(str, s)) for s in self.steps)
        return (
            f"mesh {self.mesh} {self.dtype} input {self.shape} [{', '.join(self.placements)}] -> {steps}"
            + (" + backward" if self.backward else "")
        )


def _placement(p: str) -> Any:
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if p == "R":
        return Replicate()
    if p == "P":
        return Partial()
    if p.startswith("_S("):
        d, k = p[3:-1].split(",")
        return _StridedShard(int(d), split_factor=int(k))
    return Shard(int(p[2:-1]))


def _after(shape: tuple[int, ...], step: tuple[Any, ...]) -> tuple[int, ...] | None:
    """The shape a step leaves, or None when it does not apply."""
    kind = step[0]
    if kind in ("redistribute", "scale", "add", "relu", "neg", "abs"):
        return shape
    if kind == "matmul":
        return (*shape[:-1], step[1]) if shape else None
    if kind in ("sum", "mean"):
        d = step[1]
        return shape[:d] + shape[d + 1 :] if len(shape) > 1 and d < len(shape) else None
    if kind == "transpose":
        return (shape[1], shape[0], *shape[2:]) if len(shape) >= 2 else None
    if kind == "flatten":
        return (*shape[:-2], shape[-2] * shape[-1]) if len(shape) >= 3 else None
    return None


def _target(draw: Any, mesh: tuple[int, ...], ndim: int) -> tuple[str, ...]:
    return tuple(draw(st.sampled_from(["R", *(f"S({d})" for d in range(ndim))])) for _ in mesh)


@st.composite
def programs(draw: Any, world: int) -> Program:
    mesh = draw(st.sampled_from(MESHES[world]))
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    pls = []
    for _m in range(len(mesh)):
        choices = ["R", "P", *(f"S({d})" for d in range(ndim))]
        # A tensor dim already split over an earlier mesh dim, split again with the stride the
        # first split leaves: _StridedShard (FSDP2 + TP's layout of a parameter).
        strided = [
            f"_S({d},{mesh[e]})" for e, prev in enumerate(pls) for d in range(ndim) if prev == f"S({d})"
        ]
        pls.append(draw(st.sampled_from(choices + strided)))
    steps: list[tuple[Any, ...]] = []
    cur = shape
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(
            st.sampled_from(
                [
                    "redistribute",
                    "scale",
                    "add",
                    "relu",
                    "neg",
                    "abs",
                    "matmul",
                    "sum",
                    "mean",
                    "transpose",
                    "flatten",
                ]
            )
        )
        if kind == "redistribute":
            step: tuple[Any, ...] = (kind, _target(draw, mesh, len(cur)))
        elif kind == "matmul":
            step = (kind, draw(st.integers(1, 5)), _target(draw, mesh, 2))
        elif kind in ("sum", "mean"):
            step = (kind, draw(st.integers(0, 2)))
        else:
            step = (kind,)
        nxt = _after(cur, step)
        if nxt is None:
            continue
        steps.append(step)
        cur = nxt
    if not steps:
        steps.append(("scale",))
    return Program(
        mesh=mesh,
        dtype=draw(st.sampled_from(["float32", "bfloat16"])),
        shape=shape,
        placements=tuple(pls),
        steps=tuple(steps),
        backward=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


# --- running one ---------------------------------------------------------------------------------


def _grid(shape: Sequence[int], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Multiples of 1/2 in [-2, 2]: exact in bfloat16, and so are their small sums and products."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-4, 5, tuple(shape), generator=g).float() / 2).to(dtype)


def inputs(prog: Program) -> dict[str, torch.Tensor]:
    """The program's full input tensors: ``x``, each matmul's weight ``w<i>``, the loss weights."""
    dtype = getattr(torch, prog.dtype)
    out = {"x": _grid(prog.shape, prog.seed, dtype)}
    cur = prog.shape
    for i, step in enumerate(prog.steps):
        if step[0] == "matmul":
            out[f"w{i}"] = _grid((cur[-1], step[1]), prog.seed + 1 + i, dtype)
        nxt = _after(cur, step)
        assert nxt is not None
        cur = nxt
    out["g"] = _grid(cur, prog.seed + 100, torch.float32)
    return out


def execute(prog: Program, mesh: Any = None) -> dict[str, torch.Tensor]:
    """The program on full tensors (``mesh`` None) or on DTensors over ``mesh``; its output and,
    with a backward, the gradients of its inputs, as full tensors."""
    full = inputs(prog)
    if mesh is None:
        leaves = {k: v.clone().requires_grad_(prog.backward) for k, v in full.items() if k != "g"}
    else:
        leaves = {"x": _distribute(full["x"], mesh, prog.placements, prog.seed)}
        for k, v in full.items():
            if k.startswith("w"):
                step = prog.steps[int(k[1:])]
                leaves[k] = _distribute(v, mesh, step[2], prog.seed)
        if prog.backward:
            for v in leaves.values():
                v.requires_grad_(True)
    x = leaves["x"]
    for i, step in enumerate(prog.steps):
        x = _step(x, step, leaves.get(f"w{i}"), mesh)
    out: dict[str, torch.Tensor] = {"out": _whole(x)}
    if prog.backward:
        g = full["g"]
        if mesh is not None:
            from torch.distributed.tensor import Replicate, distribute_tensor

            g = distribute_tensor(g, mesh, [Replicate()] * mesh.ndim)
        (x.float() * g).sum().backward()
        for k, v in leaves.items():
            out[f"grad {k}"] = _whole(v.grad) if v.grad is not None else torch.zeros(())
    return out


def _whole(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _distribute(full: torch.Tensor, mesh: Any, placements: Sequence[str], seed: int) -> torch.Tensor:
    """``full`` as a DTensor with ``placements``; a Partial mesh dim's coordinate 0 holds the value
    less what the others hold (halves: the sum is exact)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    pls = [_placement(p) for p in placements]
    strided = any(p.startswith("_S") for p in placements)
    if "P" not in placements:
        return distribute_tensor(full, mesh, pls, src_data_rank=None if strided else 0)
    base = [Replicate() if p == "P" else q for p, q in zip(placements, pls, strict=True)]
    local = distribute_tensor(full, mesh, base, src_data_rank=None if strided else 0).to_local()
    for m, p in enumerate(placements):
        if p != "P" or mesh.size(m) == 1:
            continue
        first = (torch.ones((), dtype=local.dtype) * mesh.get_local_rank(m) == 0).to(local.dtype)
        share = torch.full_like(local, 0.5)
        local = first * (local - (mesh.size(m) - 1) * share) + (1 - first) * share
    return DTensor.from_local(local, mesh, pls, run_check=False, shape=full.shape, stride=full.stride())


def _step(x: torch.Tensor, step: tuple[Any, ...], w: torch.Tensor | None, mesh: Any) -> torch.Tensor:
    kind = step[0]
    if kind == "redistribute":
        return x if mesh is None else x.redistribute(mesh, [_placement(p) for p in step[1]])
    if kind == "scale":
        return x * 2
    if kind == "add":
        return x + x
    if kind == "relu":
        return torch.relu(x)
    if kind == "neg":
        return -x
    if kind == "abs":
        return x.abs()
    if kind == "matmul":
        assert w is not None
        return x @ w
    if kind == "sum":
        return x.sum(dim=step[1])
    if kind == "mean":
        return x.mean(dim=step[1])
    if kind == "transpose":
        return x.transpose(0, 1)
    if kind == "flatten":
        return x.flatten(-2)
    raise ValueError(kind)


# --- sides ---------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """What a side made of a program: per result name, each rank's full value (the reference's
    under rank 0); the trace it recorded; or the error it raised (type and first line)."""

    results: dict[str, dict[int, np.ndarray]] = field(default_factory=dict)
    trace: Trace | None = None
    error: str | None = None


def _numpy(t: Any) -> np.ndarray:
    t = torch.as_tensor(t).detach()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def run_plain(prog: Program) -> Outcome:
    return Outcome({k: {0: _numpy(v)} for k, v in execute(prog).items()})


def _on_mesh(prog: Program) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(f"m{i}" for i in range(len(prog.mesh)))
    return execute(prog, init_device_mesh("cpu", prog.mesh, mesh_dim_names=names))


def _simulated(backend: str, **options: Any) -> Callable[[Program], Outcome]:
    def run(prog: Program) -> Outcome:
        world = math.prod(prog.mesh)
        sv.use(backend, world_size=world, **options)
        try:
            trace = sv.run(_on_mesh, prog, values="all")
        except Exception as e:  # the comparison decides whether this is a refusal or a bug
            first = str(e).split("\n", 1)[0]
            return Outcome(error=f"{type(e).__name__}: {first}")
        results: dict[str, dict[int, np.ndarray]] = {}
        for r, got in sorted((trace.results or {}).items()):
            for k, v in got.items():
                results.setdefault(k, {})[r] = _numpy(v)
        return Outcome(results, trace)

    run.__name__ = f"run_{backend}" + "".join(f"_{v}" for v in options.values())
    return run


# The sides, the reference first: (name, runner). Another engine joins with one line here. The
# local engines are named, so that the comparison stays the same whatever the default is.
SIDES: list[tuple[str, Callable[[Program], Outcome]]] = [
    ("plain torch", run_plain),
    ("lockstep", _simulated("local", engine="lockstep")),
    ("threads", _simulated("threads")),
    # the batched engine exists from torch 2.13 on; below, choosing it is refused (test_engine_batched)
    *([("batched", _simulated("local", engine="batched"))] if _TORCH >= BATCHED_FROM else []),
]

# The sides whose collectives run on CPU process groups: DTensor's Shard(i) -> Shard(j) there
# gathers then cuts, where the simulator's engines run the all-to-all (``_shard_to_shard``).
CPU_GROUPS = frozenset({"threads"})


# --- comparing -----------------------------------------------------------------------------------


def compare_results(prog: Program, want: Outcome, got: Outcome, side: str) -> None:
    """Every rank's value of every result against the reference's: bitwise but for the last bit
    of a rounded mean (the inputs make every sum exact)."""
    assert set(got.results) == set(want.results), (side, sorted(got.results), sorted(want.results))
    world = math.prod(prog.mesh)
    for name, ref in want.results.items():
        expected = ref[0]
        per_rank = got.results[name]
        assert sorted(per_rank) == list(range(world)), (side, name, sorted(per_rank))
        for r, value in per_rank.items():
            assert value.shape == expected.shape, (
                f"{side}: {name} on rank {r}: shape {value.shape}, want {expected.shape}"
            )
            rtol = 1e-2 if prog.dtype == "bfloat16" else 1e-6
            np.testing.assert_allclose(
                value, expected, rtol=rtol, atol=rtol, equal_nan=True, err_msg=f"{side}: {name} on rank {r}"
            )


def _shard_to_shard(e: RedistributeEvent) -> bool:
    """A redistribute that moves a mesh dim from Shard(i) to Shard(j): on CPU process groups (the
    threads, gloo) DTensor gathers then cuts; the lockstep simulator runs its all-to-all."""
    return any(
        a.startswith("S(") and b.startswith("S(") and a != b for a, b in zip(e.src, e.dst, strict=True)
    )


def event_equal(a: Trace, b: Trace, shard_to_shard_may_differ: bool = True) -> None:
    """Two simulations' traces event by event: kind, ids, nesting, source line, module, phase; a
    collective's op, groups, root, reduction and every rank's buffers; a redistribute's placements,
    plan and layouts; an op's placements. Explained exception (``shard_to_shard_may_differ``, for
    a side on CPU process groups): the collectives of a Shard(i) -> Shard(j) redistribute
    (``_shard_to_shard``) may differ, their results not."""
    assert len(a.events) == len(b.events), f"{len(a.events)} events against {len(b.events)}:\n{a}\n---\n{b}"
    by_id = {e.id: e for e in a.events}
    for ea, eb in zip(a.events, b.events, strict=True):
        where = f"event #{ea.id} ({ea.kind})"
        assert type(ea) is type(eb), where
        assert (ea.id, ea.parent, ea.module, ea.phase) == (eb.id, eb.parent, eb.module, eb.phase), where
        assert (ea.source is None) == (eb.source is None), where
        if ea.source is not None and eb.source is not None:
            assert (ea.source.line, ea.source.text) == (eb.source.line, eb.source.text), where
        if isinstance(ea, CollectiveEvent):
            parent = by_id.get(ea.parent) if ea.parent is not None else None
            if (
                shard_to_shard_may_differ
                and isinstance(parent, RedistributeEvent)
                and _shard_to_shard(parent)
            ):
                continue
            assert (ea.op, ea.groups, ea.root, ea.reduce_op, ea.mesh_dim) == (
                eb.op,
                eb.groups,
                eb.root,
                eb.reduce_op,
                eb.mesh_dim,
            ), where
            unread = {r for g in ea.groups for r in g} - set(ea.roots()) if ea.op == "scatter" else set()
            for side in ("inputs", "outputs"):
                sa, sb = getattr(ea, side), getattr(eb, side)
                assert sorted(sa) == sorted(sb), where
                for r in sa:
                    if side == "inputs" and r in unread:
                        continue
                    la = sa[r] if isinstance(sa[r], list) else [sa[r]]
                    lb = sb[r] if isinstance(sb[r], list) else [sb[r]]
                    assert len(la) == len(lb), where
                    for x, y in zip(la, lb, strict=True):
                        assert (x.shape, x.dtype) == (y.shape, y.dtype), f"{where} rank {r} {side}"
                        if x.values is not None and y.values is not None:
                            np.testing.assert_array_equal(
                                x.values, y.values, err_msg=f"{where} rank {r} {side}"
                            )
        elif isinstance(ea, RedistributeEvent):
            assert (ea.src, ea.dst, ea.plan, ea.explicit, ea.before, ea.after) == (
                eb.src,
                eb.dst,
                eb.plan,
                eb.explicit,
                eb.before,
                eb.after,
            ), where
        elif isinstance(ea, OpEvent):
            assert (ea.name, ea.input_placements, ea.output_placements) == (
                eb.name,
                eb.input_placements,
                eb.output_placements,
            ), where


def check(prog: Program, sides: Sequence[tuple[str, Callable[[Program], Outcome]]] = ()) -> str | None:
    """Run ``prog`` on every side and compare; None when all agree, else the refusal every
    simulated side made the same way (torch's own, on every side alike). A disagreement fails."""
    sides = sides or SIDES
    (_ref_name, ref_run), *others = sides
    want = ref_run(prog)
    outcomes = [(name, run(prog)) for name, run in others]
    errors = {name: o.error for name, o in outcomes}
    if any(errors.values()):
        assert len(set(errors.values())) == 1, f"the sides disagree on {prog}: {errors}"
        return next(iter(errors.values()))
    for name, o in outcomes:
        compare_results(prog, want, o, name)
    # every simulation's trace against the first's (lockstep's), event by event
    traced = [(name, o.trace) for name, o in outcomes if o.trace is not None]
    if traced:
        (first_name, first), *rest = traced
        for name, other in rest:
            event_equal(first, other, shard_to_shard_may_differ=bool({first_name, name} & CPU_GROUPS))
    return None
