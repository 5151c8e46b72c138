"""A torchtitan-style Llama with TP + sequence parallel on the tp slice of a (dp, tp) mesh:
the simulation against plain torch, and the collectives it must issue (issue 15)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import shardviz as sv
from shardviz.capture import torch as _torch
from shardviz.examples.llama import ModelArgs, Transformer, parallelize

pytestmark = pytest.mark.timeout(240)


def _per_rank(t):
    if _torch.is_dtensor(t):
        t = t.full_tensor()
    return _torch.local_tensors(t) or {0: t}


@pytest.fixture(scope="module")
def step():
    sv.use("local", world_size=8)
    torch.manual_seed(0)
    args = ModelArgs()
    plain = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        model = Transformer(args)
        model.load_state_dict(plain.state_dict())
        parallelize(model, mesh["tp"])
        out = model(tokens)
        out.float().mean().backward()
    plain(tokens).mean().backward()
    return plain, model, out, trace, tokens


def test_outputs_and_gradients_equal_plain_torch(step):
    plain, model, out, _, tokens = step
    want = plain(tokens).detach()
    for r, got in _per_rank(out).items():
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"rank {r}")
    grads = dict(plain.named_parameters())
    with sv.record():
        for name, p in model.named_parameters():
            for r, g in _per_rank(p.grad).items():
                torch.testing.assert_close(g, grads[name].grad, atol=1e-5, rtol=1e-4, msg=f"{name} rank {r}")


def test_collectives_per_block_are_torchtitans(step):
    *_, trace, _ = step
    per_phase = Counter((e.op, e.phase) for e in trace.collectives() if e.phase is not None)
    n_layers = ModelArgs().n_layers
    # Forward, with sequence parallelism: the embedding's reduce-scatter; per block, an all-gather
    # into attention and one into the feed-forward, a reduce-scatter out of each; the output
    # projection gathers the sequence in and the vocabulary out.
    assert per_phase[("all_gather", "forward")] == 2 * n_layers + 2
    assert per_phase[("reduce_scatter", "forward")] == 2 * n_layers + 1
    assert per_phase[("all_gather", "backward")] > 0 and per_phase[("reduce_scatter", "backward")] > 0
    # Every one of them runs on both tp groups of the (dp=2, tp=4) world at once.
    for e in trace.collectives():
        if e.phase is not None:
            assert e.groups == ((0, 1, 2, 3), (4, 5, 6, 7)), e
            assert e.mesh_dim_name == "tp", e
    modules = {e.module for e in trace.collectives() if e.phase == "forward"}
    assert "Transformer.layers.0.attention" in modules and "Transformer.layers.1.feed_forward" in modules


def test_fsdp2_over_dp_composed_with_tp_and_sp_trains_as_plain_torch():
    from torch.distributed.fsdp import fully_shard

    sv.use("local", world_size=8)
    torch.manual_seed(0)
    args = ModelArgs()
    plain = Transformer(args)
    batches = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(2)]  # one per dp group
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        model = Transformer(args)
        model.load_state_dict(plain.state_dict())
        parallelize(model, mesh["tp"])
        for block in model.layers.values():
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(sv.per_rank(lambda r: batches[r // 4])).float().mean().backward()
        opt.step()
    ref_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    (sum(plain(b).mean() for b in batches) / 2).backward()
    ref_opt.step()
    want = dict(plain.named_parameters())
    with sv.record():
        for name, p in model.named_parameters():
            for r, t in _per_rank(p).items():
                torch.testing.assert_close(t, want[name], atol=1e-5, rtol=1e-4, msg=f"{name} rank {r}")
    dp = [e for e in trace.collectives() if e.mesh_dim_name == "dp" and e.phase]
    assert {e.op for e in dp} == {"all_gather", "reduce_scatter"}
    assert all(e.groups == ((0, 4), (1, 5), (2, 6), (3, 7)) for e in dp)
    modules = {e.module for e in dp}
    assert {"FSDPTransformer", "FSDPTransformer.layers.0", "FSDPTransformer.layers.1"} <= modules, modules
