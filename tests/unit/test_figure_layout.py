"""Issue 34: every static picture laid out from its content. For every kind of figure (the layout,
a player step, a redistribute, a trace's timeline, the model map, the pipeline and memory
timelines, the numerics report, the playground) on 1-D to 3-D meshes, 2 to 512 ranks and long
names: no text overprints another, nothing runs off the canvas, no legend lies outside it or over
a drawing (figure_checks.problems, measured on matplotlib's own extents after a draw).

The same checks found, on the pictures before this issue, the layout's tensor title printed over
its subtitle in every layout figure, and the legend at the canvas's far corner.
"""

from __future__ import annotations

import numpy as np
import pytest
from figure_checks import blank_fraction, problems
from recordings import every_collective

import shardviz as sv
from shardviz.data.memory import MemoryTimeline
from shardviz.data.pipeline import Arrow, Interval, Timeline

LONG = "a_rather_long_mesh_dim_name_for_the_tensor_parallel_axis"

LAYOUTS = {
    "1d-2-ranks": ((10,), (2,), ["S(0)"], None),
    "2d-4-ranks-uneven": ((5, 7), (2, 2), ["S(0)", "S(1)"], ("dp", "tp")),
    "partial-4": ((8, 6), (4,), ["P"], None),
    "3d-mesh-8": ((4, 6, 5), (2, 2, 2), ["S(0)", "R", "P"], ("pp", "dp", "tp")),
    "3d-mesh-64": ((64, 32, 16), (4, 4, 4), ["S(0)", "S(1)", "S(2)"], ("pp", "dp", "tp")),
    "16-ranks-stripes": ((12, 12), (4, 4), ["R", "S(0)"], ("dp", "tp")),
    "256-ranks": ((1024, 512), (16, 16), ["S(0)", "S(1)"], ("dp", "tp")),
    "512-ranks": ((4096, 1024), (512,), ["S(0)"], None),
    "long-names": ((3, 100000), (2, 4), ["R", "S(1)"], (LONG, LONG + "_2")),
    "empty-shards": ((2, 3), (4,), ["S(0)"], None),
    "empty-tensor": ((0, 3), (2,), ["S(0)"], None),
    "scalar": ((), (4,), ["R"], None),
    "strided": ((16, 4), (2, 2), ["_S(0,sf=2)", "S(0)"], ("dp", "tp")),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_figures_are_clean(name):
    shape, mesh, placements, names = LAYOUTS[name]
    fig = sv.plot(sv.layout(shape, mesh, placements, names))
    assert problems(fig) == []
    assert blank_fraction(fig) < 0.7


def test_layout_figures_with_values_heatmap_and_sub_mesh_groups_are_clean():
    lay = sv.layout((6, 5), (2, 2), ["S(0)", "S(1)"], ("dp", "tp"))
    values = {s.rank: np.arange(np.prod(s.shape), dtype=float).reshape(s.shape) * 1.5 for s in lay.shards}
    for heat in (False, True):
        assert problems(sv.plot(lay, values=values, heatmap=heat)) == []
    sub = sv.layout(
        (6, 4), (4,), ["S(0)"], ("tp",), mesh_ranks=(0, 1, 2, 3), groups=((0, 1, 2, 3), (4, 5, 6, 7))
    )
    assert problems(sv.plot(sub)) == []
    many = sv.layout(
        (8, 8), (8,), ["S(1)"], ("tp",), groups=tuple(tuple(range(k, k + 8)) for k in range(0, 32, 8))
    )
    assert problems(sv.plot(many, group=2)) == []


def test_the_layout_canvas_follows_the_content():
    small = sv.plot(sv.layout((4,), (2,), ["S(0)"])).get_size_inches()
    big = sv.plot(sv.layout((64, 64), (4, 4), ["S(0)", "S(1)"])).get_size_inches()
    assert small[1] < big[1] and small[0] < big[0]


@pytest.fixture(scope="module")
def collectives():
    """Every collective once on 4 ranks (notebook 03's recording)."""
    return every_collective()


def test_every_player_step_figure_is_clean(collectives):
    for e in collectives.events:
        assert problems(sv.plot(e, trace=collectives)) == [], e.op
    assert problems(sv.plot(collectives)) == []


@pytest.mark.parametrize(
    ("shape", "mesh", "src", "dst", "names"),
    [
        ((8, 6), (2,), ["S(0)"], ["R"], None),
        ((7, 5), (2, 4), ["S(0)", "S(1)"], ["R", "R"], ("dp", "tp")),
        ((16, 8), (2, 2, 2), ["P", "S(0)", "S(1)"], ["R", "R", "S(0)"], ("pp", (LONG)[:30], "tp")),
        ((64, 32), (16,), ["S(0)"], ["S(1)"], None),
        ((1 << 14, 4096), (64, 8), ["S(0)", "S(1)"], ["S(1)", "R"], ("dp", "tp")),
        ((1 << 16, 1024), (512,), ["S(0)"], ["S(1)"], None),
    ],
)
def test_plan_figures_are_clean_from_2_to_512_ranks(shape, mesh, src, dst, names):
    trace = sv.plan(shape, mesh, src, dst, names)
    for e in trace.events:
        assert problems(sv.plot(e, trace=trace)) == [], e
    if any(e.kind == "collective" for e in trace.events):
        assert problems(sv.plot(trace)) == []


def test_model_map_figures_are_clean():
    for world, names in ((2, ("tp",)), (16, ("dp", "tp")), (512, ("dp", "tp"))):
        mesh = (
            (world,) if len(names) == 1 else (world // 8 if world > 8 else 2, 8 if world > 8 else world // 2)
        )
        layouts = {
            f"layers.{i}.attention.{LONG}.weight": sv.layout((256, 128), mesh, ["S(0)"] * len(mesh), names)
            for i in range(12)
        }
        layouts["embedding.weight"] = sv.layout((1000, 64), mesh, ["R"] * len(mesh), names)
        m = sv.model_map(layouts)
        for stack in ("kind", "module", "tensor", "mesh_dim"):
            assert problems(sv.plot(m, stack=stack)) == [], (world, stack)


def test_pipeline_and_memory_figures_are_clean():
    ranks = tuple(range(8))
    intervals = tuple(
        Interval(r, float(k + r), float(k + r + 1), "forward", r, k, 100 * r + k, f"F{k}")
        for r in ranks
        for k in range(4)
    )
    arrows = tuple(
        Arrow(r, r + 1, float(k + r + 1), float(k + r + 1), 0, 1, "forward", r, k)
        for r in ranks[:-1]
        for k in range(4)
    )
    tl = Timeline(ranks, intervals, arrows, 12.0, busy={r: 4.0 for r in ranks})
    assert problems(sv.plot(tl, title="1F1B on a " + LONG)) == []
    rng = np.random.default_rng(0)
    world = 16
    events = tuple(range(40))
    b = rng.integers(0, 1 << 30, size=(len(events), world))
    m = MemoryTimeline(world, events, b, b.max(axis=0), tuple(int(x) for x in b.argmax(axis=0)))
    assert problems(sv.plot(m)) == []


def _numerics_report(world: int, name: str) -> sv.NumericsReport:
    """A tp run whose ranks of the second half disagree with the first, with a long module name."""
    from shardviz.data.numerics import RawCapture, RawTensor, RowKey, build_run, compare
    from shardviz.geometry.layout import compute

    modules = [("", "LM")] + [(f"layers.{i}.{name}", "Linear") for i in range(6)]
    y = np.arange(48.0, dtype=np.float32).reshape(6, 8)
    keys = [RowKey(m, 0, "output", "") for m, _ in modules[1:]]
    ref = build_run(
        "plain torch",
        RawCapture(
            1, "LM", tuple(modules), tuple(RawTensor(k, i, "float32", {None: y}) for i, k in enumerate(keys))
        ),
    )
    half = world // 2
    lay = compute((6, 8), (half,), ["R"], ("tp",), groups=[list(range(half)), list(range(half, world))])
    vals = {r: (y if r < half else y + 1) for r in range(world)}
    tensors = tuple(RawTensor(k, i, "float32", vals, lay) for i, k in enumerate(keys))
    return compare(ref, build_run("tp", RawCapture(world, "LM", tuple(modules), tensors)))


@pytest.mark.parametrize("world", [2, 8, 64])
def test_numerics_figures_are_clean(world):
    assert problems(sv.plot(_numerics_report(world, LONG))) == []


def test_playground_figures_are_clean():
    for choice in (
        {"shape": [10, 6], "mesh_shape": [4], "mesh_dim_names": ["tp"], "src": ["S(0)"], "dst": ["R"]},
        {
            "shape": [5, 7],
            "mesh_shape": [2, 2],
            "mesh_dim_names": [LONG, "tp"],
            "src": ["S(0)", "S(1)"],
            "dst": ["R", "S(0)"],
        },
    ):
        pg = sv.playground(**{k: v for k, v in choice.items()})
        assert problems(sv.plot(pg)) == [], choice
