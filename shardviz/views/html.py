"""One self-contained HTML file per view, rendering with no kernel and no network.

ipywidgets' embed loads require.js and the widget manager from public CDNs and shows nothing
offline. Here the view's own ESM runs directly against a small stand-in model (static/standalone.js)
over the embedded state; anywidget commands are answered from replies computed at export time. Any
anywidget view can use it: the layout view now, the collective player later.
"""

from __future__ import annotations

import base64
import html as _html
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

STATIC = Path(__file__).parent / "static"

# No request can leave the page: scripts only inline or from blob: URLs made by the page itself.
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline' blob:; style-src 'unsafe-inline'; "
    "img-src data: blob:; font-src data:"
)

Response = tuple[str, Mapping[str, Any], Any, Sequence[bytes]]


def request_key(command: str, msg: Mapping[str, Any]) -> str:
    """The key a reply is stored under; standalone.js computes the same from the live request."""
    return json.dumps([command, msg], sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _b64(data: bytes | bytearray | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode("ascii")


def _script_json(obj: Any) -> str:
    # "</" would end the <script> element early; "<\/" is the same JSON string.
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).replace("</", "<\\/")


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
    """The HTML text of :func:`export`."""
    payload = {
        "view": view_name,
        "state": dict(state),
        "buffers": {k: _b64(v) for k, v in (buffers or {}).items()},
        "responses": [
            [request_key(cmd, msg), reply, [_b64(b) for b in bufs]] for cmd, msg, reply, bufs in responses
        ],
        "esm": esm,
    }
    host = (STATIC / "standalone.js").read_text(encoding="utf-8").replace("</", "<\\/")
    css = css.replace("</", "<\\/")
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{_html.escape(title)}</title>\n"
        f"<style>\nbody {{ margin: 12px; background: #fff; }}\n{css}\n</style>\n"
        "</head>\n<body>\n"
        f'<div id="shardviz-root" data-shardviz-export="{_html.escape(view_name, quote=True)}"></div>\n'
        f'<script type="application/json" id="shardviz-data">{_script_json(payload)}</script>\n'
        f'<script type="module">\n{host}\n</script>\n'
        "</body>\n</html>\n"
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
