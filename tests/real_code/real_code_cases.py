"""Hugging Face code as its users write it, shared by the simulated tests (tests/real_code) and the
torchrun job that runs the same functions on gloo (tests/cluster/test_real_code_gloo.py).

Nothing here is shardviz's: tiny Llama, Qwen2 and Mistral configs saved as checkpoints,
``from_pretrained(..., distributed_config=DistributedConfig(...))``, a forward with labels, a
backward and an SGD step; accelerate's ``Accelerator(cpu=True)`` with ``prepare``; torch's DDP.
Each returns what a test compares with the unsharded model in one process: the loss, every
parameter's gradient and value after the step, as full tensors, on every rank.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

VOCAB, HIDDEN, HEADS, LAYERS = 64, 32, 4, 2
BATCH, SEQ = 4, 8  # BATCH rows: split over the data-parallel ranks
LR = 0.1
MODELS = ("llama", "qwen2", "mistral")
# (fsdp_size, tp_size) of DistributedConfig on 4 ranks
LAYOUTS = {"tp": (1, 4), "fsdp_tp": (2, 2)}


def config(name: str) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}[name]
    return cls(**common)


def save_checkpoint(name: str, folder: Path) -> Path:
    """A randomly initialised model (seed 0) saved as a checkpoint: what from_pretrained loads."""
    from transformers import AutoModelForCausalLM

    path = folder / name
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config(name))
        model.save_pretrained(path)
    return path


def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def full(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().clone()


def reference(path: Path, layout: str) -> dict[str, Any]:
    """The unsharded model in one process: the mean of the data-parallel replicas' losses (each the
    mean over its rows' tokens), its gradients, and the parameters after one SGD step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    fsdp, _ = LAYOUTS[layout]
    ids = tokens()
    losses = [model(rows, labels=rows).loss for rows in ids.chunk(fsdp)]
    loss = torch.stack(losses).mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": [x.detach() for x in losses], "grads": grads, "params": params}


def transformers_step(path: Path, layout: str) -> dict[str, Any]:
    """One rank's training step of a transformers model sharded by its own distributed loading."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    fsdp, tp = LAYOUTS[layout]
    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(fsdp_size=fsdp, tp_size=tp)
    )
    dp_rank = dist.get_rank() // tp  # the mesh is (pp, dp_replicate, fsdp, tp) = (1, 1, fsdp, tp)
    rows = tokens().chunk(fsdp)[dp_rank]
    out = model(rows, labels=rows)
    out.loss.backward()
    grads = {n: full(p.grad) for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    params = {n: full(p) for n, p in model.named_parameters()}
    return {"loss": full(out.loss), "dp_rank": dp_rank, "grads": grads, "params": params}


# --- accelerate and DDP: a small model, DDP-style ---------------------------------------------------


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def small_batches(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return torch.randn(world, 5, 6, generator=g), torch.randn(world, 5, 3, generator=g)


def small_reference(world: int, steps: int = 2) -> dict[str, Any]:
    """DDP-style data parallel on ``world`` ranks equals the full batch on one model, the loss a
    mean over ranks (gradients averaged)."""
    model = small_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = small_batches(world)
    losses = []
    for _ in range(steps):
        loss = torch.stack([((model(x) - y) ** 2).mean() for x, y in zip(xs, ys, strict=True)]).mean()
        losses.append(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def accelerate_step(steps: int = 2) -> dict[str, Any]:
    """accelerate's own training loop on one rank: Accelerator(cpu=True), prepare, backward, step."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, opt = small_model(), None
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    xs, ys = small_batches(acc.num_processes)
    x, y = xs[acc.process_index], ys[acc.process_index]
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        acc.backward(loss)
        opt.step()
    plain = acc.unwrap_model(model)
    return {
        "process_index": acc.process_index,
        "num_processes": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "is_main_process": acc.is_main_process,
        "env_rank": os.environ.get("RANK"),
        "params": {n: p.detach().clone() for n, p in plain.named_parameters()},
    }


def ddp_step(steps: int = 2) -> dict[str, Any]:
    """torch's DistributedDataParallel on one rank: forward, backward, step."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(small_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xs, ys = small_batches(dist.get_world_size())
    x, y = xs[dist.get_rank()], ys[dist.get_rank()]
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"params": {n: p.detach().clone() for n, p in model.module.named_parameters()}}


# --- torch's own debug tools on a TP MLP --------------------------------------------------------


def debug_tools() -> dict[str, Any]:
    """What torch's debug tools say about a TP MLP on a (dp=2, tp=2) mesh, on one rank:
    ``visualize_sharding``'s printout (a DTensor on the whole mesh, and one on the tp sub-mesh),
    ``CommDebugMode``'s counts and module table, and ``DebugMode``'s module lines, DTensor ops and
    collectives (its per-rank kernels below each DTensor op are the backend's own business)."""
    import contextlib
    import io

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode, visualize_sharding
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils._debug_mode import DebugMode

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    printed = {}
    for name, dt in (
        ("whole", distribute_tensor(torch.arange(48.0).reshape(6, 8), mesh, [Shard(0), Shard(1)])),
        ("tp", distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh["tp"], [Shard(0)])),
        ("replicated", distribute_tensor(torch.ones(4, 4), mesh, [Replicate(), Replicate()])),
    ):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            visualize_sharding(dt)
        printed[name] = out.getvalue()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    with CommDebugMode() as comm:
        model(x).sum().backward()
    with DebugMode(record_nn_module=True) as debug:
        model(x).sum().backward()
    # A functional collective's last argument is its group's name, numbered per process in the
    # order groups were made (whatever ran before in that process): not the collective's business.
    lines = [
        re.sub(r", [^,()]+\)(\s+->)", r", <group>)\1", line) if "c10d_functional::" in line else line
        for line in debug.debug_string().splitlines()
        if "[nn.Mod]" in line or "c10d" in line or "(dt:" in line
    ]
    return {
        "visualize": printed,
        "comm_total": comm.get_total_counts(),
        "comm_counts": {str(op): n for op, n in comm.get_comm_counts().items()},
        "comm_table": comm.generate_comm_debug_tracing_table(noise_level=0),
        "comm_table_dtensor": comm.generate_comm_debug_tracing_table(noise_level=1),
        "comm_table_all_ops": comm.generate_comm_debug_tracing_table(noise_level=3),
        "debug_lines": lines,
    }
