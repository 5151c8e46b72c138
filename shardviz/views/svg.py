"""What the static SVG views share: the SVG in a notebook, the text elsewhere, one offline page."""

from __future__ import annotations

from html import escape
from pathlib import Path
from typing import Any


class SvgView:
    """A view drawn once as SVG markup: no kernel, widget runtime or script needed to show it.

    Subclasses set ``page_title`` and ``svg()``; ``str(self.data)`` is the text form."""

    page_title = "shardviz"

    def __init__(self, data: Any, title: str | None = None) -> None:
        self.data = data
        self.title = title

    def svg(self) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return str(self.data)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, str]:
        return {"text/plain": repr(self), "text/html": self.svg()}

    def export_html(self, path: str | Path) -> Path:
        """One self-contained HTML file: the SVG and the text, no script, no network."""
        path = Path(path)
        path.write_text(
            f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(self.page_title)}</title>"
            f"</head><body>{self.svg()}<pre>{escape(str(self.data))}</pre></body></html>",
            encoding="utf-8",
        )
        return path
