"""Capture of one training step, module by module, for ``sv.diff``: the torch side.

``run_step`` runs forward, loss, backward and an optimizer step of a module with hooks on every
submodule, and turns what it sees into plain data (``numerics.RawCapture``): each module call's
inputs and outputs (forward hooks, registered after any parallel style's, so they see what the
caller sees), the gradients flowing back out of it (full backward hooks), every parameter at the
start, its gradient after the backward and its value after the step. Each tensor is kept as the
local tensor of each rank this process holds — all of them in the lockstep simulator (a
LocalTensor split by rank), its own on a real rank or a rank's thread — with the DTensor's
layout when it has one; ``numerics.build_run`` assembles the full tensors from them.

Each capture also notes the recording's event count when the module began and when the tensor
was taken, so the report can name the collectives and redistributes that ran just before.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..data.numerics import MeshSplit, RawCapture, RawTensor, RowKey
from ..errors import ShardvizError
from ..geometry.layout import compute as _compute_layout
from . import torch as _torch
from .recorder import mode as _mode
from .recorder.snapshot import flatten, to_numpy

# Values sv.diff keeps by default, summed over every rank's local tensors (replicas that are
# bitwise equal are kept once).
DEFAULT_BUDGET = 256 * 2**20

# Wrappers that add a level to module paths without changing the model: activation checkpointing,
# torch.compile, FSDP1.
_WRAPPERS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")

# Full backward hooks warn when a module's inputs need no gradient (token ids): nothing is wrong,
# the hook still reports the gradients of what it can.
_QUIET = (
    "Full backward hook is firing when gradients are computed with respect to module outputs",
    "FSDP2-wrapped module .* returned a view tensor",
    # A module that returns None (compared forward only) has no backward for its hooks.
    "For backward hooks to be called, module output should be a Tensor",
)


class NumericsBudgetError(ShardvizError, MemoryError):
    """The captured tensors of a step passed the budget of ``sv.diff``."""


def module_path(name: str) -> str:
    """A module's path with wrapper levels removed, so a wrapped model's rows match the plain one's."""
    return ".".join(p for p in name.split(".") if p and p not in _WRAPPERS)


def own_rank() -> int | None:
    """The rank whose tensors this process holds: None in the lockstep simulation (a LocalTensor
    holds every rank's; a plain tensor is the same on all), else this process's (or thread's) rank."""
    if _torch.active_local_mode() is not None:
        return None
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


class StepCapture:
    """Hooks on every module of ``root`` that keep what each call takes and gives, per rank."""

    def __init__(
        self,
        root: nn.Module,
        *,
        world_size: int,
        budget: int = DEFAULT_BUDGET,
        backward: bool = True,
        modules: Sequence[str] | None = None,
    ) -> None:
        self.root = root
        self.world_size = world_size
        self.budget = budget
        self.backward = backward
        self.prefixes = tuple(module_path(m) for m in modules) if modules is not None else None
        self.rank = own_rank()
        self.recorder = _mode.active()
        self.paths: dict[int, str] = {}
        self.modules: list[tuple[str, str]] = []
        for name, mod in root.named_modules():
            path = module_path(name)
            if id(mod) not in self.paths:
                self.paths[id(mod)] = path
                if path not in {p for p, _ in self.modules}:
                    self.modules.append((path, type(mod).__name__))
        self.tensors: list[RawTensor] = []
        self.notes: list[str] = []
        self.nbytes = 0
        self._order = 0
        self._calls: dict[str, int] = {}
        self._back_calls: dict[str, int] = {}
        self._open: list[tuple[int, str, int, int]] = []  # (id(module), path, call, start mark)
        self._back_open: dict[str, list[int]] = {}
        self._handles: list[Any] = []

    # --- where in the recording -------------------------------------------------------------

    def mark(self) -> int:
        """The id the recording's next event will have (0 outside a recording)."""
        return self.recorder.kept_so_far() if self.recorder is not None else 0

    def wanted(self, path: str) -> bool:
        if self.prefixes is None:
            return True
        return any(path == p or path.startswith(p + ".") or not p for p in self.prefixes)

    # --- keeping a tensor --------------------------------------------------------------------

    def take(self, key: RowKey, value: Any, start: int) -> None:
        """Keep ``value`` (a DTensor, a LocalTensor or a plain tensor) for row ``key``."""
        if not isinstance(value, torch.Tensor):
            return
        value = _torch.settled(value)
        layout = None
        problem = None
        if _torch.is_dtensor(value):
            shapes = _torch.dtensor_shape_per_rank(value)
            if shapes is None:
                layout = _compute_layout(**_torch.dtensor_geometry(value))
            else:  # torch raises at the next operator on it; the capture must not fail first
                problem = (
                    f"a DTensor whose global shape differs per rank ({dict(sorted(shapes.items()))}): "
                    "DTensor.from_local without shape= of uneven local tensors"
                )
            local = _torch.settled(_torch.local_of(value))
        else:
            local = value
        per_rank: dict[int | None, np.ndarray] = {}
        kept: list[np.ndarray] = []
        with _torch.no_dispatch():
            for r, t in _torch.rank_tensors(local).items():
                a = to_numpy(t.detach())
                for k in kept:  # replicas bitwise equal to one kept already share it
                    if k.shape == a.shape and k.dtype == a.dtype and np.array_equal(k, a):
                        a = k
                        break
                else:
                    kept.append(a)
                    self._spend(a.nbytes, key)
                per_rank[self.rank if r is None else int(r)] = a
        self.tensors.append(
            RawTensor(
                key=key,
                order=self._order,
                dtype=_torch.dtype_name(value.dtype),
                values=per_rank,
                layout=layout,
                events=(start, self.mark()),
                problem=problem,
            )
        )
        self._order += 1

    def _spend(self, n: int, key: RowKey) -> None:
        self.nbytes += n
        if self.nbytes > self.budget:
            name = key.module or "the root module"
            raise NumericsBudgetError(
                f"sv.diff keeps every captured tensor of every rank to compare them: "
                f"{self.nbytes / 2**20:.1f} MiB by {name} {key.phase} {key.what} passes its budget of "
                f"{self.budget / 2**20:.1f} MiB. Pass budget= a larger number of bytes, or modules=[...] "
                "to capture only some modules, or run a smaller model or batch."
            )

    def take_all(self, kind: str, items: Sequence[tuple[str, Any]], path: str, call: int, start: int) -> None:
        for slot, v in items:
            self.take(RowKey(path, call, kind, slot), v, start)

    def parameters(self, kind: str) -> None:
        """Every parameter (``"weight"``, ``"param"``) or its gradient (``"grad"``), as rows of the
        module that owns it."""
        start = self.mark()
        for name, p in self.root.named_parameters():
            path, _, leaf = module_path(name).rpartition(".")
            if not self.wanted(path):
                continue
            value = p.grad if kind == "grad" else p
            if value is not None:
                self.take(RowKey(path, 0, kind, leaf), value.detach(), start)

    # --- hooks ----------------------------------------------------------------------------------

    def _pre(self, mod: nn.Module, args: Any, kwargs: Any) -> None:
        path = self.paths.get(id(mod))
        if path is None:
            return
        call = self._calls.get(path, 0)
        self._calls[path] = call + 1
        start = self.mark()
        self._open.append((id(mod), path, call, start))
        if self.wanted(path):
            items = [(str(i), t) for i, t in enumerate(_tensors(args))]
            for k, v in (kwargs or {}).items():
                ts = _tensors(v)
                items += [(k, ts[0])] if len(ts) == 1 else [(f"{k}.{i}", t) for i, t in enumerate(ts)]
            self.take_all("input", items, path, call, start)

    def _post(self, mod: nn.Module, args: Any, kwargs: Any, out: Any) -> None:
        for i in range(len(self._open) - 1, -1, -1):
            if self._open[i][0] == id(mod):
                _, path, call, start = self._open.pop(i)
                break
        else:
            return
        if self.wanted(path):
            if isinstance(out, torch.Tensor):
                self.take(RowKey(path, call, "output", ""), out, start)
            else:
                self.take_all("output", [(str(i), t) for i, t in enumerate(_tensors(out))], path, call, start)

    def _back_pre(self, mod: nn.Module, grad_output: Any) -> None:
        path = self.paths.get(id(mod))
        if path is not None:
            self._back_open.setdefault(path, []).append(self.mark())

    def _back(self, mod: nn.Module, grad_input: Any, grad_output: Any) -> None:
        path = self.paths.get(id(mod))
        if path is None:
            return
        call = self._back_calls.get(path, 0)
        self._back_calls[path] = call + 1
        opened = self._back_open.get(path)
        start = opened.pop() if opened else self.mark()
        if self.wanted(path):
            items = [(str(i), g) for i, g in enumerate(grad_input) if isinstance(g, torch.Tensor)]
            self.take_all("grad_input", items, path, call, start)

    @contextlib.contextmanager
    def attached(self) -> Iterator[StepCapture]:
        """The hooks on every module while the body runs, registered last so that they see what a
        parallel style's hooks made of the inputs and outputs."""
        seen: set[int] = set()
        try:
            for mod in self.root.modules():
                if id(mod) in seen:
                    continue
                seen.add(id(mod))
                self._handles.append(mod.register_forward_pre_hook(self._pre, with_kwargs=True))
                self._handles.append(mod.register_forward_hook(self._post, with_kwargs=True))
                if self.backward:
                    self._handles.append(mod.register_full_backward_pre_hook(self._back_pre))
                    self._handles.append(mod.register_full_backward_hook(self._back))
            with warnings.catch_warnings():
                for text in _QUIET:
                    warnings.filterwarnings("ignore", message=text)
                yield self
        finally:
            for h in self._handles:
                h.remove()
            self._handles.clear()

    def result(self, meshes: Sequence[MeshSplit] = ()) -> RawCapture:
        """What was captured; ``meshes``: the meshes the step built (the ways they split the world,
        by which plain local tensors are laid out)."""
        return RawCapture(
            meshes=tuple(meshes),
            world_size=self.world_size,
            root=type(self.root).__name__,
            modules=tuple(self.modules),
            tensors=tuple(self.tensors),
            nbytes=self.nbytes,
            notes=tuple(self.notes),
        )


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for t in flatten(x) if isinstance(t, torch.Tensor)]


def mean_loss(output: Any) -> torch.Tensor:
    """The default loss: the mean of the (first floating-point) output, in float32 at least."""
    out = output if isinstance(output, torch.Tensor) else _floating(output)[0]
    return out.float().mean() if out.dtype in (torch.float16, torch.bfloat16) else out.mean()


def _floating(output: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(output) if t.dtype.is_floating_point or t.dtype.is_complex]


FORWARD_ONLY = (
    "forward only: the model's output holds no floating-point tensor ({what}), so there is no "
    "default loss (the mean of the output) to run a backward and an optimizer step from; pass "
    "loss= (a function of the output returning a scalar tensor) to compare a training step"
)


def _output_kind(output: Any) -> str:
    if output is None:
        return "it returned None"
    ts = _tensors(output)
    if not ts:
        return f"it returned a {type(output).__name__}"
    return "only " + ", ".join(sorted({str(t.dtype).removeprefix("torch.") for t in ts})) + " tensors"


def sgd(params: Any) -> torch.optim.Optimizer:
    """The default optimizer: plain SGD, lr 0.01 (Adam's first step, lr * sign(grad), turns
    rounding-level gradient differences near zero into full-size ones)."""
    return torch.optim.SGD(params, lr=1e-2)


def run_step(
    model: nn.Module,
    inputs: Any,
    *,
    parallelize: Callable[[nn.Module], Any] | None = None,
    loss: Callable[[Any], Any] | None = None,
    optimizer: Callable[[Any], Any] | bool | None = None,
    world_size: int = 1,
    device: str = "cpu",
    budget: int = DEFAULT_BUDGET,
    backward: bool = True,
    modules: Sequence[str] | None = None,
    seed: int | None = 0,
) -> RawCapture:
    """One training step of ``model`` (``parallelize(model)`` first, if given), captured: forward
    on ``inputs``, ``loss(output)``, backward, ``optimizer(params).step()``."""
    if seed is not None:
        torch.manual_seed(seed)
    meshes_before = _torch.live_mesh_ids()
    if device != "cpu":
        model = model.to(device)
        inputs = _to(inputs, device)
    if parallelize is not None:
        made = parallelize(model)
        if made is not None:
            if not isinstance(made, nn.Module):
                raise TypeError(
                    f"sv.diff: parallelize(model) returned a {type(made).__name__}; return the parallelized "
                    "module (or None when it changes the model in place)"
                )
            model = made
    # Each simulated rank gets its own copy of what stayed plain, as on real ranks: ranks whose
    # values part then show as replicas that disagree, instead of sharing one tensor.
    _torch.parameters_per_rank(model)
    cap = StepCapture(model, world_size=world_size, budget=budget, backward=backward, modules=modules)
    opt = None
    if optimizer is not False:
        make = sgd if optimizer is None or optimizer is True else optimizer
        opt = make(model.parameters())
    cap.parameters("weight")
    args, kwargs = _call_args(inputs)
    with cap.attached():
        out = model(*args, **kwargs)
        if loss is None and not _floating(out):
            cap.notes.append(FORWARD_ONLY.format(what=_output_kind(out)))
            return cap.result(_torch.meshes_since(meshes_before))
        start = cap.mark()
        value = (loss or mean_loss)(out)
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"sv.diff: loss(output) returned a {type(value).__name__}; it must return a tensor"
            )
        cap.take(RowKey("", 0, "loss", ""), value, start)
        value.backward()
    cap.parameters("grad")
    if opt is not None:
        opt.step()
        cap.parameters("param")
    return cap.result(_torch.meshes_since(meshes_before))


def _call_args(inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, tuple | list):
        return tuple(inputs), {}
    return (inputs,), {}


def to_float64(x: Any) -> Any:
    """Inputs with every floating-point tensor in float64 (token ids and masks as they are)."""
    if isinstance(x, torch.Tensor):
        return x.double() if x.dtype.is_floating_point else x
    if isinstance(x, tuple | list):
        return type(x)(to_float64(v) for v in x)
    if isinstance(x, Mapping):
        return {k: to_float64(v) for k, v in x.items()}
    return x


def _to(x: Any, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, tuple | list):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, Mapping):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def strip_root(name: str | None) -> str | None:
    """A trace's module name (the root's class name, then the path) as a path."""
    if name is None:
        return None
    _, _, rest = name.partition(".")
    return module_path(rest)
