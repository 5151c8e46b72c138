"""Which ranks agree with which: a rank x rank matrix of the fraction of elements two ranks' copies
of one value share (within the row's tolerance), and the groups it makes.

The numerics view draws it so that "ranks 4-7 disagree with ranks 0-3" shows as two blocks on the
diagonal without reading a line. Plain numpy on the recorded per-rank values, never torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ..data.numerics import DiffRow, Tolerance
from ..data.numerics.tolerance import close


def agreement(values: Mapping[int, np.ndarray], tol: Tolerance) -> tuple[list[int], np.ndarray]:
    """``(ranks, m)``: ``m[i, j]`` is the fraction of elements where rank ``ranks[i]``'s copy is
    within ``tol`` of rank ``ranks[j]``'s (NaN equals NaN; copies of another shape share none).
    Symmetric: a pair agrees where either direction of the tolerance holds it close."""
    ranks = sorted(values)
    n = len(ranks)
    m = np.ones((n, n), dtype=np.float64)
    for a in range(n):
        for b in range(a + 1, n):
            x, y = np.asarray(values[ranks[a]]), np.asarray(values[ranks[b]])
            if x.shape != y.shape:
                frac = 0.0
            elif x.size == 0:
                frac = 1.0
            else:
                frac = float(np.mean(close(x, y, tol) | close(y, x, tol)))
            m[a, b] = m[b, a] = frac
    return ranks, m


def groups(ranks: list[int], m: np.ndarray) -> list[list[int]]:
    """Ranks that agree on every element, largest group first, then the one with the lowest rank."""
    out: list[list[int]] = []
    for i, r in enumerate(ranks):
        for grp in out:
            if m[i, ranks.index(grp[0])] >= 1.0:
                grp.append(r)
                break
        else:
            out.append([r])
    out.sort(key=lambda grp: (-len(grp), grp[0]))
    return out


def row_agreement(row: DiffRow) -> dict[str, Any] | None:
    """The agreement of a row whose copies disagree, as plain data for the view: the ranks, the
    matrix (fractions) and the groups, from the first disagreement's recorded per-group values
    (each rank carries its group's value); None when no copies disagree."""
    if not row.disagreements:
        return None
    d = row.disagreements[0]
    if d.values and len(d.values) == len(d.groups):
        per_rank = {r: v for grp, v in zip(d.groups, d.values, strict=True) for r in grp}
        ranks, m = agreement(per_rank, row.tolerance)
    else:  # only the groups were kept (copies on a sub-mesh): agreement is all or nothing
        ranks = sorted(r for grp in d.groups for r in grp)
        where = {r: k for k, grp in enumerate(d.groups) for r in grp}
        m = np.array([[1.0 if where[a] == where[b] else 0.0 for b in ranks] for a in ranks])
    return {
        "scope": d.scope,
        "ranks": ranks,
        "matrix": [[round(float(x), 4) for x in line] for line in m],
        "groups": groups(ranks, m),
    }
