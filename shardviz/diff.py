"""``sv.diff`` and ``sv.numerics``: where does the parallel run first differ from the single-device one?

The reference is the user's unsharded model, deep-copied and run in plain torch in this process,
outside any simulation. The parallel side is ``parallelize(copy)`` — the user's function: it builds
the mesh, applies TP / FSDP / anything, and returns the module — run through ``sv.run`` on the
current backend (the lockstep simulator, or real ranks), with the same inputs, loss and optimizer.
Both runs are captured module by module (``numerics_capture``), assembled into full tensors and
compared row by row (``numerics``); the parallel run's trace names the collectives and
redistributes just before the first difference.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .backends.choose import current
from .capture import numerics_hooks as numerics_capture
from .capture import torch as _torch
from .capture.numerics_hooks import DEFAULT_BUDGET
from .data import describe
from .data.events import Source
from .data.numerics import (
    EventNote,
    NumericsReport,
    RawCapture,
    StepNumerics,
    ToleranceSpec,
    build_run,
    check_tolerance,
    compare,
    merge_raw,
    precision,
    rounding_errors,
)
from .data.trace import DEFAULT_VALUE_BUDGET, Trace
from .errors import BackendError


def numerics(
    model: nn.Module,
    inputs: Any,
    parallelize: Callable[[nn.Module], Any] | None = None,
    *,
    loss: Callable[[Any], Any] | None = None,
    optimizer: Callable[[Any], Any] | bool | None = None,
    tolerance: ToleranceSpec = None,
    modules: Sequence[str] | None = None,
    backward: bool = True,
    budget: int = DEFAULT_BUDGET,
    seed: int | None = 0,
    values: str | int = DEFAULT_VALUE_BUDGET,
    reference: StepNumerics | None = None,
) -> StepNumerics:
    """One training step of ``model`` captured module by module, as full tensors.

    Without ``parallelize``: a deep copy of ``model`` in plain torch, here. With it: a deep copy
    given to ``parallelize`` (which builds the mesh, shards the model and returns it) inside
    ``sv.run`` on the current backend; plain local tensors are laid out in the global shapes of
    ``reference`` (a plain run, made here when not given). ``sv.diff(a, b)`` compares two of them.
    Options: see :func:`diff`.
    """
    _check_common(model, inputs, loss, optimizer, tolerance, modules, budget)
    if not isinstance(inputs, PerRankInputs):
        inputs = PerRankInputs.of(inputs, current().world_size) or inputs
    if parallelize is None:
        _outside_simulation("sv.numerics")
        if isinstance(inputs, PerRankInputs):
            inputs = inputs.whole
        opts: dict[str, Any] = dict(
            loss=loss, optimizer=optimizer, budget=budget, backward=backward, modules=modules, seed=seed
        )
        raw = numerics_capture.run_step(copy.deepcopy(model), inputs, **opts)
        run = build_run("plain torch", raw, tolerance=tolerance)
        return _with_rounding(run, model, inputs, opts)
    if not callable(parallelize):
        raise TypeError(
            f"sv.numerics: parallelize must be a function that takes the model and returns it parallelized, "
            f"not a {type(parallelize).__name__}"
        )
    if reference is None:
        reference = numerics(
            model,
            inputs.whole if isinstance(inputs, PerRankInputs) else inputs,
            loss=loss,
            optimizer=optimizer,
            modules=modules,
            backward=backward,
            budget=budget,
            seed=seed,
        )
    backend = current()
    raw, trace = _parallel_step(
        backend,
        model,
        inputs,
        parallelize,
        loss=loss,
        optimizer=optimizer,
        modules=modules,
        backward=backward,
        budget=budget,
        seed=seed,
        values=values,
    )
    label = f"{_name(parallelize)} on {backend.name} ({backend.world_size} ranks)"
    events = event_notes(trace, _caller())
    return build_run(label, raw, shapes=reference.shapes(), tolerance=tolerance, events=events, trace=trace)


def diff(
    reference: Any,
    parallel: Any,
    inputs: Any = None,
    *,
    against: Callable[[nn.Module], Any] | str | None = None,
    loss: Callable[[Any], Any] | None = None,
    optimizer: Callable[[Any], Any] | bool | None = None,
    tolerance: ToleranceSpec = None,
    modules: Sequence[str] | None = None,
    backward: bool = True,
    budget: int = DEFAULT_BUDGET,
    seed: int | None = 0,
    values: str | int = DEFAULT_VALUE_BUDGET,
    context: int = 6,
) -> NumericsReport:
    """Where does the parallel run of a training step first differ from the single-device one?

    ``sv.diff(model, parallelize, inputs)``: ``model`` is the unsharded module; ``parallelize`` a
    function that takes a copy of it (same initial weights), builds the mesh, applies TP / FSDP /
    any plan and returns the module. The same step — ``model(*inputs)``, ``loss(output)``,
    backward, ``optimizer(params).step()`` — runs in plain torch here (the reference) and through
    ``sv.run`` on the current backend (the lockstep simulator, one thread per rank, or real ranks).
    Every module call's inputs and outputs, the gradients flowing back out of it, every parameter
    at the start, its gradient and its value after the step are assembled into full tensors from
    the ranks' shards (replicas checked against each other) and compared; the report names the
    first row beyond tolerance, with the collectives and redistributes just before it, then
    everything after.

    ``against=``: another ``parallelize`` function (two parallel configurations: TP=2 against
    TP=4), or ``"simulator"`` on real ranks or threads (the same function in the lockstep simulator
    against them); the other side is then the reference. ``sv.diff(a, b)`` compares two
    ``sv.numerics`` runs.

    ``inputs`` may differ per rank (data parallel written by hand): a function of the rank, or
    ``sv.per_rank`` values; the reference then runs the whole batch, the distinct parts in rank
    order along dim 0, and a loss each rank computes over its own rows is recognised.

    Options: ``loss`` (default: the output's mean; a model whose output holds no floating-point
    tensor is compared forward only), ``optimizer`` (a function of the parameters; default SGD
    with lr 0.01; False: no step), ``tolerance`` (by default built per row: the rule of its dtype
    of computation — float32 rtol 1e-5 and atol 1e-5 of the magnitude of what produced it,
    bfloat16 1e-2, ... — plus 4x the reference's own rounding measured in float64 below float32;
    a number, a (rtol, atol) pair or a dict by dtype name replaces it), ``modules`` (capture only
    these module paths and their children),
    ``backward=False`` (no full backward hooks: for models that write their outputs in place),
    ``budget`` (bytes of captured values, every rank's; default 256 MiB; past it a
    ``NumericsBudgetError`` says what to do), ``seed`` (``torch.manual_seed`` before each run),
    ``values`` (the parallel run's trace value policy), ``context`` (events kept per row).

    The model must be deterministic (no dropout). ``report.save(path)`` keeps the report;
    ``sv.load(path)`` reads it back.
    """
    if isinstance(reference, StepNumerics) or isinstance(parallel, StepNumerics):
        if not (isinstance(reference, StepNumerics) and isinstance(parallel, StepNumerics)):
            raise TypeError(
                "sv.diff(a, b) with captured runs needs two StepNumerics (from sv.numerics); to run a "
                "model, pass sv.diff(model, parallelize, inputs)"
            )
        if inputs is not None or against is not None:
            raise TypeError("sv.diff(a, b) of two captured runs takes no inputs or against=: they have run")
        check_tolerance(tolerance)
        return compare(reference, parallel, tolerance, context=context)
    if not isinstance(reference, nn.Module):
        raise TypeError(
            f"sv.diff(model, parallelize, inputs): the first argument is the unsharded nn.Module, not a "
            f"{type(reference).__name__}"
        )
    if not callable(parallel) or isinstance(parallel, nn.Module):
        raise TypeError(
            "sv.diff(model, parallelize, inputs): the second argument is a function that takes a copy of the "
            f"model, parallelizes it and returns it; got a {type(parallel).__name__}"
        )
    if inputs is None:
        raise TypeError(
            "sv.diff(model, parallelize, inputs): give the inputs (a tensor, a tuple of them, or a dict)"
        )
    if against is not None and not (callable(against) or against == "simulator"):
        raise ValueError(f"against={against!r}: give another parallelize function, or 'simulator'")
    opts: dict[str, Any] = dict(
        loss=loss, optimizer=optimizer, modules=modules, backward=backward, budget=budget, seed=seed
    )
    _check_common(reference, inputs, loss, optimizer, tolerance, modules, budget)
    ranks = PerRankInputs.of(inputs, current().world_size)
    if ranks is not None:
        plain = numerics(reference, ranks.whole, **opts)
        inputs = ranks
    else:
        plain = numerics(reference, inputs, **opts)
    base = plain
    if against == "simulator":
        base = _in_simulator(reference, inputs, parallel, plain, opts, values, tolerance)
    elif callable(against):
        base = numerics(
            reference, inputs, against, tolerance=tolerance, values=values, reference=plain, **opts
        )
    par = numerics(reference, inputs, parallel, tolerance=tolerance, values=values, reference=plain, **opts)
    if base is not plain:  # two parallel runs: each rounds as the plain reference does
        base = dataclasses.replace(base, rounding=plain.rounding)
    return compare(base, par, tolerance, context=context)


def _with_rounding(run: StepNumerics, model: nn.Module, inputs: Any, opts: dict[str, Any]) -> StepNumerics:
    """A plain run computed in a dtype below float32, with each row's own rounding error: the same
    step again in float64, compared row by row. That error is what rounding left after every
    operator before the row, which no rule on the row alone can know; the parallel run rounds as
    often, in another order, and may differ from the reference by as much."""
    if not any((precision(e.dtype) or 99) < 23 for e in run.entries.values()):
        return run
    try:
        raw = numerics_capture.run_step(
            copy.deepcopy(model).double(), numerics_capture.to_float64(inputs), **opts
        )
        exact = build_run("plain torch, float64", raw)
    except Exception as e:  # a model that runs only in its own dtype: the dtype rule alone
        note = (
            f"the reference could not be repeated in float64 to measure its rounding ({type(e).__name__}: "
            f"{e}); tolerances follow the dtypes alone"
        )
        return dataclasses.replace(run, notes=(*run.notes, note))
    return dataclasses.replace(run, rounding=rounding_errors(run, exact))


def _in_simulator(
    model: nn.Module,
    inputs: Any,
    parallelize: Callable[[nn.Module], Any],
    plain: StepNumerics,
    opts: dict[str, Any],
    values: str | int,
    tolerance: ToleranceSpec,
) -> StepNumerics:
    from .compare import _simulator

    real = current()
    if real.simulated:
        raise BackendError(
            "sv.diff(..., against='simulator') sets real ranks (or one thread per rank) against the "
            "lockstep simulator: switch first (sv.use('gloo', world_size=4) or sv.use('threads', "
            "world_size=4)); in the simulator, sv.diff(model, parallelize, inputs) compares with plain torch"
        )
    with _simulator(real.world_size):
        return numerics(
            model, inputs, parallelize, tolerance=tolerance, values=values, reference=plain, **opts
        )


def _parallel_step(
    backend: Any,
    model: nn.Module,
    inputs: Any,
    parallelize: Callable[[nn.Module], Any],
    *,
    loss: Callable[[Any], Any] | None,
    optimizer: Callable[[Any], Any] | bool | None,
    modules: Sequence[str] | None,
    backward: bool,
    budget: int,
    seed: int | None,
    values: str | int,
) -> tuple[RawCapture, Trace]:
    """The step on every rank of ``backend``, through ``sv.run``; each rank reports its pieces."""
    from .record import run

    _outside_simulation("sv.diff")
    world = backend.world_size
    device = backend.device_type()
    twin = copy.deepcopy(model)  # made here, outside the simulation: plain tensors every rank starts from
    share = budget if backend.simulated else max(1, budget // world)

    def step() -> Any:
        return numerics_capture.run_step(
            twin,
            inputs.mine() if isinstance(inputs, PerRankInputs) else inputs,
            parallelize=parallelize,
            loss=loss,
            optimizer=optimizer,
            world_size=world,
            device=device,
            budget=share,
            backward=backward,
            modules=modules,
            seed=seed,
        )

    trace = run(step, values=values)
    results = trace.results or {}
    raws = [v for _, v in sorted(results.items()) if isinstance(v, RawCapture)]
    if not raws:
        raise BackendError(
            f"sv.diff: the ranks returned no capture ({sorted(results)}); this is a shardviz bug"
        )
    return merge_raw(raws), trace


@dataclass(frozen=True)
class PerRankInputs:
    """Inputs that differ per rank (each rank's part of the batch): ``by_rank[r]`` is rank r's
    inputs (a tensor, a tuple or list of them, or a dict), ``whole`` the whole batch the reference
    runs on: each tensor's distinct per-rank values, in rank order, concatenated along dim 0
    (ranks holding the same value, as the tensor-parallel ranks of one data-parallel group do,
    count once)."""

    by_rank: tuple[Any, ...]
    whole: Any

    @staticmethod
    def of(inputs: Any, world: int) -> PerRankInputs | None:
        """``inputs`` as per-rank inputs, or None when they are the same on every rank: a function
        of the rank, or a structure holding per-rank tensors (``sv.per_rank(...)``)."""
        if callable(inputs) and not isinstance(inputs, torch.Tensor):
            by_rank = tuple(inputs(r) for r in range(world))
        elif _any_per_rank(inputs):
            by_rank = tuple(_at_rank(inputs, r) for r in range(world))
        else:
            return None
        return PerRankInputs(by_rank, _whole(list(by_rank)))

    def mine(self) -> Any:
        """This rank's inputs, inside ``sv.run``: per-rank tensors made with ``sv.per_rank``."""
        from .record import per_rank

        def leaf(path: tuple[Any, ...]) -> Any:
            first = _get(self.by_rank[0], path)
            if not isinstance(first, torch.Tensor):
                return first
            return per_rank(lambda r: _get(self.by_rank[r], path))

        return _rebuild(self.by_rank[0], leaf, ())


def _any_per_rank(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return _torch.is_local_tensor(x)
    if isinstance(x, tuple | list):
        return any(_any_per_rank(v) for v in x)
    if isinstance(x, Mapping):
        return any(_any_per_rank(v) for v in x.values())
    return False


def _at_rank(x: Any, rank: int) -> Any:
    if isinstance(x, torch.Tensor) and _torch.is_local_tensor(x):
        return (_torch.local_tensors(x) or {})[rank]
    if isinstance(x, tuple | list):
        return type(x)(_at_rank(v, rank) for v in x)
    if isinstance(x, Mapping):
        return {k: _at_rank(v, rank) for k, v in x.items()}
    return x


def _get(x: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        x = x[p]
    return x


def _rebuild(x: Any, leaf: Callable[[tuple[Any, ...]], Any], path: tuple[Any, ...]) -> Any:
    if isinstance(x, tuple | list):
        return type(x)(_rebuild(v, leaf, (*path, i)) for i, v in enumerate(x))
    if isinstance(x, Mapping):
        return {k: _rebuild(v, leaf, (*path, k)) for k, v in x.items()}
    return leaf(path)


def _whole(by_rank: list[Any]) -> Any:
    """The whole batch from each rank's part (see ``PerRankInputs``)."""

    def leaf(path: tuple[Any, ...]) -> Any:
        values = [_get(v, path) for v in by_rank]
        if not isinstance(values[0], torch.Tensor):
            if any(v != values[0] for v in values[1:]):
                raise ValueError(
                    f"sv.diff: per-rank inputs: the non-tensor input at {list(path) or 'the top'} differs "
                    "between ranks; only tensors can be per rank"
                )
            return values[0]
        distinct: list[torch.Tensor] = []
        for v in values:
            if not isinstance(v, torch.Tensor) or _torch.is_local_tensor(v) or _torch.is_dtensor(v):
                raise TypeError(
                    "sv.diff: per-rank inputs are each rank's plain tensors (fn(rank) returns them), "
                    f"not a {type(v).__name__}"
                )
            if not any(d.shape == v.shape and torch.equal(d, v) for d in distinct):
                distinct.append(v.detach())
        if len(distinct) == 1:
            return distinct[0]
        try:
            return torch.cat(distinct, dim=0)
        except RuntimeError as e:
            raise ValueError(
                f"sv.diff: per-rank inputs at {list(path) or 'the top'} do not join into one batch along "
                f"dim 0 ({e}); give each rank its rows of the same batch"
            ) from e

    return _rebuild(by_rank[0], leaf, ())


def event_notes(trace: Trace, caller: Source | None = None) -> dict[int, EventNote]:
    """The trace's collectives and redistributes in words, for the report: what each is, the
    module and phase it ran in, and the user's line — unless that is only the ``sv.diff`` call
    (``caller``), as it is for a model whose code lives in an installed library."""
    out = {}
    for e in trace.events:
        if e.kind not in ("collective", "redistribute"):
            continue
        text = describe.line(e)
        where = describe.context(e)
        if where:
            text += f" {where}"
        src = e.source
        if src is not None and src.text and src != caller:
            text += f"  <- {src.text}"
        out[e.id] = EventNote(e.id, e.kind, text, numerics_capture.strip_root(e.module), e.phase, e.parent)
    return out


def _caller() -> Source | None:
    """The user's line that called into shardviz, as the recorder writes an event's source."""
    from .capture.recorder import frames

    return frames.source(frames.user_frame(sys._getframe(1))[0])


def _name(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "parallelize" if name == "<lambda>" else name


def _outside_simulation(who: str) -> None:
    if _torch.active_local_mode() is not None:
        raise BackendError(
            f"{who} runs the reference in plain torch and the parallel step through sv.run itself: call it "
            "outside sv.record() and %%spmd cells"
        )


def _check_common(
    model: Any,
    inputs: Any,
    loss: Any,
    optimizer: Any,
    tolerance: ToleranceSpec,
    modules: Sequence[str] | None,
    budget: int,
) -> None:
    """Refuse bad arguments before anything runs: a typo found after the simulation is costly."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"sv.numerics needs the unsharded nn.Module, not a {type(model).__name__}")
    if loss is not None and not callable(loss):
        raise TypeError(f"loss= must be a function of the model's output, not a {type(loss).__name__}")
    if optimizer not in (None, True, False) and not callable(optimizer):
        raise TypeError(
            "optimizer= must be a function of the parameters (lambda params: torch.optim.SGD(params, "
            f"lr=0.1)), or False for no step; got a {type(optimizer).__name__}"
        )
    if isinstance(optimizer, type):
        raise TypeError(
            f"optimizer={optimizer.__name__}: give a function that builds it with its options, e.g. "
            f"lambda params: {optimizer.__module__}.{optimizer.__name__}(params, lr=0.1)"
        )
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise ValueError(f"budget={budget!r}: a positive number of bytes")
    if modules is not None and (isinstance(modules, str) or not all(isinstance(m, str) for m in modules)):
        raise TypeError('modules= is a list of module paths, e.g. ["layers.0", "output"]')
    check_tolerance(tolerance)
