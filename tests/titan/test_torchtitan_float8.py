"""torchtitan's float8 training (its ``Float8LinearConverter`` with ``emulate=True``, torchao's
``Float8Linear``), unpatched, on 8 simulated ranks (issue 24's float8 row).

With FSDP2 the simulated run matches the float8 model in one process: FSDP2 all-gathers each
float32 weight whole before ``Float8Linear`` casts it, so both sides quantize the same tensors with
the same scales and differ only in summation order (the tolerances of test_torchtitan.py).

With tensor parallelism torchao's emulated float8 matmul meets a DTensor weight with a plain
tensor (``aten.mm got mixed torch.Tensor and DTensor``). That is torch's and torchao's behaviour, not
the simulator's: one thread per rank, where each rank runs plain torch and real DTensor dispatch as a
real process would, fails with the same error, and the lockstep simulator must not do better or
worse than that.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardviz as sv

pytest.importorskip("torchtitan", reason="torchtitan is installed by `make setup` (see Makefile)")
pytest.importorskip("torchao", reason="torchao is in the `titan` extra (see pyproject.toml)")

import test_torchtitan as titan
import torchtitan.distributed.parallel_dims as parallel_dims
from torchtitan.components.quantization.float8 import Float8LinearConverter
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed import utils as dist_utils
from torchtitan.models.llama3 import parallelize_llama

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

WORLD = titan.WORLD
MIXED = "got mixed torch.Tensor and DTensor"


@pytest.fixture(autouse=True)
def float8(monkeypatch):
    """torchtitan's model config passed through its float8 converter, as its trainer does when
    ``model.converters`` names float8."""
    monkeypatch.setattr(parallel_dims, "device_type", "cpu")
    dist_utils.set_spmd_backend("partial_dtensor")
    converter = Float8LinearConverter(Float8LinearConverter.Config(emulate=True))
    plain = titan.llama_config
    monkeypatch.setattr(titan, "llama_config", lambda p: converter.convert(plain(p)))
    sv.use("local", world_size=WORLD)
    yield plain
    sv.use("local", world_size=WORLD)


def float8_linears(model: Any) -> int:
    from torchao.float8.float8_linear import Float8Linear  # FSDP2 subclasses the ones it wraps

    return sum(isinstance(m, Float8Linear) for m in model.modules())


def eligible_linears(plain_config: Any) -> int:
    """The plain model's linears that torchtitan's filter converts: both dims multiples of 16."""
    with torch.device("meta"):
        model = plain_config(ParallelismConfig(spmd_backend="partial_dtensor")).build()
    return sum(
        isinstance(m, torch.nn.Linear) and m.in_features % 16 == 0 and m.out_features % 16 == 0
        for m in model.modules()
    )


def test_fsdp2_with_float8_linears_matches_the_float8_model_in_one_process(float8):
    ref = titan.reference()
    converted = eligible_linears(float8)
    assert converted > 0 and float8_linears(ref) == converted
    tokens, labels = titan.batches(WORLD)
    model, _ = titan.build(ref, 1, WORLD, 1, whole=True)
    assert float8_linears(model) == converted
    mine = sv.per_rank(lambda r: tokens[r]), sv.per_rank(lambda r: labels[r])
    with sv.record() as trace:
        loss = titan.train_step(model, *mine, tokens.numel())
    titan.check_against_reference(ref, model, loss, tokens, labels, dp_of=lambda r: r)
    assert trace.check() == {}
    gathers = [e for e in trace.collectives() if e.op == "all_gather" and e.phase == "forward"]
    assert gathers and all(e.groups == (tuple(range(WORLD)),) for e in gathers)


def _float8_tp_step(tokens: torch.Tensor, labels: torch.Tensor) -> Any:
    """FSDP2 (2) + TP (4) through parallelize_llama, one step; run as each rank's own code."""
    p = ParallelismConfig(
        spmd_backend="partial_dtensor", data_parallel_shard_degree=2, tensor_parallel_degree=4
    )
    dims = ParallelDims.from_config(p, WORLD)
    dims.build_mesh()
    with torch.device("meta"):
        model = titan.llama_config(p).build()
    parallelize_llama(
        model,
        parallel_dims=dims,
        training=TrainingConfig(mixed_precision_param="float32"),
        parallelism=p,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    return titan.train_step(model, tokens, labels, tokens.numel() * 2)


def test_float8_with_tp_fails_in_the_simulator_exactly_as_in_plain_torch_per_rank():
    tokens, labels = titan.batches(2)
    sv.use("threads", world_size=WORLD)
    with pytest.raises(RuntimeError, match=MIXED) as per_rank:
        sv.run(lambda: _float8_tp_step(tokens[dist.get_rank() // 4], labels[dist.get_rank() // 4]))
    sv.use("local", world_size=WORLD)
    mine = sv.per_rank(lambda r: tokens[r // 4]), sv.per_rank(lambda r: labels[r // 4])
    with pytest.raises(RuntimeError, match=MIXED) as lockstep, sv.record():
        _float8_tp_step(*mine)
    # the same operator refuses the same mixture, from torchao's float8 matmul
    assert str(lockstep.value).splitlines()[0] == str(per_rank.value).splitlines()[0]
    assert "torchao" in "".join(str(f.path) for f in lockstep.traceback)
