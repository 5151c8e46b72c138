"""Reproducible measurements for shardviz; writes the table in benchmarks/README.md.

Every figure is a ratio against a baseline measured in the same run, so the table means the same
on a loaded laptop and on CI. Run with ``make bench``.
"""

from __future__ import annotations

import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import shardviz as sv

HERE = Path(__file__).resolve().parent
REPEATS = 7


def median_seconds(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_geometry() -> list[tuple[str, str, str, str]]:
    """sv.layout (exact per-rank indices) vs torch's own per-rank shape/offset computation."""
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from shardviz import _torch, mesh
    from shardviz.placement import parse

    rows = []
    shape = (8192, 28672)
    for mesh_shape, placements in [
        ((8,), ["S(0)"]),
        ((8, 8), ["S(0)", "S(1)"]),
        ((8, 8, 8), ["S(0)", "S(1)", "R"]),
    ]:
        torch_pl = [_torch.placement_from_plain(parse(p)) for p in placements]
        coords = mesh.coords(mesh_shape)

        def baseline(coords=coords, mesh_shape=mesh_shape, torch_pl=torch_pl) -> None:
            for c in coords:
                _compute_local_shape_and_global_offset(shape, mesh_shape, list(c), torch_pl)

        def ours(mesh_shape=mesh_shape, placements=placements) -> None:
            sv.layout(shape, mesh_shape, placements)

        b, o = median_seconds(baseline), median_seconds(ours)
        rows.append(
            (
                f"layout of {shape} on mesh {mesh_shape} ({len(coords)} ranks)",
                f"{o * 1e3:.2f} ms",
                f"{b * 1e3:.2f} ms (torch shape+offset per rank)",
                f"{o / b:.2f}x",
            )
        )
    return rows


def write(rows: list[tuple[str, str, str, str]]) -> None:
    readme = HERE / "README.md"
    head = [
        f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}, Python {sys.version.split()[0]}, "
        f"torch {torch.__version__}, shardviz {sv.__version__}; medians of {REPEATS} runs.",
        "",
        "| measurement | shardviz | baseline (same run) | ratio |",
        "|---|---|---|---|",
    ]
    table = "\n".join(head + [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows])
    text = readme.read_text()
    text = re.sub(
        r"<!-- results -->.*<!-- /results -->",
        lambda _: f"<!-- results -->\n{table}\n<!-- /results -->",
        text,
        flags=re.S,
    )
    readme.write_text(text)
    print(table)


if __name__ == "__main__":
    write(bench_geometry())
