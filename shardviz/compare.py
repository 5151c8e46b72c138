"""Simulator against real ranks: run the same code both ways and report where they differ.

The simulator is a model of what real process groups do; ``sv.compare(fn)`` and ``%%spmd --compare``
check that model on your code. Both runs are recorded and compared event by event, per rank:
the collective sequence, the groups, each rank's buffer shapes, dtypes and values (within a
tolerance), redistribute plans and layouts, and what the function returned.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .backends import session
from .backends.base import Backend
from .backends.choose import current
from .data.events import CollectiveEvent, Event, OpEvent, RedistributeEvent, TensorSnapshot
from .data.trace import Trace
from .errors import BackendError, explain

RTOL = 1e-5
ATOL = 1e-6


@dataclass(frozen=True)
class Difference:
    """One way the two runs differ; ``rank`` None means all ranks, ``event`` None the results."""

    rank: int | None
    event: int | None
    what: str  # sequence | groups | mesh_dim | reduce_op | root | shape | dtype | values | plan | ...
    detail: str

    def __str__(self) -> str:
        where = f"event #{self.event}" if self.event is not None else "result"
        return f"{where} {self.what}: {self.detail}"


class Comparison:
    """The outcome of ``sv.compare``: both traces and their differences, per rank."""

    def __init__(
        self, simulated: Trace, real: Trace, differences: list[Difference], rtol: float, atol: float
    ) -> None:
        self.simulated = simulated
        self.real = real
        self.differences = differences
        self.rtol = rtol
        self.atol = atol

    @property
    def ok(self) -> bool:
        return not self.differences

    def by_rank(self) -> dict[int | None, list[Difference]]:
        out: dict[int | None, list[Difference]] = {}
        for d in self.differences:
            out.setdefault(d.rank, []).append(d)
        return out

    def __str__(self) -> str:
        real = self.real.backend
        n = len(self.real.events)
        head = f"simulator vs {real}, {self.real.world_size} ranks, {n} event{'s' if n != 1 else ''}"
        if self.ok:
            return f"{head}: no differences (rtol={self.rtol:g}, atol={self.atol:g})"
        lines = [f"{head}: {len(self.differences)} difference{'s' if len(self.differences) != 1 else ''}"]
        groups = self.by_rank()
        for rank in sorted(groups, key=lambda r: -1 if r is None else r):
            lines.append("all ranks:" if rank is None else f"rank {rank}:")
            lines.extend(f"  {d}" for d in groups[rank])
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Comparison simulator vs {self.real.backend}: {len(self.differences)} differences>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def compare(
    fn: Callable[..., Any],
    *args: Any,
    values: str | int = "all",
    rtol: float = RTOL,
    atol: float = ATOL,
    **kwargs: Any,
) -> Comparison:
    """Run ``fn(*args, **kwargs)`` in the simulator (same world size) and on the current real
    backend, and compare the two traces and results per rank."""
    from .record import run

    real = _real_backend("sv.compare")
    with _simulator(real.world_size):
        try:
            simulated = run(fn, *args, values=values, **kwargs)
        except BaseException as e:
            raise explain(e, "(raised by the simulator run of sv.compare)") from None
    actual = real.run(fn, args, kwargs, values=values)
    return Comparison(simulated, actual, diff_traces(simulated, actual, rtol, atol), rtol, atol)


def compare_cell(cell: str, shell: Any, values: str | int | None = None) -> Comparison:
    """``%%spmd --compare``: the cell in the simulator (in a scratch copy of the notebook's names,
    its prints discarded) and on the real ranks (where its names stay, as for any cell)."""
    from .backends.cells import compile_cell, run_compiled
    from .record import last_trace, record

    real = _real_backend("%%spmd --compare")
    policy = "all" if values is None else values
    body, last = compile_cell(cell)
    ns = dict(getattr(shell, "user_ns", None) or {})
    with _simulator(real.world_size):
        try:
            with contextlib.redirect_stdout(io.StringIO()), record(policy) as simulated:
                run_compiled(body, last, ns)
        except BaseException as e:
            raise explain(e, "(raised by the simulator run of %%spmd --compare)") from None
    real.run_cell(cell, shell, values=policy)
    actual = last_trace()
    assert actual is not None
    return Comparison(simulated, actual, diff_traces(simulated, actual, RTOL, ATOL), RTOL, ATOL)


def _real_backend(who: str) -> Backend:
    real = current()
    if real.simulated:
        raise BackendError(
            f"{who} compares the simulator with real process groups: switch to one first, e.g. "
            "sv.use('gloo', world_size=4), or to one thread per rank: sv.use('threads', world_size=4)"
        )
    return real


@contextlib.contextmanager
def _simulator(world_size: int) -> Any:
    from .backends.local import LocalBackend

    local = LocalBackend(world_size)
    try:
        with session.swapped(local):
            yield local
    finally:
        local.close()


# --- the diff ------------------------------------------------------------------------------------


def diff_traces(
    a: Trace,
    b: Trace,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> list[Difference]:
    """Differences between two traces of the same code, ``a`` from the simulator, ``b`` real.

    Events are compared in order up to the first point where the sequences diverge (past it they
    no longer pair up); source file names are ignored, since each run compiles the cell anew.
    """
    names = ("simulator", b.backend)
    out: list[Difference] = []
    if a.world_size != b.world_size:
        out.append(
            Difference(
                None, None, "world_size", f"{a.world_size} ({names[0]}) vs {b.world_size} ({names[1]})"
            )
        )
        return out
    for i in range(max(len(a.events), len(b.events))):
        ea = a.events[i] if i < len(a.events) else None
        eb = b.events[i] if i < len(b.events) else None
        if ea is None or eb is None or _step(ea) != _step(eb):
            out.append(
                Difference(
                    None, i, "sequence", f"{_describe(ea)} ({names[0]}) vs {_describe(eb)} ({names[1]})"
                )
            )
            break
        out.extend(_diff_event(i, ea, eb, names, rtol, atol))
    out.extend(_diff_results(a.results, b.results, names, rtol, atol))
    return out


def _step(e: Event) -> tuple[Any, ...]:
    if isinstance(e, CollectiveEvent):
        return (e.kind, e.op, e.parent)
    if isinstance(e, RedistributeEvent):
        return (e.kind, e.src, e.dst, e.parent)
    if isinstance(e, OpEvent):
        return (e.kind, e.name, e.parent)
    return (e.kind, getattr(e, "name", None), e.parent)


def _describe(e: Event | None) -> str:
    if e is None:
        return "no event"
    from .data.describe import brief

    return brief(e)


def _diff_event(
    i: int, a: Event, b: Event, names: tuple[str, str], rtol: float, atol: float
) -> list[Difference]:
    out: list[Difference] = []

    def field(what: str, x: Any, y: Any) -> None:
        if x != y:
            out.append(Difference(None, i, what, f"{x!r} ({names[0]}) vs {y!r} ({names[1]})"))

    sa = (a.source.line, a.source.text) if a.source else None
    sb = (b.source.line, b.source.text) if b.source else None
    field("source", sa, sb)
    if isinstance(a, CollectiveEvent) and isinstance(b, CollectiveEvent):
        field("groups", [list(g) for g in a.groups], [list(g) for g in b.groups])
        field("mesh_dim", (a.mesh_dim, a.mesh_dim_name), (b.mesh_dim, b.mesh_dim_name))
        field("reduce_op", a.reduce_op, b.reduce_op)
        field("root", a.root, b.root)
        skip_in, skip_out = _unread(a), _unread(b)
        for side, xa, xb, skip in (
            ("input", a.inputs, b.inputs, skip_in[0] | skip_out[0]),
            ("output", a.outputs, b.outputs, skip_in[1] | skip_out[1]),
        ):
            out.extend(_diff_per_rank(i, side, _drop(xa, skip), _drop(xb, skip), names, rtol, atol))
        for r in sorted(set(a.nbytes) | set(b.nbytes)):
            if r not in skip_in[0] and a.nbytes.get(r) != b.nbytes.get(r):
                out.append(
                    Difference(
                        r, i, "nbytes", f"{a.nbytes.get(r)} ({names[0]}) vs {b.nbytes.get(r)} ({names[1]})"
                    )
                )
    elif isinstance(a, RedistributeEvent) and isinstance(b, RedistributeEvent):
        field("plan", a.plan, b.plan)
        field("layout before", a.before, b.before)
        field("layout after", a.after, b.after)
    elif isinstance(a, OpEvent) and isinstance(b, OpEvent):
        field("input placements", a.input_placements, b.input_placements)
        field("output placements", a.output_placements, b.output_placements)
    elif hasattr(a, "inputs") and hasattr(b, "inputs"):  # local compute on shards, per rank
        for side in ("inputs", "outputs"):
            out.extend(_diff_per_rank(i, side[:-1], getattr(a, side), getattr(b, side), names, rtol, atol))
    return out


def _unread(e: CollectiveEvent) -> tuple[set[int], set[int]]:
    """Ranks whose input (resp. output) buffer a rooted collective ignores: a scatter reads only the
    root's list, a gather or reduce fills only the root's. The simulator runs every rank as if it
    were the root there, so those buffers legitimately differ from a real run."""
    ranks = {r for g in e.groups for r in g}
    roots = set(e.roots())
    if e.op == "scatter":
        return ranks - roots, set()
    if e.op in ("gather", "reduce"):
        return set(), ranks - roots
    return set(), set()


def _drop(d: Mapping[int, Any], ranks: set[int]) -> dict[int, Any]:
    return {r: v for r, v in d.items() if r not in ranks}


def _diff_per_rank(
    i: int,
    side: str,
    a: Mapping[int, Any],
    b: Mapping[int, Any],
    names: tuple[str, str],
    rtol: float,
    atol: float,
) -> list[Difference]:
    out = []
    for r in sorted(set(a) | set(b)):
        if r not in a or r not in b:
            missing = names[0] if r not in a else names[1]
            out.append(Difference(r, i, side, f"no {side} buffer in the {missing} run"))
            continue
        xa, xb = a[r], b[r]
        la = xa if isinstance(xa, list) else [xa]
        lb = xb if isinstance(xb, list) else [xb]
        if len(la) != len(lb):
            out.append(Difference(r, i, f"{side} count", f"{len(la)} ({names[0]}) vs {len(lb)} ({names[1]})"))
            continue
        for k, (sa, sb) in enumerate(zip(la, lb, strict=True)):
            label = side if len(la) == 1 else f"{side}[{k}]"
            out.extend(_diff_snapshot(r, i, label, sa, sb, names, rtol, atol))
    return out


def _diff_snapshot(
    r: int,
    i: int | None,
    label: str,
    a: TensorSnapshot,
    b: TensorSnapshot,
    names: tuple[str, str],
    rtol: float,
    atol: float,
) -> list[Difference]:
    if a.shape != b.shape:
        return [Difference(r, i, f"{label} shape", f"{a.shape} ({names[0]}) vs {b.shape} ({names[1]})")]
    if a.dtype != b.dtype:
        return [Difference(r, i, f"{label} dtype", f"{a.dtype} ({names[0]}) vs {b.dtype} ({names[1]})")]
    if a.values is None or b.values is None:
        return []
    return _diff_values(r, i, label, a.values, b.values, rtol, atol)


def _diff_values(
    r: int, i: int | None, label: str, x: np.ndarray, y: np.ndarray, rtol: float, atol: float
) -> list[Difference]:
    if x.size == 0 and y.size == 0:
        return []
    if x.dtype.kind in "fc" or y.dtype.kind in "fc":
        close = np.isclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    else:
        close = x == y
    if bool(np.all(close)):
        return []
    bad = int(np.size(close) - np.count_nonzero(close))
    idx = tuple(int(j) for j in np.argwhere(~close)[0]) if np.ndim(close) else ()

    def show(v: Any) -> str:
        return repr(v.item()) if hasattr(v, "item") else repr(v)

    first = f"first at {idx}: {show(x[idx])} vs {show(y[idx])}" if idx else f"{show(x)} vs {show(y)}"
    return [Difference(r, i, f"{label} values", f"{bad} of {np.size(close)} elements differ; {first}")]


def _diff_results(
    a: Mapping[int, Any] | None,
    b: Mapping[int, Any] | None,
    names: tuple[str, str],
    rtol: float,
    atol: float,
) -> list[Difference]:
    if a is None or b is None:
        return []
    out = []
    for r in sorted(set(a) | set(b)):
        if r not in a or r not in b:
            out.append(
                Difference(r, None, "result", f"missing in the {names[0] if r not in a else names[1]} run")
            )
            continue
        out.extend(_diff_result(r, a[r], b[r], names, rtol, atol))
    return out


def _diff_result(
    r: int, x: Any, y: Any, names: tuple[str, str], rtol: float, atol: float
) -> list[Difference]:
    if hasattr(x, "shape") and hasattr(y, "shape") and hasattr(x, "dtype"):
        xa, ya = _array(x), _array(y)
        if xa.shape != ya.shape:
            return [
                Difference(r, None, "result shape", f"{xa.shape} ({names[0]}) vs {ya.shape} ({names[1]})")
            ]
        if str(x.dtype) != str(y.dtype):
            return [Difference(r, None, "result dtype", f"{x.dtype} ({names[0]}) vs {y.dtype} ({names[1]})")]
        return _diff_values(r, None, "result", xa, ya, rtol, atol)
    if isinstance(x, tuple | list) and isinstance(y, tuple | list) and len(x) == len(y):
        return [d for p, q in zip(x, y, strict=True) for d in _diff_result(r, p, q, names, rtol, atol)]
    try:
        same = bool(x == y)
    except Exception:
        same = False
    return [] if same else [Difference(r, None, "result", f"{x!r} ({names[0]}) vs {y!r} ({names[1]})")]


def _array(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    t = x.detach().cpu()
    if not t.dtype.is_complex and (t.dtype.is_floating_point and t.element_size() < 4):
        t = t.float()
    return t.numpy()
