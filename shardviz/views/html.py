"""One self-contained HTML file per view, rendering with no kernel and no network.

ipywidgets' embed loads require.js and the widget manager from public CDNs and shows nothing
offline. Here the view's own ESM runs directly against a small stand-in model (static/standalone.js)
over the embedded state; anywidget commands are answered from replies computed at export time. Any
anywidget view can use it: the layout view, the collective player and the model map do.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import markup

STATIC = Path(__file__).parent / "static"

Response = tuple[str, Mapping[str, Any], Any, Sequence[bytes]]


def request_key(command: str, msg: Mapping[str, Any]) -> str:
    """The key a reply is stored under; standalone.js computes the same from the live request."""
    return json.dumps([command, msg], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def render(
    view_name: str,
    state: Mapping[str, Any],
    buffers: Mapping[str, bytes] | None,
    esm: str,
    css: str,
    *,
    responses: Iterable[Response] = (),
    title: str = "shardviz",
) -> str:
    """The HTML text of :func:`export`.

    Everything the view shows travels as JSON in a data block (``markup.script_json``: no string
    in it can end or swallow the element); the only script is standalone.js, which imports the
    view's ESM from a blob: URL. The page's CSP allows exactly that script (by hash), blob:
    modules and the view's CSS, and no network.
    """
    payload = {
        "view": view_name,
        "state": dict(state),
        "buffers": {k: _b64(v) for k, v in (buffers or {}).items()},
        "responses": [
            [request_key(cmd, msg), reply, [_b64(b) for b in bufs]] for cmd, msg, reply, bufs in responses
        ],
        "esm": esm,
    }
    host = (STATIC / "standalone.js").read_text(encoding="utf-8")
    body = markup.join(
        [
            markup.element("div", {"id": "shardviz-root", "data-shardviz-export": view_name}),
            markup.data_block("shardviz-data", payload),
        ]
    )
    return markup.page(
        title,
        body,
        styles=[f"body {{ margin: 12px; background: #fff; }}\n{css}"],
        modules=[host],
        blob_modules=True,
    )


def export(
    view_name: str,
    state: Mapping[str, Any],
    buffers: Mapping[str, bytes] | None,
    esm: str,
    css: str,
    path: str | Path,
    *,
    responses: Iterable[Response] = (),
    title: str = "shardviz",
) -> Path:
    """Write one HTML file that draws the view from ``state`` with no kernel and no network.

    ``state`` holds the JSON traits, ``buffers`` the binary ones (they arrive in the ESM as
    DataViews, as in a live kernel). ``responses`` are (command, message, reply, reply buffers)
    tuples: the anywidget commands the page can still answer offline; others reject with
    "not included in this export".
    """
    out = Path(path)
    out.write_text(
        render(view_name, state, buffers, esm, css, responses=responses, title=title), encoding="utf-8"
    )
    return out
