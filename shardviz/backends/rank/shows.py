"""``sv.show`` inside a ``%%spmd`` cell: each rank keeps its part as plain data, and the client draws
every rank's together in the notebook."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...capture import torch as _torch
from .. import session
from . import state

# The mimetype a ``sv.show`` marker displays as on a rank; the client swaps in the widget.
SHOW_MIME = "application/vnd.shardviz.show+json"
SHOW_KEY = "__shardviz_show__"
_MAX_SHOWS = 64


@dataclass(frozen=True)
class ShowMarker:
    """What ``sv.show(x)`` returns on a rank: the client draws the widget in its place."""

    id: int

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        st = state.current
        if st is not None:
            st.displayed.add(self.id)
        return {"text/plain": f"<shardviz show #{self.id}>", SHOW_MIME: {"id": self.id}}


def gather_show(obj: Any, **options: Any) -> Any:
    """``sv.show`` inside a ``%%spmd`` cell: keep this rank's layout and shard (on the CPU) for the
    client, which gathers every rank's and draws the widget in the notebook."""
    st = state.require()
    payload = show_payload(obj, st.rank, **options)
    if not isinstance(payload, dict):
        return payload
    mid = st.next_show
    st.next_show += 1
    st.shows[mid] = payload
    for old in [k for k in st.shows if k < mid - _MAX_SHOWS]:
        del st.shows[old]
    return ShowMarker(mid)


def show_payload(obj: Any, rank: int, **options: Any) -> Any:
    """What ``rank`` contributes to ``sv.show(obj)`` inside a cell: its layout and shard (or its
    chunk of a global tensor, ``of=``) as plain data, which ``cluster.draw_show`` draws together
    with the other ranks'. A module gives its model map, the same on every rank, not a payload."""
    from ...capture.recorder import to_numpy
    from ...geometry.layout import Layout
    from ...geometry.layout import compute as compute_layout

    if "of" in options:  # this rank's hand-made chunk of a global tensor: the client places it
        from ...geometry.chunks import find_offset, resolve_offsets

        whole = to_numpy(options.pop("of"))
        chunk = to_numpy(obj)
        given = resolve_offsets(options.pop("offsets", None), [rank])
        offset = given[rank] if given else find_offset(whole, chunk, rank)
        return {
            "chunk": {
                "offset": list(offset),
                "global_shape": list(whole.shape),
                "dtype": _torch.dtype_name(obj.dtype),
            },
            "values": chunk,
            "options": options,
        }
    if isinstance(obj, torch.nn.Module):
        # The model map is plain data, the same on every rank: it travels back as the cell's
        # value (or displays as its text table); sv.show(map) in an ordinary cell draws the widget.
        from ...capture.model_map import model_map

        return model_map(obj, **options, backend_world=session.world_size())
    from ...capture import adapters

    adapter = adapters.for_object(obj)
    if _torch.is_dtensor(obj):
        layout = compute_layout(**_torch.dtensor_geometry(obj))
        values: np.ndarray | None = to_numpy(obj.to_local())
    elif adapter is not None:  # PhysicsNeMo's ShardTensor: its spec's own shard sizes
        layout = adapter.layout(obj)
        values = to_numpy(adapter.local(obj))
        options = {"title": adapters.view_title(obj, layout), **options}
    elif isinstance(obj, Layout):
        layout, values = obj, None
    else:
        raise TypeError(
            f"sv.show inside a %%spmd cell takes a DTensor or a Layout, not {type(obj).__name__}; show a "
            "trace from an ordinary cell: sv.show(sv.last_trace())"
        )
    try:
        json.dumps(options)
    except TypeError:
        raise TypeError(
            "sv.show options inside a %%spmd cell must be plain values (numbers, strings, lists)"
        ) from None
    return {"layout": layout.to_dict(), "values": values, "options": options}
