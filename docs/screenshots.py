"""Make the README's pictures: both views exported to offline HTML, photographed in Chromium.

Run ``.venv/bin/python docs/screenshots.py`` (needs Debian's chromium and the playwright package;
never ``playwright install``). Writes ``docs/images/*.png``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor

import shardviz as sv

HERE = Path(__file__).resolve().parent
OUT = HERE / "images"
CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def layout_page(tmp: Path) -> Path:
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dt = distribute_tensor(torch.arange(35.0).reshape(5, 7), mesh, [Shard(0), Shard(1)])
    return sv.export_html(dt, tmp / "layout.html", heatmap=True, selected=2)


def player_page(tmp: Path) -> Path:
    sv.use("local", world_size=4)
    with sv.record():
        mesh = init_device_mesh("cpu", (4,))
        partial = DTensor.from_local(
            # rank r holds 10**r times the row number: each sum's digits say who sent which row
            sv.per_rank(lambda r: (10.0**r) * (torch.arange(4.0) + 1).unsqueeze(1).expand(4, 3).contiguous()),
            mesh,
            [Partial()],
        )
    with sv.record() as trace:
        partial.redistribute(mesh, [Shard(0)])
        t = sv.per_rank(lambda r: torch.arange(4.0) + r)
        dist.all_reduce(t)
    return sv.export_html(trace, tmp / "player.html", step=1)


def main() -> None:
    from playwright.sync_api import sync_playwright

    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        pages = {"layout_view.png": layout_page(tmp), "player_view.png": player_page(tmp)}
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS)
            page = browser.new_page(viewport={"width": 1100, "height": 700})
            for name, html in pages.items():
                page.goto(html.as_uri())
                page.wait_for_selector("[data-shardviz-view]")
                page.wait_for_timeout(500)
                page.locator("[data-shardviz-view]").first.screenshot(path=str(OUT / name))
                print("wrote", OUT / name, file=sys.stderr)
            browser.close()


if __name__ == "__main__":
    main()
