"""Communication cost: bus bytes with the usual factors, alpha-beta time, the summary table."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import shardviz as sv
from shardviz.data import cost


def test_factors_and_steps():
    assert cost.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert cost.bus_factor("all_gather", 4) == 3.0  # (n-1)/n of the 4x larger output
    assert cost.bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert cost.bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert cost.bus_factor("broadcast", 4) == 1.0 and cost.bus_factor("barrier", 4) == 0.0
    assert cost.bus_factor("all_reduce", 1) == 0.0
    assert (cost.ring_steps("all_reduce", 4), cost.ring_steps("all_gather", 4)) == (6, 3)


def test_summary_of_a_trace():
    sv.use("local", world_size=4)
    with sv.record() as trace:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        t = sv.per_rank(lambda r: torch.ones(256, dtype=torch.float32))  # 1 KiB per rank
        dist.all_reduce(t, group=mesh.get_group("tp"))
        out = torch.zeros(512)
        dist.all_gather_into_tensor(out, t, group=mesh.get_group("dp"))
    link = cost.Link("test", alpha=1e-6, beta=1e9)
    s = trace.summary(link)
    ar, ag = s.rows
    # all_reduce over 2 ranks: 2 * (2 - 1) / 2 * 1024 bytes; 2 steps.
    assert (ar.op, ar.mesh_dim, ar.group_size, ar.groups, ar.bytes_per_rank) == (
        "all_reduce",
        "tp",
        2,
        2,
        1024,
    )
    assert ar.bus_bytes_per_rank == 1024 and ar.seconds == pytest.approx(2e-6 + 1024 / 1e9)
    assert ag.bus_bytes_per_rank == 1024 and ag.seconds == pytest.approx(1e-6 + 1024 / 1e9)
    assert s.by_mesh_dim == {"tp": (1024, ar.seconds), "dp": (1024, ag.seconds)}
    text = str(s)
    assert text.splitlines()[0] == "Communication on test (alpha 1.0 us, beta 1 GB/s)"
    assert "all_reduce  tp        -       2x2    1 KiB       1 KiB           3.0 us" in text
    assert "total: 2 KiB bus bytes per rank, 5.0 us" in text
    assert ar.as_dict()["op"] == "all_reduce"


def test_presets_and_bad_link():
    assert cost.link(None).name.startswith("NVLink")
    for p in cost.PRESETS.values():
        assert p.beta > 1e9 and p.alpha > 0 and p.source
    with pytest.raises(ValueError, match="nvlink4"):
        cost.link("carrier-pigeon")


def test_link_seconds_is_alpha_per_step_plus_bytes_over_beta():
    lk = cost.Link("test", alpha=2e-6, beta=1e9)
    assert lk.seconds(3, 4096) == pytest.approx(3 * 2e-6 + 4096 / 1e9)
    assert lk.seconds(0, 0) == 0.0
    # no bandwidth given: latency only, never a division by zero
    assert cost.Link("latency only", alpha=1e-6, beta=0.0).seconds(4, 1 << 20) == pytest.approx(4e-6)
