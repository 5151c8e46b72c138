"""torch.distributed.pipelining schedules in the simulator, and the pipeline timeline."""

from __future__ import annotations

import copy
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv
from shardviz.data.pipeline import timeline
from shardviz.views.pipeline_svg import TimelineView

M, B, D = 4, 8, 8  # microbatches, batch, width
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}


def stage_modules(n):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D)) for _ in range(n)]


def reference_grads(mods, x, y):
    """The unsplit model in plain torch; the schedules average the microbatch losses."""
    ref = nn.Sequential(*copy.deepcopy(mods))
    loss_fn = nn.MSELoss()
    (sum(loss_fn(ref(a), b) for a, b in zip(x.chunk(M), y.chunk(M), strict=True)) / M).backward()
    return {s: [p.grad for p in ref[s].parameters()] for s in range(len(mods))}


def run_pipeline(schedule, pp, tp=1):
    """Run ``schedule`` on a (pp,) or (pp, tp) mesh; return (trace, reference grads)."""
    virtual = 2 if schedule == "Interleaved1F1B" else 1
    n_stages = pp * virtual
    sv.use("local", world_size=pp * tp)
    mods = stage_modules(n_stages)
    torch.manual_seed(1)
    x, y = torch.randn(B, D), torch.randn(B, D)
    ref = reference_grads(mods, x, y)

    def fn(i):
        if tp > 1:
            mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
        else:
            mesh = init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))
        stages, mine = [], []
        for s in [i + v * pp for v in range(virtual)]:
            m = copy.deepcopy(mods[s])
            if tp > 1:
                parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            stage = PipelineStage(
                m,
                s,
                n_stages,
                torch.device("cpu"),
                group=mesh.get_group("pp"),
                input_args=(torch.empty(B // M, D).requires_grad_(s > 0),),
                output_args=(torch.empty(B // M, D).requires_grad_(True),),
            )
            stages.append(stage)
            mine.append((s, m))
        cls = SCHEDULES[schedule]
        sched = cls(stages if virtual > 1 else stages[0], n_microbatches=M, loss_fn=nn.MSELoss())
        if i == 0:
            sched.step(x)
        elif i == pp - 1:
            sched.step(target=y)
        else:
            sched.step()
        grads = {}
        for s, m in mine:
            grads[s] = [
                p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in m.parameters()
            ]
        return grads

    return sv.run(fn, threads=pp), ref


def assert_grads_match(trace, ref):
    seen = set()
    for rank, grads in trace.results.items():
        for s, gs in grads.items():
            seen.add(s)
            for g, want in zip(gs, ref[s], strict=True):
                assert torch.allclose(g, want, atol=1e-6, rtol=1e-5), (rank, s)
    assert seen == set(ref)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_schedules_match_plain_torch(schedule):
    trace, ref = run_pipeline(schedule, pp=2)
    assert_grads_match(trace, ref)
    computes = [e for e in trace.events if e.kind == "compute"]
    per_stage = 2 * M  # a forward and a backward per microbatch
    assert len(computes) == len(ref) * per_stage


@pytest.mark.timeout(120)
def test_gpipe_timeline_by_hand():
    trace, _ = run_pipeline("GPipe", pp=2)
    tl = timeline(trace)
    # GPipe: every forward, then every backward in microbatch order (ScheduleGPipe), both ranks
    gpipe = ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]
    assert tl.actions(0) == gpipe and tl.actions(1) == gpipe
    # p=2 stages, m=4 microbatches, unit steps: 2(m+p-1) = 10 steps, bubble (p-1)/(m+p-1) = 1/5
    assert tl.makespan == 10
    assert tl.bubble == pytest.approx(1 / 5)
    assert [(i.start, i.label) for i in tl.lane(1)][:5] == [
        (1, "F0"),
        (2, "F1"),
        (3, "F2"),
        (4, "F3"),
        (5, "B0"),
    ]
    assert str(tl).splitlines()[:3] == [
        "Pipeline timeline: 2 ranks, 10 steps, bubble 20.0% (F forward, B backward, . idle)",
        "rank 0 |F0 F1 F2 F3 .  .  B0 B1 B2 B3 |",
        "rank 1 |.  F0 F1 F2 F3 B0 B1 B2 B3 .  |",
    ]
    # the messages: activations 0 -> 1, gradients 1 -> 0, one per microbatch, (B/M, D) floats
    acts = [a for a in tl.arrows if a.phase == "forward"]
    grads = [a for a in tl.arrows if a.phase == "backward"]
    assert [(a.src, a.dst, a.microbatch, a.start, a.end) for a in acts] == [
        (0, 1, 0, 1, 1),
        (0, 1, 1, 2, 2),
        (0, 1, 2, 3, 3),
        (0, 1, 3, 4, 4),
    ]
    assert [(a.src, a.dst, a.microbatch) for a in grads] == [(1, 0, m) for m in range(M)]
    sends = [e for e in trace.collectives() if e.op == "send" and "pipeline" in e.params]
    assert [(e.groups, e.params["pipeline"]["phase"], e.params["pipeline"]["microbatch"]) for e in sends] == [
        (((0, 1),), "forward", m) for m in range(M)
    ] + [(((1, 0),), "backward", m) for m in range(M)]
    assert all(e.inputs[e.groups[0][0]].shape == (B // M, D) for e in sends)
    assert all(e.mesh_dim_name == "pp" for e in sends)


@pytest.mark.timeout(120)
def test_1f1b_timeline_by_hand():
    trace, _ = run_pipeline("1F1B", pp=2)
    tl = timeline(trace)
    # 1F1B on 2 stages: stage 0 warms up with 2 forwards (num_stages - stage), then alternates
    assert tl.actions(0) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert tl.actions(1) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert tl.makespan == 10 and tl.bubble == pytest.approx(1 / 5)


@pytest.mark.timeout(300)
def test_1f1b_on_pp_tp_mesh():
    trace, ref = run_pipeline("1F1B", pp=2, tp=2)
    assert_grads_match(trace, ref)
    tl = timeline(trace)
    assert tl.ranks == (0, 1, 2, 3)
    assert tl.actions(0) == tl.actions(1) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert tl.actions(2) == tl.actions(3) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    sends = [e for e in trace.collectives() if e.op == "send" and "pipeline" in e.params]
    assert {e.groups for e in sends} == {((0, 2), (1, 3)), ((2, 0), (3, 1))}

    # tensor-parallel collectives run inside the stages' compute: children of compute events
    def compute_of(e):
        while e.parent is not None:
            e = trace.event(e.parent)
            if e.kind == "compute":
                return e
        return None

    tp = [e for e in trace.collectives() if e.mesh_dim_name == "tp"]
    inside = {compute_of(e).id for e in tp if compute_of(e) is not None}
    forwards = {e.id for e in trace.events if e.kind == "compute" and e.name == "forward"}
    assert forwards <= inside  # every stage forward all-reduces over tp (RowwiseParallel)
    assert {e.groups for e in tp} <= {((0, 1),), ((2, 3),)}  # only the thread's own ranks kept


@pytest.mark.timeout(120)
def test_timeline_views(tmp_path):
    trace, _ = run_pipeline("GPipe", pp=2)
    tl = timeline(trace)
    d = tl.to_dict()
    assert d["ranks"] == [0, 1] and len(d["intervals"]) == 16
    with pytest.warns(UserWarning, match="not saved"):  # the results are dicts of grads
        path = trace.save(tmp_path / "gpipe.svtrace")
    again = timeline(sv.load(path))
    assert again.to_dict() == d


@pytest.mark.timeout(120)
def test_plot_timeline():
    trace, _ = run_pipeline("1F1B", pp=2)
    tl = sv.pipeline_timeline(trace)
    fig = sv.plot(tl)
    ax = fig.axes[0]
    assert "bubble 20.0%" in ax.get_title(loc="left")
    assert len([p for p in ax.patches if (p.get_gid() or "").startswith("interval-")]) == 16
    assert len([p for p in ax.patches if (p.get_gid() or "").startswith("arrow-")]) == len(tl.arrows)


# --- the SVG view of a timeline (sv.show / sv.export_html) -----------------------------------

GPIPE = ["F0", "F1", "F2", "F3", "B0", "B1", "B2", "B3"]


@pytest.fixture(scope="module")
def gpipe():
    trace, _ = run_pipeline("GPipe", pp=2)
    return sv.pipeline_timeline(trace)


def test_svg_lanes_boxes_and_arrows(gpipe):
    timeline = gpipe
    view = sv.show(timeline)
    assert isinstance(view, TimelineView)
    svg = ET.fromstring(view.svg())
    assert svg.get("data-shardviz-view") == "pipeline"
    assert float(svg.get("data-bubble")) == pytest.approx(1 / 5)  # (p-1)/(m+p-1), p=2, m=4
    lanes = svg.findall("{*}g[@data-rank]")
    assert [lane.get("data-rank") for lane in lanes] == ["0", "1"]
    for lane in lanes:
        assert [b.get("data-action-label") for b in lane.findall("{*}g[@data-action-label]")] == GPIPE
    arrows = [
        (a.get("data-src"), a.get("data-dst"), a.get("data-phase")) for a in svg.findall("{*}g[@data-src]")
    ]
    assert arrows.count(("0", "1", "forward")) == 4 and arrows.count(("1", "0", "backward")) == 4


def test_svg_text_html_and_export(gpipe, tmp_path):
    timeline = gpipe
    view = sv.show(timeline, title="GPipe")
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == str(timeline)
    assert "GPipe" in bundle["text/html"]
    html = sv.export_html(timeline, tmp_path / "pipe.html").read_text()
    assert html.count('data-action-label="F0"') == 2 and "<script" not in html
    with pytest.raises(TypeError, match="unknown option"):
        sv.show(timeline, link="pcie5")
