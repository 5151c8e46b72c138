"""One thread per rank (``sv.use("threads")``): a c10d world per thread, the process-wide state a
rank swaps in, and the process-group backend of a rank thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import registries

# torch.distributed keeps its state (the default group, group names and ranks) in one module-level
# ``_world``, and resolves a functional collective's group name in a process-wide registry. Torch's
# threaded test process group makes both per-thread; shardviz's rank threads use the same two
# switches (torch's ThreadLocalWorld follows ``_World``'s fields from release to release).


_guard_settled = False


def settle_cuda_guard() -> None:
    """Call from the thread that starts rank threads, before it starts them.

    A CUDA build of torch on a machine without a GPU (PyPI's Linux wheels) swaps CUDA's device
    guard for a no-op one the first time a FakeTensorMode is entered (DTensor's sharding
    propagation enters one), and that guard lives in the calling thread's storage: entered first
    in a rank thread, it dies with the thread, and the next DTensor op anywhere crashes the process
    (a segmentation fault, seen on torch 2.11 after a pipeline on rank threads). Swapped here by
    the main thread, which lives as long as the process, it stays valid."""
    global _guard_settled
    if _guard_settled or threading.current_thread() is not threading.main_thread():
        return
    _guard_settled = True
    if torch.backends.cuda.is_built() and not torch.cuda.is_available():
        torch._C._ensureCUDADeviceGuardSet()


@contextlib.contextmanager
def thread_local_c10d() -> Iterator[None]:
    """While it lasts, each thread has its own torch.distributed state: a rank thread's default
    process group, its meshes' groups and their names are its own, kept from one entry to the
    next (they live in the thread); and DTensor's redistribute plans are cached per rank. The
    notebook's own state is put back after."""
    from torch.distributed.tensor import _redistribute
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    c10d = dist.distributed_c10d
    isolate = torch._C._distributed_c10d._set_thread_isolation_mode  # type: ignore[attr-defined]
    saved = c10d._world
    patched = [
        (name, getattr(_redistribute, name), per_rank(getattr(_redistribute, name)))
        for name, per_rank in (
            ("_gen_transform_infos", _plans_per_rank),
            ("get_redistribute_planner", _planners_per_rank),
        )
        if hasattr(_redistribute, name)
    ]
    c10d._world = ThreadLocalWorld()  # type: ignore[assignment]
    for name, _, mine in patched:
        setattr(_redistribute, name, mine)
    isolate(True)
    try:
        yield
    finally:
        isolate(False)
        c10d._world = saved
        for name, original, _ in patched:
            setattr(_redistribute, name, original)


# DTensor caches its redistribute plans, and the planners that make them, by what holds for
# every caller in one process: the two specs; the mesh and the tensor's metadata. A plan holds the
# shapes the calling rank's mesh coordinate gives (an uneven piece's padding), and a planner the
# mesh of the rank that made it (whose coordinate it reads; meshes of the same ranks compare
# equal). Shared by the rank threads, rank 0 of a [S(0), S(0)] tensor of one row went on with
# rank 4's coordinate and gathered its piece unpadded, where real ranks pad it. Keyed by the
# calling rank too, they are each rank's own, as in a process of its own.


def _planners_per_rank(original: Callable[..., Any]) -> Callable[..., Any]:
    import weakref

    from torch.distributed.tensor import _redistribute

    cache: dict[tuple[Any, ...], Any] = {}

    def planner(device_mesh: Any, dtensor_meta: Any) -> Any:
        if _redistribute._are_we_tracing():
            return original(device_mesh, dtensor_meta)
        key = (dist.get_rank(), weakref.ref(device_mesh), dtensor_meta)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = _redistribute.DTensorRedistributePlanner(device_mesh, dtensor_meta)
        return hit

    return planner


def _plans_per_rank(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch.distributed.tensor import _redistribute

    compute = _redistribute._gen_transform_infos_non_cached
    cache: dict[tuple[Any, ...], Any] = {}

    def plans(src: Any, dst: Any, use_graph_based_transform: bool | None = None) -> Any:
        key = (dist.get_rank(), src, dst, use_graph_based_transform)
        hit = cache.get(key)
        if hit is None:
            hit = cache[key] = compute(src, dst, use_graph_based_transform)
        return hit

    plans.cache_clear = cache.clear  # type: ignore[attr-defined]  # as functools.cache has
    return plans


def thread_world() -> Any:
    """This rank thread's torch.distributed world (its default group, its groups and their
    names), for a thread it starts (``enter_thread_world``); None outside the rank threads."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    if not isinstance(dist.distributed_c10d._world, ThreadLocalWorld):
        return None
    world = dist.distributed_c10d._world._get_world()
    return world, dict(world.pg_names)


def enter_thread_world(captured: Any) -> None:
    """In a thread a rank thread started: the same world as the rank's, and its groups
    resolvable by name (the registry of names is per thread while the rank threads run)."""
    from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld

    if captured is None:
        return
    world, names = captured
    ThreadLocalWorld._world.world = world
    for pg, name in names.items():
        torch._C._distributed_c10d._register_process_group(name, pg)


def callback_work(wait: Callable[..., bool]) -> Any:
    """A c10d Work, boxed as c10d ops return it, whose ``wait()`` calls ``wait(timeout)``: a
    receive that blocks only when its result is asked for (``irecv``, ``batch_isend_irecv``)."""
    from torch._C._distributed_c10d import PythonCallbackWork

    return dist.distributed_c10d.Work.boxed(PythonCallbackWork(wait))


def process_state() -> tuple[Any, ...]:
    """What of torch's process-wide state a rank changes for itself: the CPU generator, the
    default dtype, DTensor's custom op handlers (``loss_parallel()`` adds its own while its
    block lasts), and the registries of ``registries`` (global module hooks, frameworks'
    singletons, the environment). Each rank thread has its own, swapped in when it runs, as if it
    were a process."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    return (torch.get_rng_state(), torch.get_default_dtype(), handlers, dict(handlers), registries.save())


def rank_process_state(start: tuple[Any, ...]) -> tuple[Any, ...]:
    """A rank's own copy of the notebook's ``process_state``: every rank starts from the same
    state, as processes started from one script would."""
    rng, dtype, handlers, contents, held = start
    return (rng.clone(), dtype, handlers, dict(contents), held.for_a_rank())


def restore_process_state(state: tuple[Any, ...]) -> None:
    rng, dtype, handlers, contents, held = state
    torch.set_rng_state(rng)
    if torch.get_default_dtype() != dtype:
        torch.set_default_dtype(dtype)
    dispatcher = DTensor._op_dispatcher
    if dispatcher._custom_op_handlers is not handlers:
        dispatcher._custom_op_handlers = handlers
    if handlers != contents:
        handlers.clear()
        handlers.update(contents)
    registries.restore(held)


RANK_BACKEND = "shardviz"


def rank_backend() -> str:
    """The process-group backend of a rank thread: torch's fake process group, whose every
    collective reaches the dispatcher (where shardviz carries it out), under a name of its own.
    Torch code that skips communicating on a group named "fake" (pipelining's shape inference
    and p2p set-up from torch 2.15, DeviceMesh's device set-up) then does what it would on the
    real backend the rank stands for."""
    if RANK_BACKEND.upper() not in dist.Backend._plugins:
        from torch._C._distributed_c10d import FakeProcessGroup

        def create(common: Any, options: Any) -> Any:
            # as torch's own "fake" backend creates it (the stubs lack the options argument)
            return FakeProcessGroup._create_internal(common.group_rank, common.group_size, options)  # type: ignore[call-arg]

        dist.Backend.register_backend(RANK_BACKEND, create, extended_api=True, devices=["cpu"])
    return RANK_BACKEND
