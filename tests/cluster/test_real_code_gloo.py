"""The distributed code people run, on real ranks (torchrun, gloo, 4 processes) and on the
simulator: transformers' TP and FSDP x TP of tiny Llama, Qwen2 and Mistral, accelerate's
``Accelerator(cpu=True)``, torch's DDP, torch's ``visualize_sharding`` / ``CommDebugMode`` /
``DebugMode`` (``tests/real_code/real_code_cases.py``, the same functions everywhere).

One torchrun job runs every case once (``gloo_job``), each rank recording its trace with
``sv.record_job`` and saving what the case returned. The gloo run is the reference: for the
numbers (themselves compared with the unsharded model in one process), for the trace's collectives
(op, groups, reduction, each rank's buffer shapes) and for what the debug tools print; the
simulator runs the same function with ``sv.use("threads")`` and, where it can, in lockstep.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardviz as sv
from shardviz.data.load import PartialTraceWarning

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("transformers", reason="transformers is installed by `make setup` (the `hf` extra)")
pytest.importorskip("accelerate", reason="accelerate is installed by `make setup` (the `hf` extra)")

CASES_DIR = Path(__file__).resolve().parent.parent / "real_code"
sys.path.insert(0, str(CASES_DIR))
import real_code_cases as cases  # noqa: E402

WORLD = 4
HF_CASES = [(m, layout) for m in cases.MODELS for layout in cases.LAYOUTS]

SCRIPT = """\
import datetime, os, sys
from pathlib import Path
import torch
import torch.distributed as dist
import shardviz as sv

sys.path.insert(0, sys.argv[1])
import real_code_cases as cases

out, checkpoints = Path(sys.argv[2]), Path(sys.argv[3])
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
jobs = [(f"{m}-{layout}", cases.transformers_step, (checkpoints / m, layout))
        for m in cases.MODELS for layout in cases.LAYOUTS]
jobs += [("accelerate", cases.accelerate_step, ()), ("ddp", cases.ddp_step, ()),
         ("debug_tools", cases.debug_tools, ())]
for name, fn, args in jobs:
    with sv.record_job(out / "traces" / name, values="none"):
        result = fn(*args)
    folder = out / "results" / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(result, folder / f"rank{rank}.pt")
    dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoints")
    for m in cases.MODELS:
        cases.save_checkpoint(m, folder)
    return folder


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory: pytest.TempPathFactory, checkpoints: Path) -> Path:
    out = tmp_path_factory.mktemp("gloo")
    script = out / "job.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    done = subprocess.run(
        [*cmd, str(script), str(CASES_DIR), str(out), str(checkpoints)],
        env=env,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def gloo_results(job: Path, name: str) -> dict[int, Any]:
    folder = job / "results" / name
    return {r: torch.load(folder / f"rank{r}.pt", weights_only=True) for r in range(WORLD)}


def gloo_trace(job: Path, name: str) -> sv.Trace:
    with warnings.catch_warnings():
        warnings.simplefilter("error", PartialTraceWarning)
        return sv.load(job / "traces" / name)


def shapes(per_rank: dict[int, Any]) -> tuple[Any, ...]:
    def shape(v: Any) -> Any:
        return tuple(shape(x) for x in v) if isinstance(v, list) else tuple(v.shape)

    return tuple(sorted((r, shape(v)) for r, v in per_rank.items()))


def collectives(trace: sv.Trace) -> list[tuple[Any, ...]]:
    """What a collective is, independent of the backend: op, reduction, groups, each rank's buffer
    shapes."""
    return [(c.op, c.reduce_op, c.groups, shapes(c.inputs), shapes(c.outputs)) for c in trace.collectives()]


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=name)


@pytest.fixture(autouse=True)
def _threads() -> Any:
    sv.use("threads", world_size=WORLD)
    yield
    sv.use("local", world_size=WORLD)


@pytest.mark.parametrize(("model", "layout"), HF_CASES)
def test_transformers_on_threads_equals_gloo_and_the_unsharded_model(model, layout, gloo_job, checkpoints):
    name = f"{model}-{layout}"
    path = checkpoints / model
    ref = cases.reference(path, layout)
    real = gloo_results(gloo_job, name)
    trace = sv.run(cases.transformers_step, path, layout, values="none")
    for r in range(WORLD):
        for side in (real[r], trace.results[r]):
            torch.testing.assert_close(side["loss"], ref["losses"][side["dp_rank"]])
            assert_same(side["grads"], ref["grads"])
            assert_same(side["params"], ref["params"])
        assert trace.results[r]["dp_rank"] == real[r]["dp_rank"]
        # To float32 rounding, not bit for bit: gloo's all-reduce sums each chunk of a buffer
        # starting from a different rank, the threads backend every element in rank order (as
        # lockstep does), so a TP all-reduce can differ in its last bit (1 ulp of the loss seen on
        # an AVX-512 machine; the bits agreed on others).
        torch.testing.assert_close(trace.results[r]["loss"], real[r]["loss"])
    assert collectives(trace) == collectives(gloo_trace(gloo_job, name))
    assert len(trace.collectives()) > 0


def test_accelerate_on_threads_is_four_processes_as_on_gloo(gloo_job):
    real = gloo_results(gloo_job, "accelerate")
    trace = sv.run(cases.accelerate_step, values="none")
    want = cases.small_reference(WORLD)["params"]
    for r in range(WORLD):
        mine, theirs = trace.results[r], real[r]
        for key in ("process_index", "num_processes", "distributed_type", "is_main_process", "env_rank"):
            assert mine[key] == theirs[key], key
        assert mine["process_index"] == r and mine["num_processes"] == WORLD
        assert mine["distributed_type"] == "DistributedType.MULTI_CPU"
        assert_same(theirs["params"], want)
        assert_same(mine["params"], want)
    assert collectives(trace) == collectives(gloo_trace(gloo_job, "accelerate"))


def test_ddp_on_threads_equals_gloo(gloo_job):
    real = gloo_results(gloo_job, "ddp")
    trace = sv.run(cases.ddp_step, values="none")
    want = cases.small_reference(WORLD)["params"]
    for r in range(WORLD):
        assert_same(real[r]["params"], want)
        assert_same(trace.results[r]["params"], want)
    assert collectives(trace) == collectives(gloo_trace(gloo_job, "ddp"))
    assert any(c.op == "all_reduce" for c in trace.collectives())  # the reducer's buckets


@pytest.mark.parametrize("backend", ["threads", "local"])
def test_debug_tools_say_what_they_say_on_gloo(backend, gloo_job):
    real = gloo_results(gloo_job, "debug_tools")
    sv.use(backend, world_size=WORLD)
    mine = sv.run(cases.debug_tools, values="none").results
    keys = [
        "comm_total",
        "comm_counts",
        "comm_table",
        "comm_table_dtensor",
        "comm_table_all_ops",
        "debug_lines",
    ]
    for r in range(WORLD):
        theirs = real[r]
        assert "Sequential.2" in theirs["comm_table"] and "all_reduce" in theirs["comm_table"]
        for key in keys:
            assert mine[r][key] == theirs[key], (r, key)
    for name in ("whole", "tp", "replicated"):
        assert real[0]["visualize"][name].strip(), name  # rank 0 prints on real ranks
        if backend == "threads":  # each rank prints what it prints on gloo
            assert [mine[r]["visualize"][name] for r in range(WORLD)] == [
                real[r]["visualize"][name] for r in range(WORLD)
            ]
        else:  # one process for every rank: what rank 0 prints
            assert mine[0]["visualize"][name] == real[0]["visualize"][name]
