"""The model map widget: a table of a module's tensors, bytes per rank, and the layout of any row.

Synced traits stay few and small: ``summary`` (one column list per field, one entry per tensor,
plus totals per rank), ``rank`` (the rank whose bytes the table shows; -1: the most any rank
holds), ``selected`` (the row whose layout is open; -1: none) and ``title``. Per-rank data on
demand, through anywidget commands: ``layout`` ({"layout": k} → the geometry payload of the map's
k-th distinct layout, drawn inline by the same code as the layout view) and ``rank_bytes``
({"rank": r} → each row's bytes and local shape on rank r).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anywidget
import traitlets
from anywidget.experimental import command

from ..data import describe
from ..data.model import KINDS, ModelMap, bytes_summary, mesh_label, shape_summary
from ..geometry.layout import Layout
from . import geometry as g
from . import html
from .widgets import EXPORT_VALUES_BUDGET, STATIC, LayoutWidget, StaticFallback, esm_source

SYNCED = ("summary", "rank", "selected", "title")


def css() -> str:
    """The layout view's CSS (for the layout drawn inline) and the model map's own."""
    return "\n".join((STATIC / f).read_text(encoding="utf-8") for f in ("layout.css", "model.css"))


def summary(m: ModelMap) -> dict[str, Any]:
    """The synced payload: small JSON, one list per column, totals per rank as plain ints."""
    mod_index = {name: i for i, (name, _) in enumerate(m.modules)}
    rows = m.rows
    maxes = m.nbytes.max(axis=1).tolist() if len(rows) and m.world_size else [0] * len(rows)
    by_kind = m.totals_by_kind()
    return {
        "name": m.name,
        "world_size": m.world_size,
        "modules": [list(x) for x in m.modules],
        "rows": {
            "name": [r.name for r in rows],
            "kind": [r.kind for r in rows],
            "module": [mod_index.get(r.module, 0) for r in rows],
            "shape": [list(r.global_shape) for r in rows],
            "dtype": [r.dtype for r in rows],
            "mesh": [mesh_label(m.layouts[r.layout], r.distributed) for r in rows],
            "placements": [list(m.layouts[r.layout].placements) if r.distributed else [] for r in rows],
            "local": [shape_summary(m, i) for i in range(len(rows))],
            "bytes": [bytes_summary(m.nbytes[i]) for i in range(len(rows))],
            "max_bytes": [int(x) for x in maxes],
            "global_bytes": [r.global_bytes for r in rows],
            "layout": [r.layout for r in rows],
        },
        "totals": m.totals().tolist(),
        "by_kind": {k: v.tolist() for k, v in by_kind.items()},
        "mesh_dims": [
            {
                "name": d.name,
                "size": d.size,
                "sharded": d.sharded,
                "replicated": d.replicated,
                "partial": d.partial,
            }
            for d in m.by_mesh_dim()
        ],
        "global_bytes": m.global_bytes,
        "kinds": [k for k in KINDS if k in by_kind],
    }


class ModelWidget(StaticFallback, anywidget.AnyWidget):
    """A module's tensors with their placements and bytes per rank; click a row for its layout."""

    _esm = esm_source("model")
    _css = css()

    summary = traitlets.Dict().tag(sync=True)
    rank = traitlets.Int(-1).tag(sync=True)
    selected = traitlets.Int(-1).tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self,
        model_map: ModelMap,
        *,
        rank: int | None = None,
        selected: str | int | None = None,
        title: str | None = None,
    ) -> None:
        if not isinstance(model_map, ModelMap):
            raise TypeError(f"ModelWidget needs a shardviz ModelMap, not {type(model_map).__name__}")
        if rank is not None and not 0 <= rank < model_map.world_size:
            raise ValueError(f"rank={rank!r} is not a rank of this world (0-{model_map.world_size - 1})")
        sel = -1
        if isinstance(selected, str):
            sel = model_map.index(selected)
        elif selected is not None:
            if not 0 <= selected < len(model_map.rows):
                raise ValueError(
                    f"selected={selected!r}: a row index (0-{len(model_map.rows) - 1}) or a name"
                )
            sel = int(selected)
        self._map = model_map
        super().__init__(
            summary=summary(model_map),
            rank=-1 if rank is None else rank,
            selected=sel,
            title=title or "",
        )

    # ---- plain data out ----

    @property
    def model_map(self) -> ModelMap:
        return self._map

    @property
    def selected_layout(self) -> Layout | None:
        """The Layout of the selected row (None when no row is selected)."""
        if not 0 <= self.selected < len(self._map.rows):
            return None
        return self._map.layout(self.selected)

    def layout_view(self, row: str | int | None = None) -> Any:
        """The full layout widget of a row (default: the selected one), as ``sv.show(layout)``."""
        if row is None:
            row = self.selected
            if row < 0:
                raise ValueError("no row is selected: click one, or pass row= (a name or index)")
        r = self._map.rows[row] if isinstance(row, int) else self._map.row(row)
        return LayoutWidget(
            self._map.layouts[r.layout], title=f"{r.name} {describe.shape_tuple(r.global_shape)} {r.dtype}"
        )

    # ---- on demand ----

    def layout_reply(self, k: int) -> dict[str, Any]:
        if not 0 <= k < len(self._map.layouts):
            return {"error": f"no layout {k} (this map has {len(self._map.layouts)})"}
        return {"layout": k, "geometry": g.payload(self._map.layouts[k])}

    def rank_reply(self, rank: int) -> dict[str, Any]:
        m = self._map
        if not 0 <= rank < m.world_size:
            return {"error": f"no rank {rank} (world of {m.world_size})"}
        per_layout = [_local(lay, rank) for lay in m.layouts]
        shapes = [None if (s := per_layout[r.layout]) is None else describe.shape_tuple(s) for r in m.rows]
        return {"rank": rank, "bytes": m.nbytes[:, rank].tolist(), "shapes": shapes}

    @command
    def layout(self, msg: Any, buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """``{"layout": k}`` → the geometry payload of the map's k-th layout (as the layout view's)."""
        k = msg.get("layout") if isinstance(msg, dict) else None
        if isinstance(k, bool) or not isinstance(k, int):
            return {"error": f"bad request {msg!r}: expected {{'layout': <int>}}"}, []
        return self.layout_reply(k), []

    @command
    def rank_bytes(self, msg: Any, buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """``{"rank": r}`` → each row's bytes and local shape on rank r."""
        r = msg.get("rank") if isinstance(msg, dict) else None
        if isinstance(r, bool) or not isinstance(r, int):
            return {"error": f"bad request {msg!r}: expected {{'rank': <int>}}"}, []
        return self.rank_reply(r), []

    # ---- static renderings ----

    def __repr__(self) -> str:
        m = self._map
        tot = m.totals()
        most = int(tot.max()) if len(tot) else 0
        return (
            f"ModelWidget({m.name!r}, world_size={m.world_size}, tensors={len(m.rows)}, "
            f"layouts={len(m.layouts)}, max_bytes_per_rank={most})"
        )

    def text(self) -> str:
        return str(self._map)

    def figure(self) -> Any:
        from .model_mpl import plot_model_map

        return plot_model_map(self._map, title=self.title or None)

    # ---- offline HTML ----

    def export_html(self, path: str | Path, *, values_budget: int = EXPORT_VALUES_BUDGET) -> Path:
        """One self-contained HTML file: the table, and every layout (and, for worlds up to 64
        ranks, every rank's column) that fits in ``values_budget`` bytes of JSON."""
        import json

        responses: list[html.Response] = []
        used = 0
        for k in range(len(self._map.layouts)):
            reply = self.layout_reply(k)
            used += len(json.dumps(reply))
            if used > values_budget:
                break
            responses.append(("layout", {"layout": k}, reply, []))
        if self._map.world_size <= 64:
            for r in range(self._map.world_size):
                responses.append(("rank_bytes", {"rank": r}, self.rank_reply(r), []))
        state = {k: getattr(self, k) for k in SYNCED}
        return html.export(
            "model",
            state,
            None,
            esm_source("model"),
            css(),
            path,
            responses=responses,
            title=f"shardviz model map {self._map.name} on {self._map.world_size} ranks",
        )


def _local(layout: Layout, rank: int) -> tuple[int, ...] | None:
    for s in layout.shards:
        if s.rank == rank:
            return s.shape
    return None
