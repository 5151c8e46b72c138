"""Hugging Face transformers as its users write it, unpatched: ``from_pretrained`` of a tiny Llama
with ``DistributedConfig(tp_size=...)`` (its own TP plan, its loader's thread pool), on one thread
per rank; drawn, compared with ``sv.diff``; refused in the lockstep simulator, the same way every
run. Every model and layout (Llama, Qwen2, Mistral; TP and FSDP x TP) against gloo and the
unsharded model: tests/cluster/test_real_code_gloo.py.

Expectations: the unsharded model in one process (``real_code_cases.reference``), the pure layout
geometry (``sv.layout`` of a shape), hand-written placements of transformers' plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardviz as sv
from shardviz.errors import PerRankValueError

pytest.importorskip("transformers", reason="transformers is installed by `make setup` (the `hf` extra)")

import real_code_cases as cases

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cases.save_checkpoint("llama", tmp_path_factory.mktemp("hf"))


@pytest.fixture(autouse=True)
def _back_to_lockstep():
    yield
    sv.use("local", world_size=4)


def tp_model(path: Path, tp: int, dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=tp), dtype=dtype
    )


@pytest.mark.parametrize("world", [2, 4])
def test_tp_on_threads_equals_the_unsharded_model_drawn_and_played(checkpoint, world):
    # Before: "Could not resolve the process group registered under the name 0" (the loader's
    # thread pool ran outside the rank's world).
    sv.use("threads", world_size=world)
    ref = cases.reference(checkpoint, "tp")
    ids = cases.tokens()

    def step():
        model = tp_model(checkpoint, world)
        q = model.model.layers[0].self_attn.q_proj.weight
        o = model.model.layers[0].self_attn.o_proj.weight
        drawn = (sv.layout(q), sv.layout(o), sv.show(model))
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: cases.full(p.grad) for n, p in model.named_parameters()}, drawn

    trace = sv.run(step)
    for r in range(world):
        loss, grads, (q_layout, o_layout, shown) = trace.results[r]
        torch.testing.assert_close(loss, ref["losses"][0])
        for name, want in ref["grads"].items():
            torch.testing.assert_close(grads[name], want, msg=name)
        # transformers' plan: q_proj colwise (its rows), o_proj rowwise (its columns)
        assert q_layout == sv.layout((cases.HIDDEN, cases.HIDDEN), (world,), ["S(0)"], ("tp",))
        assert o_layout == sv.layout((cases.HIDDEN, cases.HIDDEN), (world,), ["S(1)"], ("tp",))
        assert type(shown).__name__ != "Shown"  # the model map, drawn from every rank's part
    text = str(shown)
    assert "q_proj" in text and "S(0)" in text and "embed_tokens" in text
    # the forward's and backward's collectives, played
    assert trace.collectives() and all(c.groups == (tuple(range(world)),) for c in trace.collectives())
    player = sv.play(trace)
    try:
        played = [e for e in player.steps if getattr(e, "kind", "") == "collective"]
        assert played == trace.collectives()
    finally:
        player.close()


def test_bf16_tp_on_threads_is_the_unsharded_bf16_model(checkpoint):
    from transformers import AutoModelForCausalLM

    sv.use("threads", world_size=4)
    ids = cases.tokens()
    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    want = ref(ids).logits.float()

    trace = sv.run(lambda: cases.full(tp_model(checkpoint, 4, torch.bfloat16)(ids).logits))
    for r in range(4):
        got = trace.results[r]
        assert got.dtype == torch.bfloat16
        # bf16: the row-parallel sums run in another order (2 significant digits)
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_sv_diff_of_the_tp_model_finds_no_difference(checkpoint):
    from transformers import AutoModelForCausalLM

    sv.use("threads", world_size=4)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    ids = cases.tokens()
    report = sv.diff(
        model,
        lambda copy: tp_model(checkpoint, 4),
        {"input_ids": ids, "labels": ids},
        loss=lambda out: out.loss,
    )
    text = str(report)
    assert "no difference beyond tolerance" in text and "threads (4 ranks)" in text
    assert "q_proj" in text and "weight.grad" in text


@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_lockstep_refuses_the_same_way_every_run_naming_the_line(checkpoint, layout):
    # Before: tp was refused at the loader's slicing; fsdp_tp gave a different error on each of
    # three runs (the loader's threads ran outside the simulation).
    sv.use("local", world_size=4)
    messages = set()
    for _ in range(3):
        with pytest.raises(PerRankValueError) as info:
            sv.run(cases.transformers_step, checkpoint, layout)
        messages.add(str(info.value))
    assert len(messages) == 1
    (text,) = messages
    assert "transformers' initialize_distributed_mesh (transformers/distributed/utils.py, line" in text
    assert "LOCAL_RANK" in text and "sv.use('threads', world_size=N)" in text
