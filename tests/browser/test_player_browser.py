"""The exported collective player in Chromium: stepping, the data flow, values, cost, the ring
view and warnings, and a 1,000-event trace's payload and time to first render.

The pages are ``sv.export_html`` files opened from disk with every network request blocked: the
same ESM that runs in JupyterLab, answered by the offline stand-in model.
"""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import shardviz as sv
from shardviz.data import cost
from shardviz.data.events import TensorSnapshot
from shardviz.data.trace import Trace

pytestmark = pytest.mark.browser

ROOT = "[data-shardviz-view=player]"
X = torch.arange(35.0).reshape(7, 5)


@pytest.fixture(scope="module")
def small() -> Trace:
    sv.use("local", world_size=4)
    with sv.record() as t:
        mesh = init_device_mesh("cpu", (4,))
        dt = distribute_tensor(X, mesh, [Shard(0)])  # 0 scatter
        dt.redistribute(mesh, [Replicate()])  # 1 redistribute, 2 all_gather (uneven: padded)
        dist.all_reduce(sv.per_rank(lambda r: torch.arange(6.0) + 10 * r))  # 3
        dist.broadcast(sv.per_rank(lambda r: torch.full((2,), float(r))), src=2)  # 4
    return t


def open_export(page, path) -> float:
    t0 = time.perf_counter()
    page.page.goto(path.as_uri())
    page.page.wait_for_selector(f"{ROOT}[data-ready=true]")
    return time.perf_counter() - t0


def current(p) -> tuple[int, int]:
    el = p.locator("[data-step][data-event-id]")
    assert el.count() == 1
    return int(el.get_attribute("data-step")), int(el.get_attribute("data-event-id"))


def wait_step(p, k: int) -> None:
    p.wait_for_selector(f"{ROOT}[data-detail-step='{k}']")


def no_trouble(page) -> None:
    assert page.errors == [], page.errors
    assert page.blocked == [], page.blocked


def test_steps_first_next_next_prev_and_draws_the_flow(page, small, tmp_path, artifacts):
    ids = [e.id for e in sv.play(small).steps]
    assert ids == [0, 1, 2, 3, 4]
    html = sv.export_html(small, tmp_path / "small.html")
    seconds = open_export(page, html)
    p = page.page
    ms = p.get_attribute(ROOT, "data-render-ms")
    size = html.stat().st_size
    print(f"small trace (5 steps): file {size} bytes, first render {seconds * 1000:.0f} ms (view {ms} ms)")
    assert p.locator(ROOT).count() == 1
    for action in ("first", "prev", "next", "last"):
        assert p.locator(f"{ROOT} button[data-action={action}]").count() == 1
    p.click("[data-action=first]")
    assert current(p) == (0, ids[0])
    seen = []
    for action in ("next", "next", "prev"):
        p.click(f"[data-action={action}]")
        k = {"next": 1, "prev": -1}[action] + seen[-1][0] if seen else 1
        wait_step(p, k)
        seen.append(current(p))
        p.screenshot(path=str(artifacts / f"player_step_{len(seen)}_{action}.png"), full_page=True)
    assert seen == [(1, ids[1]), (2, ids[2]), (1, ids[1])]
    # step 1 is the redistribute: both layouts drawn with the layout view's code, and its plan
    assert p.locator(".sv-layout.sv-mini").count() == 2
    assert p.locator(".sv-layout.sv-mini .sv-tensor [data-rank]").count() >= 4 + 4
    assert "S(0) → R" in p.inner_text(".sv-plan-table") and "all_gather" in p.inner_text(".sv-plan-table")
    # the keyboard: → goes to the all_gather (uneven: rank 3's row of padding is hatched)
    p.focus(ROOT)
    p.keyboard.press("ArrowRight")
    wait_step(p, 2)
    assert current(p) == (2, 2)
    assert p.get_attribute(".sv-group", "data-arrows") == "12"
    assert p.locator(".sv-pad").count() == 1 + 4  # rank 3's input, and slot 3 of every output
    p.wait_for_selector(".sv-group[data-values=true]")
    cells = p.eval_on_selector_all(
        '.sv-values[data-values-rank="0"][data-values-side="out"] text',
        "els => els.map(e => Number(e.textContent))",
    )
    assert cells[:35] == X.flatten().tolist()  # then rank 3's padding row
    assert "✓ recorded outputs" in p.inner_text("[data-check=flow]")
    p.keyboard.press("End")
    wait_step(p, 4)
    p.keyboard.press("Home")
    wait_step(p, 0)
    assert current(p) == (0, 0)
    no_trouble(page)


def test_cost_follows_the_link_and_the_ring_ends_in_the_recorded_output(page, small, tmp_path, artifacts):
    open_export(page, sv.export_html(small, tmp_path / "ring.html"))
    p = page.page
    p.fill("[data-control=step]", "3")  # the slider
    wait_step(p, 3)
    e = small.events[3]
    for link in ("nvlink4", "pcie5", "ib-hdr"):
        p.select_option("[data-control=link]", link)
        want = cost.human_seconds(cost.event_cost(e, link).seconds)
        p.wait_for_function(
            f"document.querySelector('.sv-cost-time').textContent === 'estimated time: {want}'"
        )
    assert "36 B" in p.inner_text(".sv-cost-bytes")  # 2 (n - 1) / n x 24 bytes
    p.click("[data-action=ring]")
    p.wait_for_selector(".sv-ring[data-ring-step='3'] .sv-ring-cell")
    # after ring step 1, rank 1 holds chunk 0 of ranks 0 and 1
    p.click("[data-action=ring-next]")
    cell = p.locator('.sv-ring-cell[data-ring-rank="1"][data-ring-chunk="0"]')
    assert cell.get_attribute("data-contributors") == "0 1"
    for _ in range(6):
        p.click("[data-action=ring-next]")
    p.wait_for_selector(".sv-ring-final")
    assert p.locator(".sv-ring-final td.sv-ok").count() == 4
    want = [60, 64, 68, 72, 76, 80]
    assert p.inner_text('.sv-ring-final tr[data-final-rank="2"] td:nth-child(3)') == ", ".join(map(str, want))
    assert "✓ the ring's final state equals" in p.inner_text("[data-check=ring]")
    p.screenshot(path=str(artifacts / "player_ring_final.png"), full_page=True)
    no_trouble(page)


def test_a_wrong_output_is_a_visible_warning(page, small, tmp_path, artifacts):
    e = small.events[3]
    outs = dict(e.outputs)
    outs[2] = TensorSnapshot(outs[2].shape, outs[2].dtype, outs[2].values + 5.0)
    bad = Trace(4)
    bad.events = [dataclasses.replace(e, outputs=outs)]
    open_export(page, sv.export_html(bad, tmp_path / "bad.html"))
    p = page.page
    warning = p.locator(".sv-warning[data-check=flow]")
    assert warning.is_visible() and "ranks 2" in warning.inner_text()
    p.click("[data-action=ring]")
    p.fill("[data-control=ring-step]", "7")
    p.wait_for_selector(".sv-warning[data-check=ring]")
    assert p.locator(".sv-ring-final td.sv-bad").count() == 1
    p.screenshot(path=str(artifacts / "player_mismatch.png"), full_page=True)
    no_trouble(page)


def test_1000_event_trace_payload_and_time_to_first_render(page, tmp_path, artifacts):
    sv.use("local", world_size=4)
    with sv.record() as t:
        for _ in range(250):
            dist.all_reduce(sv.per_rank(lambda r: torch.arange(8.0) + r))
            dist.broadcast(sv.per_rank(lambda r: torch.full((4,), float(r))), src=1)
            dist.all_gather(
                [torch.zeros(2) for _ in range(4)], sv.per_rank(lambda r: torch.full((2,), float(r)))
            )
            dist.all_to_all_single(torch.zeros(8), sv.per_rank(lambda r: torch.arange(8.0) * (r + 1)))
    assert len(t.events) == 1000
    w = sv.play(t)
    state = len(json.dumps({k: getattr(w, k) for k in ("timeline", "info", "step", "link")}))
    t0 = time.perf_counter()
    html = sv.export_html(t, tmp_path / "big.html")
    export_s = time.perf_counter() - t0
    seconds = open_export(page, html)
    p = page.page
    ms = p.get_attribute(ROOT, "data-render-ms")
    size = html.stat().st_size
    print(
        f"1,000-event trace: synced state {state} bytes; export {size / 2**20:.2f} MiB in {export_s:.2f} s; "
        f"first render {seconds * 1000:.0f} ms (view {ms} ms)"
    )
    (artifacts / "player_1000_events.json").write_text(
        json.dumps(
            {"synced_state_bytes": state, "export_bytes": size, "first_render_ms": round(seconds * 1000)}
        )
    )
    assert seconds < 10
    assert p.locator(".sv-timeline .sv-row").count() == 1000
    t0 = time.perf_counter()
    p.click("[data-action=last]")
    wait_step(p, 999)
    last_ms = (time.perf_counter() - t0) * 1000
    print(f"1,000-event trace: jump to the last step and draw it: {last_ms:.0f} ms")
    assert current(p) == (999, 999)
    assert p.locator(".sv-row-current").get_attribute("data-row-event") == "999"
    assert p.evaluate(
        """() => {
          const t = document.querySelector('.sv-timeline'), r = document.querySelector('.sv-row-current');
          const bottom = t.scrollTop + t.clientHeight;
          return t.scrollTop > 0 && r.offsetTop >= t.scrollTop && r.offsetTop + r.offsetHeight <= bottom;
        }"""
    ), "the current row is scrolled into the timeline's view"
    p.screenshot(path=str(artifacts / "player_1000_events.png"))
    no_trouble(page)
    assert np.isfinite(seconds)
