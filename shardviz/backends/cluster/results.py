"""What comes back from the ranks: their traces, cell values (a PerRank when they differ) and
``sv.show`` payloads drawn as one widget, and their printed output tagged by rank."""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from ...capture.recorder.snapshot import from_values
from ...data.trace import Trace
from ...data.trace_read import load_trace
from .. import rank as _rank
from .. import session
from .faults import RankRun

# --- values and shows ----------------------------------------------------------------------------


class PerRank(dict):
    """A cell's value that differs between ranks: rank → value."""

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        for i, (r, v) in enumerate(self.items()):
            if i:
                p.break_()
            p.text(f"rank {r}: ")
            p.pretty(v)


def same_value(a: Any, b: Any) -> bool:
    """Equal values (tensors by dtype, shape and contents), for folding a cell's per-rank values."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(map(same_value, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def draw_show(payloads: Mapping[int, Mapping[str, Any]]) -> Any:
    """The widget for one ``sv.show`` call from every rank's layout and shard: plain data handed
    to the drawer, which draws it exactly as under the simulator."""
    from ...geometry.layout import Layout, as_held

    ranks = sorted(payloads)
    first = payloads[ranks[0]]
    if "chunk" in first:  # sv.show(chunk, of=global): every rank sent its chunk and offset
        from ...geometry.chunks import chunk_layout

        meta = first["chunk"]
        chunks = {r: payloads[r]["values"] for r in ranks}
        offsets = {r: tuple(payloads[r]["chunk"]["offset"]) for r in ranks}
        layout = chunk_layout(chunks, offsets, meta["global_shape"], meta["dtype"])
        return session.draw(layout, values=chunks, **dict(first.get("options") or {}))
    layout = Layout.from_dict(first["layout"])
    values = {r: payloads[r]["values"] for r in ranks if payloads[r].get("values") is not None}
    options = dict(first.get("options") or {})
    if len(values) == len(layout.shards):  # every rank's piece: drawn as the ranks hold them
        layout = as_held(
            dataclasses.replace(layout, notes=()), {r: tuple(v.shape) for r, v in values.items()}
        )
        if layout.notes:
            options["values_note"] = " ".join(layout.notes)
    return session.draw(layout, values=values or None, **options)


def swap_markers(value: Any, widgets: Mapping[int, Any]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_rank.SHOW_KEY}:
            return widgets.get(int(value[_rank.SHOW_KEY]), value)
        return {k: swap_markers(v, widgets) for k, v in value.items()}
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(swap_markers(v, widgets) for v in value)
    if isinstance(value, list):
        return [swap_markers(v, widgets) for v in value]
    return value


def load_rank_trace(data: bytes) -> Trace:
    """A rank's trace from the bytes of ``trace.save``: JSON and ``.npy`` only, no pickle."""
    with tempfile.TemporaryDirectory(prefix="shardviz-") as d:
        path = os.path.join(d, "rank.svtrace")
        with open(path, "wb") as f:
            f.write(data)
        return load_trace(path, tensor=from_values)


def tagged(rank: int, text: str) -> str:
    lines = text.splitlines()
    return "".join(f"[rank {rank}] {line}\n" for line in lines)


def show_outputs(runs: Sequence[RankRun], widgets: Mapping[int, Any]) -> None:
    """Each rank's stdout, stderr and displays, in rank order; ``sv.show`` markers as widgets."""
    from IPython.display import display, publish_display_data

    for r in runs:
        if r.stdout:
            sys.stdout.write(tagged(r.rank, r.stdout))
        if r.stderr:
            sys.stderr.write(tagged(r.rank, r.stderr))
    sys.stdout.flush()
    shown: set[int] = set()
    for r in runs:
        for out in r.outputs:
            data = out.get("data") or {}
            if _rank.SHOW_MIME in data:
                sid = int(data[_rank.SHOW_MIME]["id"])
                if sid not in shown and sid in widgets:
                    shown.add(sid)
                    display(widgets[sid])
                continue
            publish_display_data(data, out.get("metadata") or {})


def gather_shows(runs: Sequence[RankRun]) -> dict[int, Any]:
    """Every ``sv.show`` of the call: all ranks' payloads of one id drawn as one widget."""
    ids = sorted({i for r in runs if r.result for i in (r.result.get("shows") or {})})
    out = {}
    for i in ids:
        payloads = {
            r.rank: r.result["shows"][i] for r in runs if r.result and i in (r.result.get("shows") or {})
        }
        out[i] = draw_show(payloads)
    return out
