"""The GPU check: shardviz's real backends on CUDA tensors, the simulator beside them, and a
recorded tensor-parallel step drawn, each part checked against plain torch on the global tensors.

Run by ``tests/gpu/run.sh`` (which installs what the machine lacks from carried wheels). Every part
runs on its own and records pass/fail with its error, so one failure does not hide the rest. On a
machine without a GPU the CPU parts run and the CUDA parts are listed as skipped, with the reason.
Writes one results file, ``gpu_results.json`` (and the layout picture it names), to ``$OUT`` when
set, else to ``test-artifacts/gpu/``.

NCCL takes one rank per GPU: on one GPU the nccl cells run with world_size 1. Several ranks share
the one GPU on gloo with CUDA tensors (each rank picks ``cuda:0`` before its mesh is built).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import shardviz as sv

HAS_CUDA = torch.cuda.is_available()
OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[2] / "test-artifacts" / "gpu")
results: dict[str, Any] = {
    "torch": torch.__version__,
    "python": platform.python_version(),
    "shardviz": sv.__version__,
    "cuda_available": HAS_CUDA,
    "gpu": torch.cuda.get_device_name(0) if HAS_CUDA else None,
    "gpu_count": torch.cuda.device_count() if HAS_CUDA else 0,
    "nccl_available": torch.distributed.is_nccl_available(),
    "checks": [],
    "skipped": [],
}


def part(name: str, cuda: bool = False) -> Callable[[Callable[[], Any]], None]:
    """Run ``fn`` now as one part of the check and record its outcome (a CUDA part skips, with
    the reason, where there is no GPU)."""

    def run(fn: Callable[[], Any]) -> None:
        if cuda and not HAS_CUDA:
            why = "no CUDA GPU: torch.cuda.is_available() is False"
            results["skipped"].append({"name": name, "why": why})
            print(f"SKIP {name}: no CUDA GPU", flush=True)
            return
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"name": name}
        try:
            detail = fn()
            entry.update(ok=True, detail=detail)
        except BaseException as e:  # one part's failure is a result; the rest still run
            if isinstance(e, KeyboardInterrupt):
                raise
            entry.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        finally:
            with_backend_reset()
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        results["checks"].append(entry)
        print(f"{'PASS' if entry['ok'] else 'FAIL'} {name} ({entry['seconds']} s)", flush=True)
        if not entry["ok"]:
            print(entry["traceback"], flush=True)

    return run


def with_backend_reset() -> None:
    try:
        sv.use("local")
    except Exception as e:
        print(f"sv.use('local') after a part: {type(e).__name__}: {e}", flush=True)


# --- the cells: the same code on every backend ----------------------------------------------------


def cells(device: str) -> tuple[Any, ...]:
    """A mesh over every rank, a tensor sharded, gathered and reduced, and a raw all_reduce."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    if device == "cuda":
        torch.zeros(1, device="cuda")  # cuda:0 for every rank before the mesh picks LOCAL_RANK's
    n = dist.get_world_size()
    mesh = init_device_mesh(device, (n,))
    x = torch.arange(4.0 * n * 3, device=device).reshape(4 * n, 3)
    dt = distribute_tensor(x, mesh, [Shard(0)])
    gathered = dt.redistribute(mesh, [Replicate()]).to_local()
    total = (dt * 2).sum().full_tensor()
    t = torch.ones(2, device=device) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    return gathered.cpu(), total.cpu(), t.cpu(), str(gathered.device.type)


def expected_cells(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.arange(4.0 * n * 3).reshape(4 * n, 3)
    return x, (x * 2).sum(), torch.full((2,), n * (n + 1) / 2)


def check_cells(trace: Any, n: int, device: str) -> dict[str, Any]:
    gathered, total, reduced = expected_cells(n)
    assert sorted(trace.results) == list(range(n)), trace.results.keys()
    for r in range(n):
        g, s, t, dev = trace.results[r]
        assert dev == device, f"rank {r}: the tensors were on {dev}, not {device}"
        assert torch.equal(g, gathered), f"rank {r}: gathered {g} != {gathered}"
        assert torch.allclose(s, total), f"rank {r}: sum {s} != {total}"
        assert torch.equal(t, reduced), f"rank {r}: all_reduce {t} != {reduced}"
    ops = [c.op for c in trace.collectives()]
    assert "all_reduce" in ops, ops
    return {"world_size": n, "device": device, "collectives": ops}


def run_cells(backend: str, n: int, device: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    sv.use(backend, world_size=n, **({} if backend in ("local", "threads") else {"timeout": 60}))
    started = time.perf_counter() - t0
    trace = sv.run(cells, device)
    return {**check_cells(trace, n, device), "start_s": round(started, 2)}


# --- a tensor-parallel MLP step -------------------------------------------------------------------


def tp_mlp_step(device: str) -> tuple[Any, ...]:
    """One forward, backward and SGD step of a Colwise/Rowwise MLP; returns the loss, the first
    layer's weight after the step (gathered) and the DTensor itself (for its layout)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if device == "cuda":
        torch.zeros(1, device="cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).to(device)
    mesh = init_device_mesh(device, (dist.get_world_size(),))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.arange(4 * 16, dtype=torch.float32, device=device).reshape(4, 16) / 64
    loss = model(x).square().mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss.detach().cpu(), model[0].weight.full_tensor().detach().cpu(), model[0].weight


def tp_mlp_reference() -> tuple[torch.Tensor, torch.Tensor]:
    """The same step on one device with plain torch: what every backend must reproduce."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    x = torch.arange(4 * 16, dtype=torch.float32).reshape(4, 16) / 64
    loss = model(x).square().mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss.detach(), model[0].weight.detach()


def check_tp(trace: Any, n: int) -> dict[str, Any]:
    loss, weight = tp_mlp_reference()
    for r in range(n):
        got_loss, got_weight, _ = trace.results[r]
        assert torch.allclose(got_loss, loss, rtol=1e-4, atol=1e-6), f"rank {r}: loss {got_loss} != {loss}"
        assert torch.allclose(got_weight, weight, rtol=1e-4, atol=1e-6), f"rank {r}: weight after the step"
    return {"world_size": n, "loss": float(loss), "collectives": [c.op for c in trace.collectives()]}


# --- the parts --------------------------------------------------------------------------------------


@part("simulator (lockstep), 4 ranks, CPU tensors")
def _() -> Any:
    return run_cells("local", 4, "cpu")


@part("simulator (lockstep), 4 ranks, CUDA tensors", cuda=True)
def _() -> Any:
    return run_cells("local", 4, "cuda")


@part("simulator (one thread per rank), 4 ranks, CPU tensors")
def _() -> Any:
    return run_cells("threads", 4, "cpu")


@part("gloo, 4 ranks, CPU tensors")
def _() -> Any:
    return run_cells("gloo", 4, "cpu")


@part("gloo, 4 ranks sharing one GPU, CUDA tensors", cuda=True)
def _() -> Any:
    return run_cells("gloo", 4, "cuda")


@part("nccl, 1 rank (one per GPU), CUDA tensors", cuda=True)
def _() -> Any:
    out = run_cells("nccl", 1, "cuda")
    out["device_type"] = "cuda"
    return out


def compare_on(backend: str, n: int, device: str) -> dict[str, Any]:
    """``%%spmd --compare`` in an IPython shell: the cell in the simulator and on real ranks."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.extension_manager.load_extension("shardviz")
    shell.run_cell("import torch\nimport torch.distributed as dist\nimport shardviz as sv")
    sv.use(backend, world_size=n, timeout=60)
    pick_gpu = "torch.zeros(1, device='cuda')" if device == "cuda" else "None"
    cell = (
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Replicate, Shard, distribute_tensor\n"
        f"{pick_gpu}\n"
        f"mesh = init_device_mesh({device!r}, ({n},))\n"
        f"x = torch.arange({8.0 * n}, device={device!r}).reshape({2 * n}, 4)\n"
        "dt = distribute_tensor(x, mesh, [Shard(0)])\n"
        "t = torch.ones(3, device=dt.device) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\n"
        "g = dt.redistribute(mesh, [Replicate()]).to_local()\n"
        "(g.cpu(), t.cpu())"
    )
    c = shell.run_cell_magic("spmd", "--compare", cell)
    assert c.ok, str(c)
    sim = [e.op for e in c.simulated.collectives()]
    real = [e.op for e in c.real.collectives()]
    assert sim == real and "all_reduce" in real, (sim, real)
    return {"world_size": n, "device": device, "collectives": real, "differences": 0}


@part("%%spmd --compare: simulator vs gloo, 4 ranks, CPU tensors")
def _() -> Any:
    return compare_on("gloo", 4, "cpu")


@part("%%spmd --compare: simulator vs gloo, 4 ranks sharing one GPU, CUDA tensors", cuda=True)
def _() -> Any:
    return compare_on("gloo", 4, "cuda")


@part("%%spmd --compare: simulator vs nccl, 1 rank, CUDA tensors", cuda=True)
def _() -> Any:
    return compare_on("nccl", 1, "cuda")


@part("sv.compare: simulator vs nccl, TP MLP step, CUDA", cuda=True)
def _() -> Any:
    sv.use("nccl", world_size=1, timeout=60)
    c = sv.compare(tp_mlp_step, "cuda", rtol=1e-4, atol=1e-6)
    assert c.ok, str(c)
    return check_tp(c.real, 1)


def record_tp(device: str) -> dict[str, Any]:
    """The TP MLP step recorded in the simulator (in this process) on ``device``, checked against
    plain torch, and its first weight's layout and the step's collectives drawn to PNG."""
    sv.use("local", world_size=4)
    with sv.record() as trace:
        loss, weight, dt = tp_mlp_step(device)
    ref_loss, ref_weight = tp_mlp_reference()
    assert torch.allclose(loss, ref_loss, rtol=1e-4, atol=1e-6), f"loss {loss} != {ref_loss}"
    assert torch.allclose(weight, ref_weight, rtol=1e-4, atol=1e-6), "weight after the step"
    layout = sv.layout(dt)
    assert layout == sv.layout((32, 16), (4,), ["S(0)"]), layout
    assert dt.to_local().device.type == device
    OUT.mkdir(parents=True, exist_ok=True)
    png = OUT / f"tp_mlp_layout_{device}.png"
    fig = sv.plot(dt, title=f"Linear(16, 32).weight, ColwiseParallel on 4 ranks ({device})")
    fig.savefig(png, dpi=80)
    assert png.stat().st_size > 1000
    ops = [c.op for c in trace.collectives()]
    assert "all_reduce" in ops, ops  # RowwiseParallel's output (and the backward's input grads)
    return {"world_size": 4, "loss": float(ref_loss), "collectives": ops, "layout_png": png.name}


@part("recorded TP MLP step, simulator, CPU tensors, layout to PNG")
def _() -> Any:
    return record_tp("cpu")


@part("recorded TP MLP step, simulator, CUDA tensors, layout to PNG", cuda=True)
def _() -> Any:
    return record_tp("cuda")


@part("recorded TP MLP step, gloo 4 ranks sharing one GPU, CUDA tensors", cuda=True)
def _() -> Any:
    sv.use("gloo", world_size=4, timeout=60)
    return check_tp(sv.run(tp_mlp_step, "cuda"), 4)


def main() -> int:
    failed = [c["name"] for c in results["checks"] if not c["ok"]]
    results["summary"] = {
        "passed": sum(c["ok"] for c in results["checks"]),
        "failed": len(failed),
        "skipped": len(results["skipped"]),
        "ran_on_gpu": HAS_CUDA,
        "note": "NCCL takes one rank per GPU: on one GPU the nccl parts run with world_size 1; "
        "the gloo parts put 4 ranks on the one GPU.",
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_results.json").write_text(json.dumps(results, indent=2, default=str))
    s = results["summary"]
    print(f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped", flush=True)
    for skip in results["skipped"]:
        print(f"skipped: {skip['name']} ({skip['why']})")
    print(f"results: {OUT / 'gpu_results.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
