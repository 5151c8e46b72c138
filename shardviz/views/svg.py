"""What the static SVG views share: the SVG in a notebook, the text elsewhere, one offline page."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import markup


class SvgView:
    """A view drawn once as SVG markup: no kernel, widget runtime or script needed to show it.

    Subclasses set ``page_title`` and ``svg()`` (built with ``markup.element``, so every string
    from the data is escaped); ``str(self.data)`` is the text form."""

    page_title = "shardviz"

    def __init__(self, data: Any, title: str | None = None) -> None:
        self.data = data
        self.title = title

    def svg(self) -> markup.Markup:
        raise NotImplementedError

    def __repr__(self) -> str:
        return str(self.data)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, str]:
        return {"text/plain": repr(self), "text/html": str(self.svg())}

    def export_html(self, path: str | Path) -> Path:
        """One self-contained HTML file: the SVG and the text. It has no script, and its
        Content-Security-Policy runs none and loads nothing."""
        path = Path(path)
        body = markup.join([self.svg(), markup.element("pre", {}, str(self.data))])
        path.write_text(markup.page(self.page_title, body), encoding="utf-8")
        return path
