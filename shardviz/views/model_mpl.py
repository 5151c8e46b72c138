"""The model map as a matplotlib Figure: each rank's bytes stacked by kind, module, tensor or the
mesh dims that shard them."""

from __future__ import annotations

from typing import Any

import numpy as np
from matplotlib.ticker import MaxNLocator

from ..data import describe
from .sheet import Figure, Sheet, literal_text

# the widget's (static/model.js), far from every rank colour (geometry.delta_e)
_KIND_COLORS = {"param": "#386cb0", "buffer": "#666666", "grad": "#ff7f00", "optimizer": "#e41a1c"}
_STACK_COLORS = ["#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB", "#332288"]
MODEL_STACKS = ("kind", "module", "tensor", "mesh_dim")


def _model_stacks(m: Any, stack: str, most: int = 7) -> list[tuple[str, np.ndarray, str]]:
    """(label, bytes per rank, colour) per stacked part, largest first, the rest as "other"."""
    if stack == "kind":
        return [(k, v, _KIND_COLORS[k]) for k, v in m.totals_by_kind().items()]
    if stack == "mesh_dim":
        # A tensor's bytes go to the mesh dims that shard it (all of them: named together), plain
        # and fully replicated tensors to "replicated".
        keys = []
        for r in m.rows:
            lay = m.layouts[r.layout]
            dims = [lay.dim_name(i) for i, p in enumerate(lay.placements) if p.startswith(("S", "_S"))]
            keys.append(("sharded over " + "+".join(dims)) if r.distributed and dims else "not sharded")
    elif stack == "module":
        keys = [r.module.split(".")[0] if r.module else "(root)" for r in m.rows]
    elif stack == "tensor":
        keys = [r.name for r in m.rows]
    else:
        raise ValueError(f"stack={stack!r}: one of {', '.join(MODEL_STACKS)}")
    sums: dict[str, np.ndarray] = {}
    for key, row in zip(keys, m.nbytes, strict=True):
        sums[key] = sums[key] + row if key in sums else row.astype(np.int64)
    order = sorted(sums, key=lambda k: (-int(sums[k].max()) if len(sums[k]) else 0, k))
    out = [(k, sums[k], _STACK_COLORS[i % len(_STACK_COLORS)]) for i, k in enumerate(order[:most])]
    rest = order[most:]
    if rest:
        other = np.asarray(np.sum([sums[k] for k in rest], axis=0, dtype=np.int64))  # one row per rank
        out.append((f"other ({len(rest)})", other, "#dddddd"))
    return out


@literal_text
def plot_model_map(m: Any, *, stack: str = "kind", title: str | None = None) -> Figure:
    """Bytes each rank holds, one bar per rank, stacked by kind (param, buffer, grad, optimizer
    state), by top-level module, by tensor (the largest few) or by the mesh dims that shard them;
    the legend beside the bars. Laid out from the content (views/sheet.py)."""
    sheet = Sheet()
    world = m.world_size
    parts = _model_stacks(m, stack)
    top = int(m.totals().max()) if world and len(m.rows) else 0
    lo = int(m.totals().min()) if world and len(m.rows) else 0
    sheet.text(0, 0, title or f"model map: {m.name}", fontsize=11, weight="bold")
    sheet.text(
        0,
        sheet.bottom() + 0.04,
        f"{len(m.rows)} tensors on {world} ranks · per rank {describe.bytes_text(lo)}"
        + (f" – {describe.bytes_text(top)}" if top != lo else "")
        + f" · unsharded {describe.bytes_text(m.global_bytes)}",
        fontsize=9,
        color="#444",
    )
    width = min(9.0, max(3.0, 0.32 * world))
    ax = sheet.axes(0, 0, width, 2.6, gid="bytes")
    size, unit = describe.byte_unit(top)
    scale = float(size)
    x = np.arange(world)
    bottom = np.zeros(world)
    bar = 0.8 if world <= 64 else 1.0
    for label, vals, color in parts:
        v = vals / scale
        bars = ax.bar(x, v, bottom=bottom, width=bar, color=color, label=label, linewidth=0)
        for b in bars.patches:
            b.set_gid(f"stack-{label}")
        bottom = bottom + v
    ax.set_xlim(-0.5, world - 0.5)
    ax.set_xlabel("rank", fontsize=9)
    ax.set_ylabel(f"bytes per rank ({unit})", fontsize=9)
    ax.tick_params(labelsize=8)
    if world <= 32:
        ax.set_xticks(x)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=max(4, int(width * 1.5)), integer=True))
    ax.spines[["top", "right"]].set_visible(False)
    box = sheet.place(ax, 0, sheet.bottom() + 0.2)
    handles, labels = ax.get_legend_handles_labels()
    sheet.legend(
        box.x1 + 0.2,
        box.y0,
        handles,
        labels=labels,
        fontsize=8,
        title=f"by {stack}",
        title_fontsize=8,
        alignment="left",
    )
    return sheet.finish()
