"""The layout widget: an anywidget over plain data (a Layout and per-rank numpy arrays).

Synced traits stay few and small: ``geometry`` (the compact layout from geometry.payload),
``values_info``, ``dims``, ``index``, ``heatmap``, ``selected`` and ``title``. Values never sit in
the state: the view asks for them with the ``fetch_values`` command and gets one binary buffer.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anywidget
import numpy as np
import traitlets
from anywidget.experimental import command

from ..geometry.layout import Layout
from . import geometry as g
from . import html

STATIC = Path(__file__).parent / "static"


# A view split into panels: its files under static/, in the order they are joined. Each holds
# plain top-level functions and constants (no import / export) that the view's own file calls.
PANELS: dict[str, tuple[str, ...]] = {
    "player": tuple(
        f"player/{name}.js"
        for name in (
            "core",  # the shared state and its accessors: first, every panel uses it
            "fetch",
            "controls",
            "timeline",
            "cost",
            "detail",
            "flow",
            "buffers",
            "ring",
            "redistribute",
            "mount",  # mountPlayer: the whole player into an element (the player and the playground)
        )
    ),
}
PANELS["playground"] = PANELS["player"]  # the playground draws its collectives with the player


def esm_files(view: str) -> tuple[str, ...]:
    """The files of one view's ESM under static/, in order: common.js, the view's panels, ``<view>.js``."""
    return ("common.js", *PANELS.get(view, ()), f"{view}.js")


def esm_source(view: str) -> str:
    """One view's ESM: common.js (drawing code shared by the views), the view's panel files, then
    ``<view>.js`` (which calls them and exports the widget), joined into one module.

    anywidget takes the ESM as a string, so the shared code needs no bundler and no import URL,
    which an offline HTML export could not resolve anyway.
    """
    return "\n".join((STATIC / f).read_text(encoding="utf-8") for f in esm_files(view))


# Default byte budget for the values embedded in an HTML export (all ranks plus the global tensor).
EXPORT_VALUES_BUDGET = 16 * 2**20

# Source dtypes whose values float32 cannot hold exactly: the global tensor goes as float64.
_WIDE = ("float64", "int64", "uint64", "int32", "uint32")

# The traits the ESM reads; an HTML export embeds exactly these.
SYNCED = ("geometry", "values_info", "dims", "index", "heatmap", "selected", "group", "title")


class StaticFallback:
    """For a widget class with ``text()`` and ``figure()``: its notebook output also carries a PNG
    and text, so a saved notebook shows the picture without a kernel (and text consoles a table)."""

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        from .mpl import to_png

        bundle = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        if bundle is None:
            return None
        data, metadata = bundle
        data = dict(data)
        data["text/plain"] = self.text()  # type: ignore[attr-defined]
        data["image/png"] = base64.b64encode(to_png(self.figure())).decode("ascii")  # type: ignore[attr-defined]
        return data, metadata


class LayoutWidget(StaticFallback, anywidget.AnyWidget):
    """Global tensor coloured by owning rank(s), the mesh beside it; click a rank for its shard."""

    _esm = esm_source("layout")
    _css = STATIC / "layout.css"

    geometry = traitlets.Dict().tag(sync=True)
    values_info = traitlets.Dict().tag(sync=True)
    dims = traitlets.List(traitlets.Int()).tag(sync=True)
    index = traitlets.List(traitlets.Int()).tag(sync=True)
    heatmap = traitlets.Bool(False).tag(sync=True)
    selected = traitlets.Int(-1).tag(sync=True)
    # Which group of a sub-mesh is drawn when they are too many to draw side by side.
    group = traitlets.Int(0).tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)

    def __init__(
        self,
        layout: Layout,
        values: Mapping[int, Any] | None = None,
        *,
        dims: Sequence[int] | None = None,
        index: Sequence[int] | None = None,
        heatmap: bool = False,
        selected: int | None = None,
        title: str | None = None,
        values_note: str | None = None,
        group: int | None = None,
    ) -> None:
        if not isinstance(layout, Layout):
            raise TypeError(f"LayoutWidget needs a shardviz Layout, not {type(layout).__name__}")
        checked = g.check_values(layout, values)
        rd, cd = g.view_dims(len(layout.global_shape), dims)
        idx = g.view_index(layout.global_shape, index)
        if heatmap and not checked:
            raise ValueError("heatmap=True needs values: pass values={rank: array} or a DTensor")
        if selected is not None and selected not in layout.ranks:
            raise ValueError(
                f"selected={selected!r} is not a rank of this layout ({g.rank_list(layout.ranks)})"
            )
        grp = g.check_group(layout, group)
        if group is None and selected is not None:
            grp = layout.shard(selected).group  # open on the selected rank's group
        self._layout = layout
        self._values = checked
        self._global: dict[int, np.ndarray] = {}
        if checked:
            info = {
                "available": True,
                "ranks": sorted(checked),
                "dtype": layout.dtype,
                "note": values_note or "",
            }
        else:
            info = {
                "available": False,
                "ranks": [],
                "dtype": layout.dtype,
                "note": values_note or "no values: this view was made from geometry only",
            }
        super().__init__(
            geometry=g.payload(layout),
            values_info=info,
            dims=[-1 if rd is None else rd, -1 if cd is None else cd],
            index=list(idx),
            heatmap=heatmap,
            selected=-1 if selected is None else selected,
            group=grp,
            title=title or "",
        )

    # ---- plain data in, for other code ----

    @property
    def tensor_layout(self) -> Layout:
        """The Layout drawn (``layout`` is taken by ipywidgets for CSS layout)."""
        return self._layout

    @property
    def shard_values(self) -> dict[int, np.ndarray] | None:
        """Each rank's local values, as given (None for a geometry-only view)."""
        return None if self._values is None else dict(self._values)

    def global_values(self, group: int = 0) -> np.ndarray | None:
        """The logical global tensor assembled from the shards (Partial values reduced); on a
        sub-mesh, that of one group (each group holds its own)."""
        if not self._values:
            return None
        grp = g.check_group(self._layout, group)
        if grp not in self._global:
            self._global[grp] = g.global_values(self._layout, self._values, grp)
        return self._global[grp]

    def _view_dims(self) -> tuple[int, int] | None:
        if len(self._layout.global_shape) < 2:
            return None
        return (self.dims[0], self.dims[1])

    # ---- values on demand ----

    def reply(self, rank: int, group: int = 0) -> tuple[dict[str, Any], list[bytes]]:
        """What ``fetch_values`` answers for one rank (-1: the global tensor of ``group``)."""
        if not self._values:
            return {"error": self.values_info.get("note") or "no values"}, []
        if rank == -1:
            if not 0 <= group < len(self._layout.instances):
                return {"error": f"no group {group} (groups 0..{len(self._layout.instances) - 1})"}, []
            glob = self.global_values(group)
            assert glob is not None
            if glob.dtype.kind == "f" and self._layout.dtype not in _WIDE:
                glob = glob.astype(np.float32)  # exact for the source dtype, half the bytes
            meta, data = g.encode(glob, self._layout.dtype)
            meta["rank"] = -1
            if self._layout.groups:
                meta["group"] = group
            return meta, [data]
        if rank not in self._values:
            return {
                "error": f"no values for rank {rank} (values are known for ranks {self.values_info['ranks']})"
            }, []
        meta, data = g.encode(self._values[rank], self._layout.dtype)
        meta["rank"] = rank
        return meta, [data]

    @command
    def fetch_values(self, msg: Any, buffers: list[bytes]) -> tuple[dict[str, Any], list[bytes]]:
        """anywidget command from the view: ``{"rank": r}`` (``"group": k`` with the global tensor
        of a sub-mesh, ``r == -1``) → metadata and one buffer."""
        rank = msg.get("rank") if isinstance(msg, dict) else None
        if isinstance(rank, bool) or not isinstance(rank, int):
            return {"error": f"bad request {msg!r}: expected {{'rank': <int>}}"}, []
        group = msg.get("group", 0)
        if isinstance(group, bool) or not isinstance(group, int):
            return {"error": f"bad request {msg!r}: 'group' must be an int"}, []
        return self.reply(rank, group)

    # ---- static renderings ----

    def __repr__(self) -> str:
        lay = self._layout
        vals = f"ranks {g.rank_list(sorted(self._values))}" if self._values else "none"
        return (
            f"LayoutWidget(global_shape={lay.global_shape}, dtype={lay.dtype!r}, "
            f"mesh_shape={lay.mesh_shape}, placements={list(lay.placements)}, values={vals})"
        )

    def text(self) -> str:
        """The text rendering: the layout table, then which ranks have values."""
        vals = f"ranks {g.rank_list(sorted(self._values))}" if self._values else "none (geometry only)"
        return f"{self._layout}\nvalues: {vals}"

    def figure(self) -> Any:
        """The same picture as a matplotlib Figure (current dims, slider positions and heat-map)."""
        from .mpl import plot_layout

        nd = len(self._layout.global_shape)
        return plot_layout(
            self._layout,
            self._values,
            dims=self._view_dims(),
            index=self.index if nd else None,
            heatmap=self.heatmap,
            title=self.title or None,
            group=self.group,
        )

    # ---- offline HTML ----

    def _responses(self, budget: int) -> tuple[list[html.Response], bool]:
        out: list[html.Response] = []
        used = 0
        if not self._values:
            return out, True
        # The global tensor of each group (a sub-mesh's groups hold their own), then each rank's.
        asks: list[dict[str, int]] = (
            [{"rank": -1, "group": k} for k in range(len(self._layout.groups))]
            if self._layout.groups
            else [{"rank": -1}]
        )
        asks += [{"rank": r} for r in sorted(self._values)]
        for msg in asks:
            meta, bufs = self.reply(msg["rank"], msg.get("group", 0))
            used += sum(len(b) for b in bufs)
            if used > budget:
                return [], False
            out.append(("fetch_values", msg, meta, bufs))
        return out, True

    def state_for_export(self) -> dict[str, Any]:
        """The synced traits the ESM reads (no ipywidgets internals, no ESM source)."""
        return {k: getattr(self, k) for k in SYNCED}

    def export_html(self, path: str | Path, *, values_budget: int = EXPORT_VALUES_BUDGET) -> Path:
        """One self-contained HTML file of this view (values embedded up to ``values_budget`` bytes)."""
        responses, complete = self._responses(values_budget)
        state = self.state_for_export()
        if not complete:
            state["values_info"] = {
                **self.values_info,
                "available": False,
                "note": f"values not embedded: over the export budget of {values_budget} bytes "
                "(pass values_budget=... to export_html)",
            }
        lay = self._layout
        return html.export(
            "layout",
            state,
            None,
            esm_source("layout"),
            (STATIC / "layout.css").read_text(encoding="utf-8"),
            path,
            responses=responses,
            title=f"shardviz layout {lay.global_shape} on mesh {lay.mesh_shape}",
        )
