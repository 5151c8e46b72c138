"""Process groups and collectives: group names and ranks, reduce ops (PREMUL_SUM's factor
included), waiting for a real collective, finished Work objects, the Flight Recorder's dump."""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .gate import LocalTensor, _private


def _process_group(group: Any) -> Any:
    if isinstance(group, str):
        return _private["resolve_process_group"](group)
    if isinstance(group, torch.ScriptObject):
        return dist.ProcessGroup.unbox(group)
    return group


def process_group_key(group: Any) -> str:
    """A stable name for a process group (c10d ops get short-lived boxed objects, not the group)."""
    if isinstance(group, str):
        return group
    return str(_process_group(group).group_name)


def process_group_ranks(group: Any) -> list[int]:
    """Global ranks of a process group given as a ProcessGroup, a boxed one, or a group name."""
    return list(dist.get_process_group_ranks(_process_group(group)))


def process_group_desc(group: Any) -> str:
    return str(getattr(_process_group(group), "group_desc", "") or "")


def is_default_group(group: Any) -> bool:
    """Whether ``group`` is the default process group (which a 1-D mesh of the whole world reuses)."""
    try:
        world = dist.group.WORLD
        return world is not None and process_group_key(group) == process_group_key(world)
    except (RuntimeError, ValueError, AttributeError):
        return False


def reduce_op_name(op: Any) -> str:
    """Name of a c10d ReduceOp given boxed (as c10d ops receive it) or plain, e.g. ``"SUM"``."""
    # A boxed ReduceOp's ``op()`` is a TorchScript method, bound at run time: not in the stubs.
    kind = op.op() if isinstance(op, torch.ScriptObject) else getattr(op, "op", op)  # type: ignore[attr-defined]
    if isinstance(kind, int) and not isinstance(kind, dist.ReduceOp.RedOpType):
        kind = dist.ReduceOp.RedOpType(kind)
    return str(getattr(kind, "name", kind)).split(".")[-1]


# The factor of each ReduceOp.PREMUL_SUM collective being called (innermost last). torch 2.13
# cannot read it back from the boxed ReduceOp a c10d op receives (it has no ``ReduceOp.unbox``), so
# ``premul_sum_factors`` keeps it from the Python call while the simulation runs, per thread (in
# the one-thread-per-rank simulator each rank's thread calls, and may wait inside, its own).
_premul_local = threading.local()


def _premul_factors() -> list[Any]:
    stack: list[Any] | None = getattr(_premul_local, "stack", None)
    if stack is None:
        stack = _premul_local.stack = []
    return stack


# dist functions that take a ReduceOp: the position of their ``op`` argument.
_REDUCE_OP_ARG = {"all_reduce": 1, "reduce_scatter_tensor": 2, "reduce_scatter_single": 2}


def _called_factor() -> Any:
    """The factor of the PREMUL_SUM collective this thread is calling (see ``_premul_factors``)."""
    factors = _premul_factors()
    if not factors:
        raise NotImplementedError(
            "a PREMUL_SUM collective reached the simulation through a call shardviz does not "
            f"follow ({', '.join('dist.' + n for n in _REDUCE_OP_ARG)} are followed): on this "
            f"torch ({torch.__version__}) its factor cannot be read back. Use ReduceOp.SUM and "
            "scale the result, or run on real process groups: sv.use('gloo', world_size=N)."
        )
    return factors[-1]


def premul_factor(op: Any) -> Any:
    """The factor of a ReduceOp.PREMUL_SUM, boxed (as c10d ops receive it) or plain: a float, or
    a one-element tensor's value."""
    if isinstance(op, torch.ScriptObject):
        unbox = getattr(dist.ReduceOp, "unbox", None)
        if unbox is None:
            return _plain_factor(_called_factor())
        op = unbox(op)
    return _plain_factor(_factor_of(op))


def _plain_factor(factor: Any) -> Any:
    if isinstance(factor, torch.Tensor) and factor.numel() == 1:
        return factor.item()
    return factor


_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor


def wait_collective(out: Any, functional: bool) -> None:
    """Block until a real collective's result is there, so that it can be snapshotted.

    c10d ops hand back a ``Work``; functional collectives return tensors that are only valid after
    ``wait_tensor``. The simulator's collectives finish immediately; real ones (gloo, NCCL) do not.
    """
    stack = [out]
    while stack:
        x = stack.pop()
        if isinstance(x, list | tuple):
            stack.extend(x)
        elif isinstance(x, dist.Work):
            x.wait()
        elif isinstance(x, torch.ScriptObject) and "Work" in str(x._type()):
            dist.Work.unbox(x).wait()  # c10d ops hand back the Work boxed for the dispatcher
        elif functional and isinstance(x, torch.Tensor):
            _WAIT_TENSOR(x)


def settled(t: Any) -> Any:
    """A functional collective's result as a tensor: an ``AsyncCollectiveTensor``'s value (what
    ``to_local()`` of a redistributed DTensor can hand a module); anything else as it is.

    In the simulator the collective has run already and its per-rank value is read as it is; on a
    real rank it is waited for first (a recording waits for every collective anyway).
    """
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    if isinstance(t, AsyncCollectiveTensor):
        if isinstance(t.elem, LocalTensor):
            return t.elem
        return t.trigger_wait()
    return t


# The operator namespaces of communication: c10d's ops, the functional collectives, DTensor's own.
COMMUNICATION_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor", "symm_mem")


def is_communication_op(func: Any) -> bool:
    """Whether a dispatched operator communicates (a collective, a send, a wait on one)."""
    return getattr(func, "namespace", None) in COMMUNICATION_NAMESPACES


def fake_work(result: list[torch.Tensor] | None = None) -> Any:
    """A finished c10d Work, boxed as c10d ops return it (for collectives shardviz emulates).
    With ``result``, its ``get_future()`` holds those tensors, as a real process group's future
    holds the op's outputs (DDP's reducer reads its bucket back from it); without, it holds None."""
    if result is None:
        from torch._C._distributed_c10d import FakeWork

        return dist.distributed_c10d.Work.boxed(FakeWork())
    from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]

    future: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    future.set_result(result)
    return dist.distributed_c10d.Work.boxed(_create_work_from_future(future))


# torch 2.11 and 2.12: a PREMUL_SUM ReduceOp does not expose its factor (``op.factor``, 2.13 on).
# The ones made by ``dist._make_nccl_premul_sum`` while the simulation runs are remembered here
# with their factor (the op itself kept, so that its id is not reused; the last few only).
_made_premul: dict[int, tuple[Any, Any]] = {}


def _remembering_premul(original: Any) -> Any:
    @functools.wraps(original)
    def make(factor: Any) -> Any:
        op = original(factor)
        _made_premul[id(op)] = (op, factor)
        while len(_made_premul) > 64:
            del _made_premul[next(iter(_made_premul))]
        return op

    return make


def _factor_of(op: Any) -> Any:
    if hasattr(op, "factor"):
        return op.factor
    made = _made_premul.get(id(op))
    if made is not None and made[0] is op:
        return made[1]
    raise NotImplementedError(
        f"a ReduceOp.PREMUL_SUM not made by dist._make_nccl_premul_sum reached the simulation: on "
        f"this torch ({torch.__version__}; torch 2.13 has ReduceOp.factor) its factor cannot be "
        "read. Use ReduceOp.SUM and scale the result, or run on real process groups: "
        "sv.use('gloo', world_size=N)."
    )


def _following_premul(name: str, original: Any) -> Any:
    position = _REDUCE_OP_ARG[name]

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        op: Any = kwargs.get("op", args[position] if len(args) > position else None)
        if getattr(op, "op", None) != dist.ReduceOp.PREMUL_SUM:  # a RedOpType has no .op
            return original(*args, **kwargs)
        factors = _premul_factors()
        factors.append(_factor_of(op))
        try:
            return original(*args, **kwargs)
        finally:
            factors.pop()

    return call


@contextlib.contextmanager
def premul_sum_factors() -> Iterator[None]:
    """While the simulation runs, remember the factor of each PREMUL_SUM collective called through
    ``dist`` (FSDP2 with a gradient divide factor: ``reduce_scatter_single``) for the emulation
    that reads it (see ``_premul_factors``), and give LocalTensorMode's own reduction the PREMUL_SUM
    it lacks on torch 2.13 (the simulation runs without a recorder too: ``make bench``'s baseline)."""
    if hasattr(dist.ReduceOp, "unbox"):
        yield
        return
    saved = {name: getattr(dist, name) for name in _REDUCE_OP_ARG if hasattr(dist, name)}
    for name, original in saved.items():
        setattr(dist, name, _following_premul(name, original))
    make_premul = dist._make_nccl_premul_sum
    if not hasattr(make_premul(1.0), "factor"):
        dist._make_nccl_premul_sum = _remembering_premul(make_premul)
    c10d_module = importlib.import_module("torch.distributed._local_tensor._c10d")
    local_reduce = getattr(c10d_module, "_local_reduce")  # noqa: B009 (private: not in the stubs)

    @functools.wraps(local_reduce)
    def reduce_with_premul(reduce_op: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
        if reduce_op != dist.ReduceOp.PREMUL_SUM and reduce_op != "premul_sum":
            return local_reduce(reduce_op, tensors)
        factor = _plain_factor(_called_factor())
        out = tensors[0] * factor  # each rank's tensor scaled, summed in rank order (as recorded)
        for t in tensors[1:]:
            out = out + t * factor
        return out

    setattr(c10d_module, "_local_reduce", reduce_with_premul)  # noqa: B010
    try:
        yield
    finally:
        setattr(c10d_module, "_local_reduce", local_reduce)  # noqa: B010
        dist._make_nccl_premul_sum = make_premul
        for name, original in saved.items():
            setattr(dist, name, original)


def flight_recorder_dump(pickled: bool = False) -> bytes:
    """This process's PyTorch Flight Recorder buffer: JSON (no stacks), or torch's pickle (with
    stacks; only for a reader that opts in). Empty of entries unless ``TORCH_FR_BUFFER_SIZE`` (or
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``) was set before the process group was made. torch 2.13 and
    2.15 name it ``_dump_fr_trace_json`` (every backend, gloo included); NCCL-only builds of older
    torch ``_dump_nccl_trace_json``."""
    import torch._C._distributed_c10d as c10d

    names = (
        ("_dump_fr_trace", "_dump_nccl_trace")
        if pickled
        else ("_dump_fr_trace_json", "_dump_nccl_trace_json")
    )
    for name in names:
        fn = getattr(c10d, name, None)
        if fn is not None:
            out = fn()
            return out if isinstance(out, bytes) else str(out).encode()
    raise RuntimeError(f"this torch ({torch.__version__}) has no Flight Recorder dump function")


def p2p_groups(group: Any) -> list[tuple[int, ...]]:
    """Every group that runs a c10d op at once with ``group`` (rank 0's group in the fake process
    group): their global ranks, each indexed by group rank. torch 2.13 returns a 3-tuple, 2.15 a pair."""
    from torch.distributed._local_tensor import _c10d as lt_c10d

    found = lt_c10d._prepare_collective_groups(group)
    ranks, offsets = found[0], found[1]
    return [tuple(int(o) + int(r) for r in ranks) for o in offsets]


# --- the lockstep simulator's fake process groups, outside the simulation ----------------------

# LocalTensorMode carries out every collective inside the simulation itself; one that reaches the
# fake process group ran outside it, where the fake group would leave its tensors as they are: the
# value of a world of one, which no real world of N ranks gives. With ``error_on_collective`` the
# group raises instead (torch's own message, which names neither the simulation nor the way out).
OUTSIDE_SIMULATION_ERROR = "FakeProcessGroup collective operation error"


def _fake_options() -> Any:
    """Options for a fake process group whose collectives raise; None on a torch without them."""
    from torch._C._distributed_c10d import FakeProcessGroup

    options_type = getattr(FakeProcessGroup, "Options", None)
    if options_type is None or not hasattr(options_type(), "error_on_collective"):
        return None
    options = options_type()
    options.error_on_collective = True
    return options


class _Guard:
    """The fake backend's creator made to refuse collectives, and c10d's error log made to explain
    that refusal, while the lockstep simulator owns the default process group."""

    def __init__(self, note: str) -> None:
        self.note = note
        self.plugin: Any = None
        self.logger: Any = None

    def creator(self, common: Any, options: Any) -> Any:
        # a mesh's sub-groups (new_group) are made with no options, and would do nothing
        guarded = _fake_options()
        if guarded is not None:
            if options is not None:
                for name in ("group_name", "global_ranks_in_group", "_timeout"):
                    with contextlib.suppress(AttributeError, TypeError):
                        setattr(guarded, name, getattr(options, name))
            options = guarded
        return self.plugin.creator_fn(common, options)

    def filter(self, record: Any) -> bool:
        """c10d logs every ``dist.*`` call that raised from inside its ``except`` block: the error is
        the one being handled, and this adds the explanation to it."""
        import sys

        error = sys.exc_info()[1]
        if (
            error is not None
            and OUTSIDE_SIMULATION_ERROR in str(error)
            and self.note not in getattr(error, "__notes__", ())
        ):
            error.add_note(self.note)
        return True


_guard: _Guard | None = None


def simulation_world_options() -> Any:
    """``pg_options`` for the simulator's default process group: its collectives raise when they
    run outside the simulation (None on a torch whose fake group cannot)."""
    return _fake_options()


def guard_fake_groups(note: str) -> None:
    """From now until ``unguard_fake_groups``: every fake process group made (a mesh's sub-groups)
    refuses collectives, and the error of one refused through ``torch.distributed`` carries ``note``."""
    global _guard
    if _guard is not None:
        _guard.note = note
        return
    if _fake_options() is None:
        return
    importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers "fake"
    plugin = dist.Backend._plugins.get("FAKE")
    if plugin is None:
        return
    guard = _Guard(note)
    guard.plugin = plugin
    dist.Backend._plugins["FAKE"] = plugin._replace(creator_fn=guard.creator)
    from torch.distributed import c10d_logger

    guard.logger = getattr(c10d_logger, "_c10d_logger", None)
    if guard.logger is not None:
        guard.logger.addFilter(guard.filter)
    _guard = guard


def unguard_fake_groups() -> None:
    global _guard
    guard, _guard = _guard, None
    if guard is None:
        return
    current = dist.Backend._plugins.get("FAKE")
    if current is not None and current.creator_fn == guard.creator:
        dist.Backend._plugins["FAKE"] = guard.plugin
    if guard.logger is not None:
        guard.logger.removeFilter(guard.filter)
