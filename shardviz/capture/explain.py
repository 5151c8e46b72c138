"""Known traps of the simulation, recognised in a traceback and explained in plain words.

Torch raises bare ``AssertionError``s for several situations users meet in their first hour
(a mesh that does not cover the simulated world, an uneven 3-D scatter). The exception keeps
its type and traceback; its message gains what happened and what to do.
"""

from __future__ import annotations

import os
from types import TracebackType

from ..errors import ShardvizError, explain


def _frames(tb: TracebackType | None) -> list[tuple[str, str, dict[str, object]]]:
    out = []
    while tb is not None:
        code = tb.tb_frame.f_code
        out.append((code.co_filename.replace("\\", "/"), code.co_name, tb.tb_frame.f_locals))
        tb = tb.tb_next
    return out


NOTEBOOK = "notebooks/07_custom_operators.ipynb"
OWN_DIR = os.path.dirname(os.path.abspath(__file__)).replace("\\", "/") + "/"


def explain_sharding_error(error: BaseException, frames: list[tuple[str, str, dict[str, object]]]) -> bool:
    """DTensor could not shard an operator: say which, draw its inputs, and name the ways out."""
    msg = str(error.args[0]) if error.args else ""
    no_strategy = "does not have a sharding strategy" in msg
    if not (no_strategy or "Sharding propagation failed" in msg):
        return False
    from ..geometry.layout import compute
    from . import adapters
    from . import torch as _torch

    schema = None
    for _, _, f_locals in reversed(frames):
        info = f_locals.get("op_info")
        schema = f_locals.get("op_schema") or getattr(info, "schema", None)
        if schema is not None:
            break
    op, specs = _torch.op_schema_specs(schema) if schema is not None else ("this operator", [])
    for i, spec in enumerate(specs):
        shapes = _torch.spec_shape_per_rank(spec)
        if shapes is not None:
            explain(error, _per_rank_shape_text(op, i, shapes))
            return True
    drawn = []
    framework = None  # the adapter of a framework tensor among the inputs (PhysicsNeMo's ShardTensor)
    for i, spec in enumerate(specs):
        g = _torch.spec_geometry(spec)
        if g is None:
            continue
        adapter = adapters.for_spec(spec)
        sizes = adapter.spec_shard_sizes(spec) if adapter is not None else None
        try:
            lay = compute(**g, shard_sizes=sizes or None)
        except ValueError:
            lay, sizes = compute(**g), None
        table = (
            str(lay) if lay.world_size <= 16 else str(lay).split("\n", 1)[0] + f" ({lay.world_size} ranks)"
        )
        drawn.append(f"input {i}: " + table)
        if adapter is not None:
            framework = adapter
            chunked = compute(**g)
            if sizes and chunked.shards != lay.shards:
                drawn.append(
                    f"  ({adapter.NAME}'s own shard sizes; DTensor, which it hands the operator to, "
                    "would assume chunking: " + ", ".join(str(sh.shape) for sh in chunked.shards) + ")"
                )
    cause = error.__cause__
    if not no_strategy and cause is not None and type(cause).__name__ != "DynamicOutputShapeException":
        # The operator's own shape check failed on the global shapes: a mistake in the inputs,
        # not a sharding limitation.
        explain(
            error,
            f"shardviz: {op} rejected these inputs before any sharding was decided ({cause}). "
            "DTensor checks the operator on the global shapes; here they are:\n" + "\n".join(drawn),
        )
        return True
    if no_strategy and op.endswith("_scaled_dot_product_flash_attention_for_cpu"):
        explain(error, _sdpa_on_cpu(op, specs, drawn))
        return True
    if no_strategy:
        why = f"{op} has no sharding strategy in DTensor"
    elif cause is not None:
        why = f"the output shape of {op} depends on the values, so DTensor cannot work out its sharding"
    else:
        why = f"DTensor has no way to run {op} on inputs placed like this"
    if framework is not None:
        explain(
            error,
            f"shardviz: {why}.\n" + ("\n".join(drawn) + "\n" if drawn else "") + framework.ways_out(op),
        )
        return True
    explain(
        error,
        f"shardviz: {why}.\n" + ("\n".join(drawn) + "\n" if drawn else "") + "Ways out:\n"
        "  1. redistribute the input(s) to Replicate first, e.g. x.redistribute(mesh, [Replicate()]) "
        "(or x.full_tensor()), run the operator, and distribute the result again if needed;\n"
        "  2. write it as a custom sharded operator: x.to_local(), compute on each rank's shard, "
        "combine with a collective (dist.all_reduce, ...), then DTensor.from_local(result, mesh, "
        "[Replicate()] or [Partial()]);\n"
        "  3. register a sharding strategy for it "
        "(torch.distributed.tensor.experimental.register_sharding).\n"
        f"{NOTEBOOK} walks through all three.",
    )
    return True


def _per_rank_shape_text(op: str, i: int, shapes: dict[int, tuple[int, ...]]) -> str:
    """A DTensor whose global shape differs per rank: it came from ``from_local`` of uneven pieces."""
    from ..data.describe import rank_runs

    by_shape: dict[tuple[int, ...], list[int]] = {}
    for r, s in shapes.items():
        by_shape.setdefault(s, []).append(r)
    each = "; ".join(
        f"{tuple(s)} on rank{'s' if len(rs) > 1 else ''} {','.join(rank_runs(set(rs)))}"
        for s, rs in by_shape.items()
    )
    return (
        f"shardviz: input {i} of {op} has a different global shape on each rank ({each}). It was "
        "made by DTensor.from_local without shape=, which takes the global shape to be each rank's "
        "local shape times the mesh size: right only when the shards are even, and here the ranks' "
        "local tensors have different sizes (a size the mesh does not divide; parallel styles do "
        "this when they rebuild a DTensor from the plain local tensors the previous module handed "
        "on, use_local_output=True). Real ranks would each infer their own global shape the same "
        "way. Ways out: pass "
        "shape= and stride= to DTensor.from_local; between two parallel layers keep the DTensor "
        "(ColwiseParallel(use_local_output=False) then RowwiseParallel(input_layouts=Shard(-1))); or "
        "pick sizes the mesh divides evenly."
    )


def _sdpa_on_cpu(op: str, specs: list[object], drawn: list[str]) -> str:
    """SDPA's CPU kernel has no sharding strategy in DTensor, whatever the placements. What the
    user meant decides the way out: a sequence shard is context parallel; heads or batch sharded
    is tensor or data parallel, which DTensor shards on the GPU kernels only."""
    from . import torch as _torch

    dims: set[int] = set()
    ndim = 4
    for spec in specs[:3]:  # query, key, value
        g = _torch.spec_geometry(spec)
        if g is None:
            continue
        ndim = len(g["global_shape"])
        for p in getattr(spec, "placements", ()):
            try:
                plain = _torch.placement_to_plain(p)
            except TypeError:
                continue
            if plain.kind in ("shard", "strided") and plain.dim is not None:
                dims.add(plain.dim % ndim)
    kernels = (
        f"shardviz: {op} has no sharding strategy in DTensor: on CPU (the simulation, gloo) SDPA runs "
        "this kernel, and DTensor shards only SDPA's GPU kernels (flash, memory-efficient, cuDNN); "
        "real CPU ranks fail the same way."
    )
    if ndim - 2 in dims:
        return (
            f"{kernels} Its inputs are sharded along the sequence (context parallel): torch's context "
            "parallel shards attention through those GPU kernels only. Run context parallel on GPUs "
            "(sv.use('nccl', world_size=N)), or leave it out on CPU (torchtitan: "
            "context_parallel_degree=1).\n" + "\n".join(drawn[:1])
        )
    which = {0: "the batch (dim 0)", 1: "attention heads (dim 1)"}
    split = " and ".join(which.get(d, f"dim {d}") for d in sorted(dims)) or "nothing (replicated)"
    return (
        f"{kernels} Its inputs are sharded by {split}, not along the sequence: this is not context "
        "parallel. The heads (and the batch rows) are independent, so each rank can attend over its "
        "own: call F.scaled_dot_product_attention on q.to_local(), k.to_local(), v.to_local() and "
        "wrap the result with DTensor.from_local(out, mesh, placements) (what torch's and torchtitan's "
        "tensor-parallel plans do: ColwiseParallel(use_local_output=True) hands attention plain "
        "local tensors); or run on GPUs (sv.use('nccl', world_size=N)), where DTensor shards SDPA by "
        "heads and by batch.\n" + "\n".join(drawn[:1])
    )


def _framework_error(
    error: BaseException, frames: list[tuple[str, str, dict[str, object]]], lockstep: bool
) -> bool:
    """A framework's own trap (PhysicsNeMo's, under the lockstep simulator or on CPU), explained by
    its adapter."""
    from . import adapters

    for adapter in adapters.active():
        text = adapter.explain_error(error, [(f, fn) for f, fn, _ in frames], lockstep)
        if text:
            explain(error, text)
            return True
    return False


def explain_rank_error(error: BaseException) -> BaseException:
    """On one rank (a real one, or one thread per rank): the explanations that hold wherever the
    code runs (a sharding error, a framework's trap); ``error`` is returned either way."""
    try:
        frames = _frames(error.__traceback__)
        if isinstance(error, RuntimeError) and _fullgraph_under_mode(str(error)):
            explain(error, FULLGRAPH_UNDER_RECORDING)
            return error
        if isinstance(error, RuntimeError | NotImplementedError) and explain_sharding_error(error, frames):
            return error
        _framework_error(error, frames, lockstep=False)
    except Exception:  # explaining never replaces the error
        pass
    return error


def explain_simulation_error(error: BaseException, world_size: int) -> BaseException:
    """Add an explanation to ``error`` when it matches a known trap; return it either way.
    shardviz's own errors say what to do already, and Ctrl-C is no error. Explaining never
    replaces the error: a failure while explaining leaves it as it was raised."""
    if not isinstance(error, Exception):
        return error
    try:
        return _explain_simulation_error(error, world_size)
    except Exception:
        return error


def _explain_simulation_error(error: Exception, world_size: int) -> BaseException:
    if isinstance(error, ShardvizError):
        # shardviz's own errors say what to do already; raised inside a framework's code (a per-rank
        # int PhysicsNeMo needed), the framework's adapter adds the framework's way out.
        _framework_error(error, _frames(error.__traceback__), lockstep=True)
        return error
    frames = _frames(error.__traceback__)
    msg = str(error.args[0]) if error.args else ""
    files = [f for f, _, _ in frames]
    compiled = type(error).__module__.startswith(("torch._dynamo", "torch._inductor")) or any(
        f.endswith("/torch/_dynamo/convert_frame.py") or "/torch/_inductor/" in f for f in files
    )
    sharding = not compiled and isinstance(error, RuntimeError | NotImplementedError)
    if sharding and explain_sharding_error(error, frames):
        return error
    if _framework_error(error, frames, lockstep=True):
        return error

    if isinstance(error, AssertionError):
        for filename, func, f_locals in reversed(frames):
            if func == "get_coordinate" and "_local_tensor" in filename:
                mesh = f_locals.get("self")
                n = _mesh_size(mesh)
                size = f"{n} ranks" if n is not None else "fewer ranks"
                return explain(
                    error,
                    f"shardviz: this DeviceMesh covers {size}, but the simulation runs {world_size} ranks. "
                    "Under LocalTensorMode every simulated rank must be in the mesh. Build a mesh of "
                    f"{world_size} ranks, or change the world size: sv.use('local', world_size={n or 'N'}).",
                )
            if func == "_shard_tensor" and "placement_types" in filename:
                shapes = _shapes(f_locals.get("scatter_list"))
                if type(f_locals.get("self")).__name__ == "_StridedShard":
                    return explain(
                        error,
                        "shardviz: scattering a _StridedShard needs every rank's chunk to have the same "
                        "size, and here they differ" + (f" ({shapes})" if shapes else "") + "; torch "
                        "requires this on real ranks too. Pass src_data_rank=None to distribute_tensor "
                        "(each rank slices the global tensor itself), or use a size that divides evenly "
                        "by split_factor x mesh dim size.",
                    )
                return explain(
                    error,
                    "shardviz: this is a known LocalTensorMode bug (torch 2.13 to 2.15): when ranks "
                    "already hold shards of different shapes (uneven sharding on an earlier mesh dim), "
                    "aten.split pads "
                    "missing chunks with the wrong shape, so the simulated scatter fails"
                    + (f" (chunk shapes {shapes})" if shapes else "")
                    + ". Work around it: pass src_data_rank=None to distribute_tensor (every rank slices "
                    "the global tensor itself: the same shards, no scatter recorded), or pick a shape "
                    "that divides evenly over the mesh.",
                )
    if any("/torch/distributed/fsdp/" in f for f in files):
        explained = _explain_fsdp(error, msg, files)
        if explained is not None:
            return explained
    if compiled:
        return _explain_compile(error, msg, files)
    if isinstance(error, RuntimeError) and _fullgraph_under_mode(msg):
        return explain(error, FULLGRAPH_UNDER_RECORDING)
    if isinstance(error, AttributeError) and "'LocalIntNode' object has no attribute" in msg:
        # torch >= 2.14: dist.get_rank() (like a mesh coordinate) is a per-rank SymInt in the
        # simulation, and turning it into one Python int fails with this bare AttributeError.
        return explain(
            error,
            "shardviz: a per-rank value (dist.get_rank(), a mesh coordinate or local rank) was used "
            "where Python needs one plain int: a list index, int(), float(), range() or torch.tensor(). "
            "In the simulation every rank runs the same Python line at once, so it cannot take a "
            "different int on each. Tensor arithmetic with it works per rank "
            "(torch.ones(2) * dist.get_rank()); for anything else write "
            "sv.per_rank(lambda rank: x.chunk(n)[rank]), which calls your function with each rank; "
            "or run the code with one thread per rank, where each rank has plain ints: "
            "sv.use('threads', world_size=N).",
        )
    if isinstance(error, RuntimeError) and "Mesh should not be bigger than default world size" in msg:
        return explain(
            error,
            f"shardviz: the simulation runs {world_size} ranks; a mesh needs exactly that many. "
            "Call sv.use('local', world_size=<mesh size>) first.",
        )
    return error


def _explain_fsdp(error: BaseException, msg: str, files: list[str]) -> BaseException | None:
    """FSDP2 failures whose cause is known. FSDP2 itself runs in the simulation (FSDP, HSDP,
    FSDP + TP, mixed precision, a divide factor, CPU offload without pinned memory): any other
    error inside it is torch's own or the code's, and keeps its message as it is."""
    no_accelerator = "Cannot access accelerator device" in msg or "Found no NVIDIA driver" in msg
    if no_accelerator and any(f.endswith("/_fsdp_param.py") for f in files):
        return explain(
            error,
            "shardviz: FSDP2's CPU offload pins host memory (CPUOffloadPolicy(pin_memory=True), the "
            "default), which needs an accelerator; this machine has none, so torch raises this on "
            "real CPU ranks (gloo) as well, not only in the simulation. Pass "
            "CPUOffloadPolicy(pin_memory=False), or run on GPUs: sv.use('nccl', world_size=N).",
        )
    return None


_UNSUPPORTED = ("torch._dynamo.exc", "Unsupported")

FULLGRAPH_UNDER_RECORDING = (
    "shardviz: torch.compile(fullgraph=True) cannot compile while shardviz records: torch compiles "
    "no code under a Python dispatch mode other than its own (shardviz records through one, as "
    "torch's DebugMode does; the lockstep simulator's LocalTensorMode is another), and "
    "fullgraph=True turns what would be an uncompiled fallback into this error. Under torch's bare "
    "LocalTensorMode, or with one thread per rank, fullgraph=True fails the same way. While "
    "recording, compile without fullgraph=True (torch then runs uncompiled what it cannot compile, "
    "and it is recorded); "
    "compile with fullgraph=True where nothing records (outside sv.record / sv.run, or on real "
    "ranks without a recording)."
)


def _fullgraph_under_mode(msg: str) -> bool:
    """torch refused fullgraph=True because a dispatch mode (a recorder) was active."""
    return "fullgraph=True found no compiled frames" in msg and "dispatch mode present" in msg


def _explain_compile(error: BaseException, msg: str, files: list[str]) -> BaseException:
    """torch.compile failed: say which part of it, and whether the simulation is the cause."""
    backend = getattr(error, "backend_name", None)
    if backend == "inductor" or any("/torch/_inductor/" in f for f in files):
        return explain(
            error,
            "shardviz: inductor (torch.compile's default backend) cannot compile simulated "
            "tensors: it needs real tensor storage, which the simulated per-rank tensors do not "
            'have. In the simulation, compile with backend="eager" (every collective is recorded) '
            'or backend="aot_eager"; or compile with inductor on real ranks: '
            "sv.use('gloo', world_size=N).",
        )
    if "missing from inner_contexts" in msg:
        return explain(
            error,
            'shardviz: AOTAutograd (backend="aot_eager") could not take apart the simulated '
            "ranks' tensors inside these DTensors (on this torch it flattens LocalTensors too, and "
            "here it fails): a limit of torch's LocalTensor under torch.compile. Compile with "
            'backend="eager" in the simulation (every collective is recorded), use '
            "sv.use('threads', ...) (plain tensors on each rank), or compile on real ranks: "
            "sv.use('gloo', world_size=N).",
        )
    if _recursed_in_local_tensor(error):
        return explain(
            error,
            "shardviz: Dynamo recursed without end inside torch's LocalTensorMode while turning the "
            "compiled region's simulated tensors into fake ones (FSDP2's parameters of a compiled "
            "block, say): a limit of torch's LocalTensor under torch.compile, whatever the backend. "
            "In the simulation compile blocks that FSDP2 does not shard (tensor parallel alone "
            "compiles), or run this step uncompiled; compile it with FSDP2 on real ranks: "
            "sv.use('gloo', world_size=N).",
        )
    if any((c.__module__, c.__name__) == _UNSUPPORTED for c in type(error).__mro__):
        traced = msg.split("from user code:", 1)[1] if "from user code:" in msg else ""
        if OWN_DIR in traced:
            return explain(error, FULLGRAPH_UNDER_RECORDING)
        return explain(
            error,
            "shardviz: Dynamo (torch.compile's tracer) cannot turn this code into one graph (a graph "
            'break, an error with fullgraph=True); the lines under "from user code" show where. '
            "torch.compile refuses it the same way on real ranks: the simulation is not the cause. "
            "Rewrite that code so Dynamo can trace it, or compile without fullgraph=True.",
        )
    which = f'backend="{backend}"' if backend else "the compiled code"
    return explain(
        error,
        f"shardviz: this torch.compile failed under the simulation ({which}). If it compiles on real "
        'ranks, try backend="eager" in the simulation (DTensor runs its ops as they come), or '
        "compile on real ranks: sv.use('gloo', world_size=N).",
    )


def _recursed_in_local_tensor(error: BaseException) -> bool:
    cause: BaseException | None = error
    for _ in range(8):
        if cause is None:
            return False
        if isinstance(cause, RecursionError):
            return any("/_local_tensor/" in f for f, _, _ in _frames(cause.__traceback__))
        cause = cause.__cause__ or cause.__context__
    return False


def _shapes(chunks: object) -> str | None:
    if not isinstance(chunks, (list, tuple)):
        return None
    from . import torch as _torch

    def dim(d: object) -> str:
        values = _torch.per_rank_ints(d)
        return str(d) if values is None else "|".join(str(v) for v in sorted(set(values)))

    try:
        return ", ".join("(" + ", ".join(dim(d) for d in t.shape) + ")" for t in chunks)
    except Exception:
        return None


def _mesh_size(mesh: object) -> int | None:
    try:
        return int(mesh.size())  # type: ignore[attr-defined]  # no tensor op, unlike mesh.mesh
    except Exception:
        return None
