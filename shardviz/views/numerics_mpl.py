"""A NumericsReport as a matplotlib Figure: every row's error against the tolerance in the
parallel run's order, and the first difference's per-element error."""

from __future__ import annotations

import math

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator

from ..data.numerics import DiffRow, NumericsReport
from .mpl import literal_text

PHASE_COLORS = {
    "start": "#999999",
    "forward": "#4e79a7",
    "backward": "#f28e2b",
    "step": "#59a14f",
}
FLOOR = 1e-6  # errors below this many tolerances are drawn at it (a log scale has no zero)

# Powers of ten as plain text: the figures draw text literally (no mathtext), so matplotlib's own
# log labels would show their markup.
_POWERS = FuncFormatter(lambda v, _: f"1e{round(math.log10(v))}" if v > 0 else "0")


def _units(row: DiffRow) -> float | None:
    if row.worst is None:
        return None
    if math.isnan(row.worst) or math.isinf(row.worst):
        return 1e6
    return max(row.worst, FLOOR)


@literal_text
def plot_numerics(report: NumericsReport, *, title: str | None = None) -> Figure:
    first = report.first
    wide = first is not None and first.error is not None and first.error.size > 1
    fig = Figure(figsize=(11 if wide else 8, 3.8))
    ax = fig.add_subplot(1, 2 if wide else 1, 1)
    xs = range(len(report.rows))
    for phase, color in PHASE_COLORS.items():
        pts = [
            (x, u)
            for x, r in zip(xs, report.rows, strict=True)
            if r.phase == phase and (u := _units(r)) is not None
        ]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=9, color=color, label=phase, zorder=3)
    odd = [
        x for x, r in zip(xs, report.rows, strict=True) if r.status in ("shape", "unassembled", "replicas")
    ]
    for x in odd:
        ax.axvline(x, color="#e15759", alpha=0.25, linewidth=1)
    ax.axhline(1.0, color="#e15759", linewidth=1, linestyle="--", label="tolerance")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10.0, numticks=12))
    ax.yaxis.set_major_formatter(_POWERS)
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_ylim(FLOOR / 2, max(10.0, *(u * 3 for r in report.rows if (u := _units(r)) is not None)))
    ax.set_xlabel("rows, in the parallel run's order")
    ax.set_ylabel("largest error / tolerance")
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=5)
    if first is not None:
        x = report.rows.index(first)
        u = _units(first) or 1.0
        ax.annotate(
            f"first: {first.module}\n{first.phase} {first.what}",
            (x, u),
            xytext=(0.02, 0.97),
            textcoords="axes fraction",
            va="top",
            fontsize=7,
            bbox={"boxstyle": "round", "facecolor": "white", "edgecolor": "#cccccc"},
            arrowprops={"arrowstyle": "->", "color": "#333333", "linewidth": 0.8},
        )
    head = f"{report.parallel} vs {report.reference}: " + (
        f"{len(report.differences)} of {len(report.rows)} rows differ"
        if first
        else "no difference beyond tolerance"
    )
    fig.suptitle(title or head, fontsize=9, x=0.01, ha="left")
    if wide and first is not None and first.error is not None:
        _heatmap(fig.add_subplot(1, 2, 2), first)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def _heatmap(ax: Axes, row: DiffRow) -> None:
    """The first difference's error per element: the last two dims, at the worst element's index
    along the others."""
    assert row.error is not None
    err = np.asarray(row.error, dtype=np.float64)
    index = row.index or (0,) * err.ndim
    if err.ndim > 2:
        err = err[tuple(index[:-2])]
    if err.ndim == 1:
        err = err[None, :]
    shown = np.clip(np.nan_to_num(err, nan=1e6, posinf=1e6), FLOOR, None)
    norm = LogNorm(vmin=FLOOR, vmax=max(10.0, float(shown.max())))
    im = ax.imshow(shown, norm=norm, cmap="viridis", aspect="auto")
    lead = f" at {list(index[:-2])}" if len(index) > 2 else ""
    ax.set_title(f"first difference: error / tolerance{lead}", fontsize=8, loc="left")
    ax.set_xlabel(f"dim {len(row.shape or ()) - 1}")
    if len(row.shape or ()) > 1:
        ax.set_ylabel(f"dim {len(row.shape or ()) - 2}")
    bar = ax.get_figure().colorbar(im, ax=ax, fraction=0.046, pad=0.04)  # type: ignore[union-attr]
    bar.ax.yaxis.set_major_formatter(_POWERS)
    bar.ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
