"""A NumericsReport as a picture, the widget's story: the module tree coloured by error, and for
the selected row (the first difference, else the worst row) where it differs, element by element,
and which ranks agree with which when copies disagree."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import LogNorm
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import FuncFormatter, MaxNLocator

from ..data.numerics import DiffRow, NumericsReport
from ..data.numerics.text import rank_ranges
from .mpl import Figure, literal_text
from .numerics_agreement import row_agreement
from .numerics_tree import heat_range, summary

# The tree's colour scale, shared with numerics.js (ERR_BINS): rows within tolerance neutral,
# then three steps of "how far beyond", and the statuses that have no single error.
BINS: tuple[tuple[str, str], ...] = (
    ("within tolerance", "#e6e6e6"),
    ("1-10x tolerance", "#fdd0a2"),
    ("10-1000x", "#fd8d3c"),
    (">1000x, inf or NaN", "#d94801"),
    ("replicas disagree", "#8073ac"),
    ("shape differs", "#542788"),
    ("not compared", "#ffffff"),
)
MAX_LINES = 28  # tree lines drawn; beyond, the lines beyond tolerance and their modules

_POWERS = FuncFormatter(lambda v, _: f"1e{round(math.log10(v))}" if v > 0 else "0")


def error_bin(worst: float | None, status: str) -> int:
    """The index into BINS of a tree line: by status, else by its worst error / tolerance."""
    if status == "replicas":
        return 4
    if status == "shape":
        return 5
    if status in ("unassembled", "missing") or worst is None:
        return 6
    if math.isnan(worst) or worst > 1e3:
        return 3
    if worst > 10:
        return 2
    return 1 if worst > 1 else 0


def selected_row(report: NumericsReport) -> DiffRow | None:
    """The row the picture opens: the first difference, else the row nearest its tolerance."""
    if report.first is not None:
        return report.first
    scored = [r for r in report.rows if r.worst is not None]
    return max(scored, key=lambda r: r.worst or 0.0, default=None)


@literal_text
def plot_numerics(report: NumericsReport, *, title: str | None = None, row: int | None = None) -> Figure:
    """The tree coloured by error; for row ``row`` (default: the first difference, else the row
    nearest its tolerance) its error per element and, where copies disagree, which ranks agree."""
    chosen = report.rows[row] if row is not None and 0 <= row < len(report.rows) else selected_row(report)
    # A heat-map of zeros (copies that disagree, read where they equal the reference) says nothing.
    heat = (
        chosen is not None
        and chosen.error is not None
        and chosen.error.size > 1
        and bool(np.any(chosen.error != 0))
    )
    agree = row_agreement(chosen) if chosen is not None else None
    panels = 1 + int(heat) + int(agree is not None)
    lines, total = _tree_lines(report)
    height = max(3.8, 1.6 + 0.2 * len(lines))
    fig = Figure(figsize=(5.0 + 4.2 * (panels - 1), height), dpi=100, layout="constrained")
    widths = [1.2] + [1.0] * (panels - 1)
    axes = fig.subplots(1, panels, width_ratios=widths, squeeze=False)[0]
    _tree(axes[0], lines, report, chosen)
    if total > len(lines):
        beyond = "beyond tolerance, " if any(error_bin(t[1], t[2]) not in (0, 6) for t in lines) else ""
        axes[0].set_title(
            f"module tree, coloured by error ({len(lines)} {beyond}of {total} lines)", fontsize=9, loc="left"
        )
    k = 1
    if heat and chosen is not None:
        _heatmap(axes[k], chosen)
        k += 1
    if agree is not None:
        _agreement(axes[k], agree)
    n = len(report.differences)
    head = f"{report.parallel} vs {report.reference}: " + (
        f"{n} of {len(report.rows)} rows differ" if n else "no difference beyond tolerance"
    )
    fig.suptitle(title or head, fontsize=10, x=0.01, ha="left")
    return fig


def _tree_lines(report: NumericsReport) -> tuple[list[tuple[str, float | None, str, int]], int]:
    """(label, worst, status, row index or -1) per tree line, at most MAX_LINES of them (those
    beyond tolerance first), and how many lines the tree has."""
    s = summary(report)
    L, R = s["lines"], s["rows"]
    out = []
    for depth, name, i, worst, status in zip(
        L["depth"], L["name"], L["row"], L["worst"], L["status"], strict=True
    ):
        label = (
            name
            if i < 0
            else R["what"][i] + (f" #{R['call'][i]}" if R["call"][i] else "") + f" ({R['phase'][i]})"
        )
        out.append(("  " * depth + label, worst, status, i))
    if len(out) > MAX_LINES:
        bad = [t for t in out if error_bin(t[1], t[2]) not in (0, 6)]
        out = (bad or out)[:MAX_LINES]
    return out, len(L["depth"])


def _tree(
    ax: Axes, lines: list[tuple[str, float | None, str, int]], report: NumericsReport, row: DiffRow | None
) -> None:
    n = len(lines)
    chosen = report.rows.index(row) if row is not None else -1
    for y, (_, worst, status, i) in enumerate(lines):
        color = BINS[error_bin(worst, status)][1]
        far = worst is not None and (math.isnan(worst) or worst > 1e6)
        w = 1e6 if far or error_bin(worst, status) >= 4 else max(worst or 1e-6, 1e-6)
        ax.barh(y, w, left=1e-6, height=0.8, color=color, edgecolor="#999999", linewidth=0.4)
        if i == chosen and i >= 0:
            ax.barh(y, w, left=1e-6, height=0.8, fill=False, edgecolor="#000000", linewidth=1.5)
    ax.set_xscale("log")
    ax.set_xlim(1e-6, 1e6)
    ax.xaxis.set_major_formatter(_POWERS)
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.axvline(1.0, color="#b00020", linewidth=1, linestyle="--")
    ax.set_yticks(
        range(n),
        [t[0] if len(t[0]) <= 40 else t[0][:20] + "…" + t[0][-19:] for t in lines],  # both ends tell
        fontsize=7,
        family="monospace",
    )
    ax.set_ylim(n - 0.5, -0.5)
    ax.set_xlabel("largest error / tolerance (dashed: the tolerance)", fontsize=8)
    ax.set_title("module tree, coloured by error", fontsize=9, loc="left")
    ax.spines[["top", "right"]].set_visible(False)
    handles = [Patch(facecolor=c, edgecolor="#999999", label=t) for t, c in BINS]
    ax.get_figure().legend(  # type: ignore[union-attr]
        handles=handles, fontsize=7, frameon=False, loc="outside lower left", ncols=len(BINS)
    )


def _heatmap(ax: Axes, row: DiffRow) -> None:
    """Where the row differs: error / tolerance per element over its last two dims (at the worst
    element's index along the others), on a log scale spanning the row's own errors."""
    assert row.error is not None
    err = np.asarray(row.error, dtype=np.float64)
    index = row.index or (0,) * err.ndim
    if err.ndim > 2:
        err = err[tuple(index[:-2])]
    if err.ndim == 1:
        err = err[None, :]
    lo, hi = heat_range(np.asarray(row.error, dtype=np.float64))
    shown = np.clip(np.nan_to_num(err, nan=10**hi, posinf=10**hi), 10**lo, 10**hi)
    im = ax.imshow(
        shown, norm=LogNorm(vmin=10**lo, vmax=10**hi), cmap="magma_r", aspect="auto", interpolation="nearest"
    )
    lead = f" at [{', '.join(str(i) for i in index[:-2])}, :, :]" if len(index) > 2 else ""
    what = "where it differs" if row.differs else "largest error"
    ax.set_title(f"{what}: {row.module} {row.what}{lead}", fontsize=9, loc="left")
    nd = len(row.shape or ())
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(f"dim {nd - 1} (index)", fontsize=8)
    ax.set_ylabel(f"dim {nd - 2} (index)" if nd > 1 else "", fontsize=8)
    bar = ax.get_figure().colorbar(im, ax=ax, fraction=0.05, pad=0.02)  # type: ignore[union-attr]
    where = "every element beyond it" if lo >= 0 else "the tolerance is 1e0"
    bar.set_label(f"error / tolerance (log; {where})", fontsize=8)
    bar.ax.yaxis.set_major_formatter(_POWERS)
    bar.ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))


def _agreement(ax: Axes, agree: dict[str, Any]) -> None:
    """Which ranks agree: the fraction of equal elements of each pair of copies, groups outlined."""
    ranks, m = agree["ranks"], np.asarray(agree["matrix"])
    ax.imshow(m, cmap="Greens", vmin=0.0, vmax=1.0, interpolation="nearest")
    n = len(ranks)
    step = max(1, n // 16)
    ax.set_xticks(range(0, n, step), [str(r) for r in ranks[::step]], fontsize=7)
    ax.set_yticks(range(0, n, step), [str(r) for r in ranks[::step]], fontsize=7)
    pos = {r: k for k, r in enumerate(ranks)}
    for grp in agree["groups"]:
        ks = sorted(pos[r] for r in grp)
        if ks == list(range(ks[0], ks[-1] + 1)):
            ax.add_patch(_box(ks[0], ks[-1]))
    ax.set_xlabel("rank\n(dark: copies equal on every\nelement; pale: on none)", fontsize=8)
    ax.set_ylabel("rank", fontsize=8)
    words = " | ".join(_ranges(g) for g in agree["groups"])
    ax.set_title(f"which ranks agree: {words}", fontsize=9, loc="left")


def _box(a: int, b: int) -> Rectangle:
    return Rectangle((a - 0.5, a - 0.5), b - a + 1, b - a + 1, fill=False, edgecolor="#b00020", linewidth=1.5)


def _ranges(ranks: list[int]) -> str:
    return rank_ranges(tuple(ranks))
