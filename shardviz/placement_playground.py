"""``sv.playground()``: pick a shape, a mesh and two placements; see DTensor's redistribute.

The front end half of the playground: it checks a choice, and runs the redistribute itself, on
``torch.arange`` values under the local simulator for small shapes, or as a geometry-only plan
(``sv.plan``) for model-size ones. The widget (views/playground.py) draws what comes back and
never imports torch.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .data.plan import plan as _plan
from .data.trace import Trace
from .geometry.layout import check_arguments
from .geometry.placement import normalize

# Past either limit the redistribute is planned from geometry only: values of a bigger tensor
# would not fit the view, and a simulated world of more ranks takes seconds per change.
VALUES_MAX_ELEMENTS = 4096
VALUES_MAX_RANKS = 16

DEFAULT_CHOICE: dict[str, Any] = {
    "shape": [10, 6],
    "mesh_shape": [4],
    "mesh_dim_names": ["tp"],
    "src": ["S(0)"],
    "dst": ["R"],
}


class ChoiceError(ValueError):
    """A choice the playground cannot draw, with the reason in words."""


def _ints(value: Any, what: str) -> list[int]:
    given = value
    if isinstance(value, str):  # as typed in the view: "10, 6", "(10, 6)" or "10x6"
        value = [v for v in re.split(r"[,\s()\[\]×]+|(?<=\d)x(?=\d)", value) if v]
    try:
        out = [int(v) for v in value]
    except (TypeError, ValueError):
        raise ChoiceError(f"{what} must be whole numbers, e.g. 10, 6; got {given!r}") from None
    if any(v < 0 for v in out):
        raise ChoiceError(f"{what} cannot be negative: {out}")
    return out


def check_choice(choice: Mapping[str, Any]) -> dict[str, Any]:
    """The choice with its parts as lists, or a ChoiceError saying what is wrong and how to fix it."""
    unknown = sorted(set(choice) - set(DEFAULT_CHOICE))
    if unknown:
        raise ChoiceError(f"unknown choice key(s) {unknown}; the playground takes {sorted(DEFAULT_CHOICE)}")
    c = {**DEFAULT_CHOICE, **choice}
    shape = _ints(c["shape"], "the tensor shape")
    mesh = _ints(c["mesh_shape"], "the mesh shape")
    if not mesh or any(n < 1 for n in mesh):
        raise ChoiceError(f"the mesh shape needs at least one dim, each of size 1 or more: got {mesh}")
    names = c["mesh_dim_names"]
    names = [str(n) for n in names] if names else [f"d{m}" for m in range(len(mesh))]
    if len(names) != len(mesh):
        raise ChoiceError(
            f"{len(names)} mesh dim name(s) {names} for a {len(mesh)}-D mesh {mesh}: "
            "give one name per mesh dim"
        )
    src, dst = [str(p) for p in c["src"]], [str(p) for p in c["dst"]]
    for which, pl in (("source", src), ("target", dst)):
        if len(pl) != len(mesh):
            raise ChoiceError(
                f"{len(pl)} {which} placement(s) {pl} for a {len(mesh)}-D mesh {mesh}: give one per mesh dim"
            )
        try:
            check_arguments(shape, mesh, pl, names)
        except (TypeError, ValueError) as e:
            raise ChoiceError(f"{which} placements {pl}: {e}") from None
    dstp = normalize(dst, len(shape), len(mesh))
    srcp = normalize(src, len(shape), len(mesh))
    for m, (s, d) in enumerate(zip(srcp, dstp, strict=True)):
        if d.kind == "partial" and s != d:
            raise ChoiceError(
                f"mesh dim {names[m]}: {s} -> {d} is not a redistribute DTensor plans (it refuses to turn a "
                "Shard or Replicate placement into Partial); choose Partial as the source instead"
            )
    return {"shape": shape, "mesh_shape": mesh, "mesh_dim_names": names, "src": src, "dst": dst}


def _simulate(c: Mapping[str, Any]) -> Trace:
    """The redistribute run by DTensor under the local simulator on ``arange`` values."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from .backends import session
    from .backends.local import LocalBackend
    from .geometry.placement import parse

    shape, mesh_shape, names = c["shape"], c["mesh_shape"], c["mesh_dim_names"]
    world = math.prod(mesh_shape)

    def torch_placement(text: str) -> Any:
        from torch.distributed.tensor import Partial, Shard

        p = parse(text)
        if p.kind == "shard" and p.dim is not None:
            return Shard(p.dim)
        if p.kind == "partial":
            return Partial(p.reduce_op)
        return Replicate()

    src = [torch_placement(p) for p in c["src"]]
    dst = [torch_placement(p) for p in c["dst"]]

    def body() -> Any:
        from torch.distributed.tensor import DTensor

        mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=tuple(names))
        x = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
        start = [Replicate() if p.is_partial() else p for p in src]
        dt = distribute_tensor(x, mesh, start)
        if start != src:
            # Partial: each rank holds a term of the pending reduction. For a sum, x / n on every
            # rank of the n along the Partial dims (DTensor's own split); other reductions, x.
            n = math.prod(mesh_shape[m] for m, p in enumerate(src) if p.is_partial("sum"))
            local = dt.to_local() / n if n > 1 else dt.to_local()
            dt = DTensor.from_local(local, mesh, src, run_check=False, shape=x.shape, stride=x.stride())
        return dt.redistribute(mesh, dst).to_local()

    current = session.peek()  # the user's backend, if any: reused when it simulates this world
    saved = session.last_trace()  # sv.last_trace() stays the user's, not the playground's
    try:
        if type(current) is LocalBackend and current.world_size == world:
            return current.run(body, (), {}, values="all")
        local = LocalBackend(world)
        try:
            with session.swapped(local):
                return local.run(body, (), {}, values="all")
        finally:
            local.close()
    finally:
        session.set_last(saved)


def _last_redistribute(trace: Trace) -> Trace:
    """The trace cut to the last explicit redistribute and its collectives (the setup's scatter
    and the Partial's making are not the redistribute the user chose)."""
    from .data.events import RedistributeEvent

    ids = [e.id for e in trace.events if isinstance(e, RedistributeEvent)]
    if not ids:
        return trace
    last = ids[-1]
    out = Trace(trace.world_size, trace.backend, trace.values)
    out.meshes = list(trace.meshes)
    # The source line each event recorded is the playground's own machinery (a traitlets observer
    # in a notebook), not a line of the user's: dropped rather than shown as theirs.
    out.events = [
        dataclasses.replace(e, source=None)
        for e in trace.events
        if e.id == last or getattr(e, "parent", None) == last
    ]
    return out


def _geometry(c: Mapping[str, Any]) -> Trace:
    return _plan(c["shape"], c["mesh_shape"], c["src"], c["dst"], c["mesh_dim_names"])


def _other_world(world: int) -> int | None:
    """The world size of the user's simulator when it is not ``world`` (its process group is the
    one in the way: the playground leaves it alone), else None."""
    from .backends import session
    from .backends.local import LocalBackend

    current = session.peek()
    if type(current) is LocalBackend and current.world_size != world:
        return current.world_size
    return None


def compute(choice: Mapping[str, Any]) -> tuple[dict[str, Any], Trace, str, str]:
    """(the checked choice, the redistribute's trace, "values" or "geometry", a note saying which)."""
    c = check_choice(choice)
    numel = math.prod(c["shape"])
    world = math.prod(c["mesh_shape"])
    if numel <= VALUES_MAX_ELEMENTS and world <= VALUES_MAX_RANKS:
        other = _other_world(world)
        if other is not None:
            note = (
                f"geometry only (sv.plan): the simulator in this kernel runs {other} ranks and this mesh has "
                f"{world}; sv.use('local', world_size={world}) gives real values for it"
            )
            return c, _geometry(c), "geometry", note
        try:
            trace = _last_redistribute(_simulate(c))
        except Exception as e:  # the simulator cannot run it here: say why, show the plan instead
            note = (
                f"geometry only (sv.plan): the simulator could not run this redistribute here "
                f"({type(e).__name__}: {e})"
            )
            return (
                c,
                _geometry(c),
                "geometry",
                note,
            )
        note = (
            f"real values: DTensor's redistribute ran under the local simulator on {world} rank(s), "
            f"on torch.arange({numel}) float32"
        )
        return c, trace, "values", note
    why = (
        f"{numel:,} elements > {VALUES_MAX_ELEMENTS:,}"
        if numel > VALUES_MAX_ELEMENTS
        else f"{world} ranks > {VALUES_MAX_RANKS}"
    )
    note = f"geometry only (sv.plan: shapes and bytes, no values): {why}"
    return c, _geometry(c), "geometry", note


def playground(
    shape: Sequence[int] | None = None,
    mesh_shape: Sequence[int] | None = None,
    src: Sequence[str] | None = None,
    dst: Sequence[str] | None = None,
    mesh_dim_names: Sequence[str] | None = None,
    *,
    link: str | None = None,
) -> Any:
    """The placement playground widget (see ``shardviz.playground``)."""
    from .views.playground import PlaygroundWidget

    given = {
        "shape": shape,
        "mesh_shape": mesh_shape,
        "src": src,
        "dst": dst,
        "mesh_dim_names": mesh_dim_names,
    }
    choice = {k: list(v) for k, v in given.items() if v is not None}
    if mesh_shape is not None and mesh_dim_names is None:
        choice["mesh_dim_names"] = [f"d{m}" for m in range(len(mesh_shape))]
    c = check_choice(choice)  # a bad first choice raises here, at the caller's line
    return PlaygroundWidget(c, compute, link=link)
