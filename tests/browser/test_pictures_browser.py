"""Issue 27: every picture right and readable, checked in Chromium on exported pages (offline, every
network request blocked).

The player's data flow: arrowheads in their line's colour in every group, labels clear of chunk
borders and of each other, arrows that never cross a buffer or a printed value, buffers of real
models at a readable size, the width used; the Llama player opening on the training step with
view rows folded and a filter by phase, module and mesh dim; the model map's sub-mesh weights per
group; Replicate striped diagonally; 512-rank layouts (ticks clear of the axis title, Enter in the
rank box); the pipeline legend inside its picture.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from recordings import every_collective
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import shardviz as sv
from shardviz.data.trace import Trace
from shardviz.views import steps

pytestmark = pytest.mark.browser

ROOT = "[data-shardviz-view=player]"

# In the page: everything that is wrong with the drawn data flow, as strings.
FLOW_PROBLEMS = """() => {
  const out = [];
  const shrink = (b, d) => ({ x: b.x + d, y: b.y + d, width: b.width - 2 * d, height: b.height - 2 * d });
  const inside = (p, b) => p.x > b.x && p.x < b.x + b.width && p.y > b.y && p.y < b.y + b.height;
  const overlap = (a, b) =>
    a.x < b.x + b.width && b.x < a.x + a.width && a.y < b.y + b.height && b.y < a.y + a.height;
  const within = (a, b) =>
    a.x >= b.x && a.y >= b.y && a.x + a.width <= b.x + b.width && a.y + a.height <= b.y + b.height;
  const name = (t) => `${t.getAttribute("class")} "${t.textContent}"`;
  for (const svg of document.querySelectorAll(".sv-flow-svg")) {
    const edges = [...svg.querySelectorAll(".sv-part-edge, .sv-buf-frame")].map((r) => r.getBBox());
    const labels = [...svg.querySelectorAll(".sv-value-range, .sv-part-label, .sv-role")];
    for (const t of labels) {
      const b = shrink(t.getBBox(), 0.5);
      // a label may sit inside a chunk or outside the buffer, never across a border
      if (edges.some((e) => overlap(b, e) && !within(b, e))) out.push(`${name(t)} crosses a chunk border`);
    }
    for (let i = 0; i < labels.length; i++)
      for (let j = i + 1; j < labels.length; j++)
        if (overlap(shrink(labels[i].getBBox(), 0.5), shrink(labels[j].getBBox(), 0.5)))
          out.push(`${name(labels[i])} overprints ${name(labels[j])}`);
    const values = [...svg.querySelectorAll(".sv-value")].map((t) => t.getBBox());
    const frames = [...svg.querySelectorAll(".sv-buf-frame")].map((r) => shrink(r.getBBox(), 1.5));
    for (const a of svg.querySelectorAll(".sv-arrow")) {
      const n = a.getTotalLength();
      for (let s = 0; s <= n; s += 1) {
        const p = a.getPointAtLength(s);
        if (values.some((v) => inside(p, v))) {
          out.push(`arrow ${a.dataset.src}->${a.dataset.dst} crosses a value`);
          break;
        }
        if (frames.some((f) => inside(p, f))) {
          out.push(`arrow ${a.dataset.src}->${a.dataset.dst} crosses a buffer`);
          break;
        }
      }
    }
  }
  return out;
}"""

# In the page: per arrow, its stroke and the fill of the arrowhead its marker-end resolves to.
ARROWHEADS = """() => [...document.querySelectorAll(".sv-arrow")].map((a) => {
  const id = a.getAttribute("marker-end").slice(5, -1);
  const m = document.getElementById(id);
  return [a.getAttribute("stroke"), m ? m.querySelector("path").getAttribute("fill") : null,
          m ? m.closest("svg") === a.closest("svg") : false];
})"""

DUPLICATE_IDS = """() => {
  const seen = new Map();
  for (const e of document.querySelectorAll("[id]")) seen.set(e.id, (seen.get(e.id) || 0) + 1);
  return [...seen].filter(([, n]) => n > 1).map(([id]) => id);
}"""


def open_player(page, trace: Trace, path, **options):
    html = sv.export_html(trace, path, **options)
    page.page.goto(html.as_uri())
    page.page.wait_for_selector(f"{ROOT}[data-ready=true]")
    return page.page


def goto_step(p, k: int, values: bool = True) -> None:
    """Go to step k and wait until it is drawn (with its values, when it has some)."""
    p.fill("[data-control=step]", str(k))
    p.wait_for_selector(f"{ROOT}[data-detail-step='{k}']")
    if values:
        p.wait_for_function(
            "() => [...document.querySelectorAll('.sv-flow .sv-group')].every(g => g.dataset.values)"
        )


def no_trouble(page) -> None:
    assert page.errors == [], page.errors
    assert page.blocked == [], page.blocked


@pytest.fixture(scope="module")
def collectives() -> Trace:
    """The 03_collectives notebook's recording: every collective once on 4 ranks."""
    return every_collective()


@pytest.fixture(scope="module")
def llama() -> Trace:
    """Notebook 08's first recording: the Llama with TP + SP on the tp slice of a (2, 4) mesh."""
    from shardviz.examples.llama import ModelArgs, Transformer, parallelize

    sv.use("local", world_size=8)
    torch.manual_seed(0)
    args = ModelArgs()
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        model = parallelize(Transformer(args), mesh["tp"])
        model(tokens).float().mean().backward()
    return t


def test_every_collective_is_drawn_cleanly_and_uses_the_width(page, collectives, tmp_path, artifacts):
    p = open_player(page, collectives, tmp_path / "c03.html")
    for k in range(9):
        goto_step(p, k, values=collectives.events[k].op != "barrier")
        problems = p.evaluate(FLOW_PROBLEMS)
        assert problems == [], f"step {k} ({collectives.events[k].op}): {problems}"
        if k == 4:
            p.screenshot(path=str(artifacts / "pictures_all_to_all.png"), full_page=True)
            # four ranks spread over the detail panel, not squeezed into a corner of it
            used = p.evaluate(
                "() => document.querySelector('.sv-flow-svg').getBoundingClientRect().width"
                " / document.querySelector('.sv-detail').clientWidth"
            )
            assert used > 0.8, used
            assert p.locator(".sv-value").count() == 64  # every value, before and after
    # the raw calls ran on the default group (no mesh), and the barrier keeps no values to miss
    assert "default process group (all 4 ranks)" in p.inner_text(".sv-meta-line")
    notes = p.inner_text(".sv-notes")
    assert "value policy" not in notes and "no data moves" in notes
    no_trouble(page)


def test_arrowheads_take_their_lines_colour_in_every_group(page, tmp_path):
    sv.use("local", world_size=8)
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        x = sv.per_rank(lambda r: torch.full((2, 3), float(r)))
        dist.all_gather_into_tensor(torch.zeros(8, 3), x, group=mesh.get_group("tp"))
    p = open_player(page, t, tmp_path / "groups.html")
    assert p.locator(".sv-flow .sv-group").count() == 2
    heads = p.evaluate(ARROWHEADS)
    assert len(heads) == 2 * 16  # per group: 12 transfers and 4 kept chunks
    assert all(stroke == fill and same for stroke, fill, same in heads), heads
    assert p.evaluate(DUPLICATE_IDS) == []
    no_trouble(page)


def test_the_llama_player_opens_on_the_training_step_with_readable_buffers(page, llama, tmp_path, artifacts):
    w = sv.play(llama)
    start = w.step_start
    e = w.steps[start]
    assert e.kind == "collective" and e.phase == "forward" and e.module  # past parallelize's scatters
    p = open_player(page, llama, tmp_path / "llama.html")
    assert int(p.get_attribute("[data-step][data-event-id]", "data-step")) == start
    p.wait_for_function(
        "() => [...document.querySelectorAll('.sv-flow .sv-group')].every(g => g.dataset.values)"
    )
    p.screenshot(path=str(artifacts / "pictures_llama_open.png"), full_page=True)
    # (8, 4, 64) and (2, 4, 64) buffers: rows of 16 px, columns wide enough to print values
    sizes = p.eval_on_selector_all(
        ".sv-buf-frame", "els => els.map(e => [e.getBBox().width, e.getBBox().height])"
    )
    assert sizes and all(w_ >= 40 and h >= 16 for w_, h in sizes), sizes
    assert p.locator(".sv-value").count() > 100
    font = p.eval_on_selector_all(
        ".sv-value", "els => Math.min(...els.map(e => Number(e.getAttribute('font-size'))))"
    )
    assert font >= 7
    assert p.evaluate(FLOW_PROBLEMS) == []
    # the timeline: view / detach rows folded, labels whole
    quiet = p.locator(".sv-row[data-quiet=true]")
    assert quiet.count() == len(w.timeline["quiet"]) > 100
    assert p.eval_on_selector_all(".sv-row[data-quiet=true]", "els => els.filter(e => !e.hidden).length") == 0
    cut = p.evaluate(
        """() => {
          const t = document.querySelector('.sv-timeline').getBoundingClientRect();
          return [...document.querySelectorAll('.sv-row:not([hidden]) .sv-row-label')]
            .filter(l => l.getBoundingClientRect().right > t.right + 0.5 || l.scrollWidth > l.clientWidth + 1)
            .map(l => l.textContent);
        }"""
    )
    assert cut == [], cut
    p.check("[data-control=all-ops]")
    p.wait_for_function("() => !document.querySelector('.sv-row[data-quiet=true]').hidden")
    # every step of the Llama is drawn cleanly
    for k in range(len(w.steps)):
        if w.steps[k].kind != "collective":
            continue
        goto_step(p, k)
        assert p.evaluate(FLOW_PROBLEMS) == [], f"step {k}: {w.steps[k]}"
    no_trouble(page)


def test_filter_by_phase_module_and_mesh_dim_and_jump_to_the_training_step(page, llama, tmp_path):
    model = steps.Model(llama)
    p = open_player(page, llama, tmp_path / "filter.html")
    start = model.step_start()
    p.click("[data-action=first]")
    p.wait_for_selector(f"{ROOT}[data-detail-step='0']")
    p.click("[data-action=start]")
    p.wait_for_selector(f"{ROOT}[data-detail-step='{start}']")
    # backward only: next / prev move between backward steps
    backward = model.steps_matching({"phase": "backward"})
    assert backward and backward[0] > start
    p.select_option("[data-control=phase]", "backward")
    p.click("[data-action=next]")
    p.wait_for_selector(f"{ROOT}[data-detail-step='{backward[0]}']")
    p.click("[data-action=next]")
    p.wait_for_selector(f"{ROOT}[data-detail-step='{backward[1]}']")
    assert f"{len(backward)} of {len(model.steps)} steps" in p.inner_text(".sv-filter-count")
    shown = p.eval_on_selector_all(
        ".sv-row[data-row-step]:not([hidden])", "els => els.map(e => Number(e.dataset.rowStep))"
    )
    assert shown == backward
    # a module, typed and committed with Enter (kept from the notebook's own Enter)
    p.evaluate(
        "() => document.addEventListener('keydown', e => { if (e.key === 'Enter') e.preventDefault(); })"
    )
    p.fill("[data-control=module]", "layers.1.attention")
    p.press("[data-control=module]", "Enter")
    both = model.steps_matching({"phase": "backward", "module": "layers.1.attention"})
    p.wait_for_function(
        f"() => document.querySelector('.sv-filter-count').textContent.startsWith('{len(both)} of')"
    )
    p.click("[data-action=last]")
    p.wait_for_selector(f"{ROOT}[data-detail-step='{both[-1]}']")
    shown = p.eval_on_selector_all(
        ".sv-row[data-row-step]:not([hidden])", "els => els.map(e => Number(e.dataset.rowStep))"
    )
    assert shown == both
    # no phase, no module: the mesh dim alone
    p.select_option("[data-control=phase]", "")
    p.fill("[data-control=module]", "")
    p.press("[data-control=module]", "Enter")
    p.select_option("[data-control=mesh-dim]", "tp")
    tp = model.steps_matching({"mesh_dim": "tp"})
    p.click("[data-action=first]")
    p.wait_for_selector(f"{ROOT}[data-detail-step='{tp[0]}']")
    no_trouble(page)


def test_the_model_map_draws_a_submesh_weight_per_group(page, tmp_path):
    sv.use("local", world_size=8)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("dp", "tp"))
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    html = sv.export_html(model, tmp_path / "model.html")
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector("[data-shardviz-view=model][data-ready=true]")
    p.click('tr[data-name="2.bias"]')  # Replicate on the tp slice: held whole by each group
    p.wait_for_selector('[data-shardviz-view=layout] [data-rank="7"]')
    lay = "[data-shardviz-view=layout] .sv-tensor"
    groups = p.eval_on_selector_all(f"{lay} [data-group]", "els => els.map(e => Number(e.dataset.group))")
    assert groups == [0, 1]
    for g, ranks in ((0, {0, 1, 2, 3}), (1, {4, 5, 6, 7})):
        got = p.eval_on_selector_all(
            f'{lay} [data-group="{g}"] [data-rank]', "els => els.map(e => Number(e.dataset.rank))"
        )
        assert set(got) == ranks  # no tensor drawn as "shared" by ranks of both groups
    no_trouble(page)


def test_replicate_is_striped_diagonally_not_in_columns(page, tmp_path):
    html = sv.export_html(sv.layout((4, 6), (2,), ["R"]), tmp_path / "rep.html")
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector("[data-shardviz-view=layout][data-ready=true]")
    boxes = p.eval_on_selector_all(
        ".sv-tensor .sv-shared",
        "els => els.map(e => { const b = e.getBBox(); return [e.dataset.rank, b.width, b.height]; })",
    )
    frame = p.eval_on_selector(".sv-tensor .sv-frame", "e => [e.getBBox().width, e.getBBox().height]")
    assert sorted(r for r, _, _ in boxes) == ["0", "1"]
    # each owner's stripes run across the whole block: neither owner holds a column of it
    for _, w_, h in boxes:
        assert w_ > 0.9 * frame[0] and h > 0.9 * frame[1]
    no_trouble(page)


def test_512_ranks_ticks_clear_the_axis_title_and_enter_picks_a_rank(page, tmp_path):
    html = sv.export_html(sv.layout((4096, 4096), (16, 32), ["S(0)", "S(1)"]), tmp_path / "big.html")
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector("[data-shardviz-view=layout][data-ready=true]")
    clash = p.evaluate(
        """() => {
          const svg = document.querySelector('.sv-tensor-svg');
          const title = [...svg.querySelectorAll('.sv-axis-label')].find(t => t.getAttribute('transform'));
          const a = title.getBoundingClientRect();
          return [...svg.querySelectorAll('.sv-tick')].filter(t => {
            const b = t.getBoundingClientRect();
            return a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
          }).map(t => t.textContent);
        }"""
    )
    assert clash == []
    # JupyterLab's command mode takes Enter (it cancels the keydown); the rank box must still commit
    p.evaluate(
        "() => document.addEventListener('keydown', e => { if (e.key === 'Enter') e.preventDefault(); })"
    )
    p.fill("[data-control=goto]", "300")
    p.press("[data-control=goto]", "Enter")
    p.wait_for_selector('.sv-info [data-info-rank="300"]')
    no_trouble(page)


def test_the_pipeline_legend_fits_its_picture(page, tmp_path):
    from shardviz.data.pipeline import Interval, Timeline

    tl = Timeline((0, 1), (Interval(0, 0.0, 1.0, "forward", 0, 0, 1, "F0"),), (), 2.0)
    html = sv.export_html(tl, tmp_path / "pipe.html")
    p = page.page
    p.goto(html.as_uri())
    p.wait_for_selector("[data-shardviz-view=pipeline]")
    out = p.evaluate(
        """() => {
          const svg = document.querySelector('[data-shardviz-view=pipeline]');
          const w = Number(svg.getAttribute('width'));
          return [...svg.querySelectorAll('text')].filter(t => {
            const b = t.getBBox(); return b.x + b.width > w;
          }).map(t => t.textContent);
        }"""
    )
    assert out == []
    no_trouble(page)
