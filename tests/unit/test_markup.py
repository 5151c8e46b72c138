"""Hostile strings in the markup the views write, no browser: the notebook ``text/html`` outputs,
the offline pages' embedded JSON and their Content-Security-Policy, and matplotlib's text.

Expectations are the hostile strings themselves (they must come back character for character)
and a policy written out by hand around hashes computed here with hashlib.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import matplotlib
import numpy as np
import pytest

import shardviz as sv
from shardviz.data.memory import MemoryTimeline
from shardviz.data.pipeline import Arrow, Interval, Timeline
from shardviz.views import markup
from shardviz.views.mpl import plot_layout, to_png

matplotlib.use("Agg")

PWN = "window.__pwned=1"
HOSTILE = [
    f'x"><script>{PWN}</script>',
    "<!--<script",
    f"</script><img src=x onerror={PWN}>",
    f"' onmouseover='{PWN}",
    "a\u2028b\u2029c & d",
    f"javascript:{PWN}",
]


def timeline(h: str) -> Timeline:
    """Two lanes, one forward each, one message between them, every string hostile."""
    intervals = (
        Interval(0, 0, 1, f"forward{h}", 0, 0, 10, f"F{h}"),
        Interval(1, 1, 2, h, 1, 0, 12, f"B{h}"),
    )
    return Timeline((0, 1), intervals, (Arrow(0, 1, 1, 1, 11, 12, h, 0, 0),), 2, busy={0: 1, 1: 1})


def memory(h: str) -> MemoryTimeline:
    return MemoryTimeline(
        world_size=2,
        events=(0, 1, None),
        bytes=np.array([[16, 32], [64, 32], [0, 0]]),
        peak=np.array([64, 32]),
        peak_event=(1, 0),
        counted=h,
        labels={0: f"label0 {h}", 1: f"label1 {h}"},
    )


def every_element(root: ET.Element) -> list[ET.Element]:
    return list(root.iter())


@pytest.mark.parametrize("h", HOSTILE)
def test_pipeline_text_html_keeps_hostile_names_as_text(h):
    bundle = sv.show(timeline(h), title=f"title {h}")._repr_mimebundle_()
    svg = ET.fromstring(bundle["text/html"])  # well-formed: nothing escaped an attribute
    assert [e.tag.split("}")[1] for e in every_element(svg)].count("script") == 0
    boxes = svg.findall(".//{*}g[@data-action-label]")
    assert [(b.get("data-action-label"), b.get("data-phase")) for b in boxes] == [
        (f"F{h}", f"forward{h}"),
        (f"B{h}", h),
    ]
    assert [b.find("{*}text").text for b in boxes] == [f"F{h}", f"B{h}"]
    assert boxes[1].find("{*}title").text == f"rank 1: {h}, stage 1, microbatch 0, steps 1-2"
    (arrow,) = svg.findall(".//{*}g[@data-src]")
    assert arrow.get("data-phase") == h
    assert svg.find("{*}text").text == f"title {h}"


@pytest.mark.parametrize("h", HOSTILE)
def test_memory_text_html_keeps_hostile_labels_as_text(h):
    bundle = sv.show(memory(h), title=f"title {h}")._repr_mimebundle_()
    svg = ET.fromstring(bundle["text/html"])
    assert [e.tag.split("}")[1] for e in every_element(svg)].count("script") == 0
    assert svg.find("{*}text").text == f"title {h}"
    tips = [g.find("{*}title").text for g in svg.findall(".//{*}g[@data-ranks]")]
    # rank 0 peaks (64 B) during event 1, rank 1 (32 B) during event 0
    assert [t.split("; start")[0] for t in tips] == [
        f"rank 0: peak 64 B during #1 label1 {h}",
        f"rank 1: peak 32 B during #0 label0 {h}",
    ]


def test_characters_no_page_may_hold_become_a_replacement_character(tmp_path):
    """A trace loaded from JSON may hold a lone surrogate or a NUL; the page still writes (as
    UTF-8) and parses, with U+FFFD in their place."""
    odd = "a\ud800b\x00c\x1bd"
    path = sv.export_html(timeline(odd), tmp_path / "odd.html", title=odd)
    text = path.read_text(encoding="utf-8")
    svg = ET.fromstring(re.search(r"<svg.*</svg>", text, re.S).group(0))
    assert svg.find("{*}text").text == "a\ufffdb\ufffdc\ufffdd"
    assert svg.findall(".//{*}g[@data-src]")[0].get("data-phase") == "a\ufffdb\ufffdc\ufffdd"
    # a widget page keeps the string as it is, in JSON escapes (the browser shows U+FFFD)
    lay = sv.layout((4,), (2,), ["S(0)"], (odd,))
    page = Page(sv.export_html(lay, tmp_path / "odd-layout.html", title=odd).read_text(encoding="utf-8"))
    (data,) = [body for attrs, body in page.scripts if attrs.get("type") == "application/json"]
    state = json.loads(data)["state"]
    assert state["geometry"]["mesh_dim_names"] == [odd] and state["title"] == odd


# ---- offline pages ----------------------------------------------------------------------------


class Page(HTMLParser):
    """The scripts, styles and CSP meta tag of a page, with each script's text as written."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=False)
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.styles: list[str] = []
        self.csp: list[str] = []
        self._open: tuple[str, dict[str, str | None]] | None = None
        self._text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "meta" and (a.get("http-equiv") or "").lower() == "content-security-policy":
            self.csp.append(a["content"] or "")
        if tag in ("script", "style"):
            self._open, self._text = (tag, a), []

    def handle_data(self, data):
        if self._open:
            self._text.append(data)

    def handle_endtag(self, tag):
        if self._open and tag == self._open[0]:
            text = "".join(self._text)
            if tag == "script":
                self.scripts.append((self._open[1], text))
            else:
                self.styles.append(text)
            self._open = None


def sha(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def hostile_layout_page(tmp_path: Path) -> tuple[str, str]:
    h = "".join(HOSTILE)
    lay = sv.layout((4, 6), (2, 2), ["S(0)", "S(1)"], (f"dp{h}", f"tp{h}"))
    return h, sv.export_html(lay, tmp_path / "layout.html", title=f"title {h}").read_text(encoding="utf-8")


def test_embedded_json_holds_no_markup_and_reads_back_every_string(tmp_path):
    h, text = hostile_layout_page(tmp_path)
    page = Page(text)
    (data,) = [body for attrs, body in page.scripts if attrs.get("type") == "application/json"]
    # Inside a script element only "<" can change the HTML parser's state ("</script", "<!--",
    # "<script"); U+2028/U+2029 end a line in older JavaScript. The block has none of them.
    for bad in ("<", ">", "&", "\u2028", "\u2029"):
        assert bad not in data
    state = json.loads(data)["state"]
    assert state["title"] == f"title {h}"
    assert state["geometry"]["mesh_dim_names"] == [f"dp{h}", f"tp{h}"]


def test_a_widget_page_allows_its_own_script_and_style_and_nothing_else(tmp_path):
    _, text = hostile_layout_page(tmp_path)
    page = Page(text)
    (module,) = [body for attrs, body in page.scripts if attrs.get("type") == "module"]
    (style,) = page.styles
    assert page.csp == [
        "default-src 'none'; base-uri 'none'; form-action 'none'; "
        f"script-src {sha(module)} blob:; style-src {sha(style)}"
    ]
    assert len(page.scripts) == 2  # the JSON data block and standalone.js


@pytest.mark.parametrize("kind", ["pipeline", "memory"])
def test_an_svg_page_runs_no_script_and_loads_nothing(tmp_path, kind):
    obj = timeline(HOSTILE[0]) if kind == "pipeline" else memory(HOSTILE[0])
    page = Page(sv.export_html(obj, tmp_path / "p.html").read_text(encoding="utf-8"))
    assert page.csp == ["default-src 'none'; base-uri 'none'; form-action 'none'"]
    assert page.scripts == [] and page.styles == []


def test_element_escapes_and_refuses_handlers():
    assert markup.element("text", {"x": 1, "data-n": "\"<&>'"}, "<b>&") == (
        """<text x="1" data-n="&quot;&lt;&amp;&gt;'">&lt;b&gt;&amp;</text>"""
    )
    nested = markup.element("g", {"skip": None}, markup.element("title", {}, "<i>"))
    assert nested == "<g><title>&lt;i&gt;</title></g>"
    with pytest.raises(ValueError, match="event handler"):
        markup.element("g", {"onload": "x"})
    with pytest.raises(ValueError, match="not a tag or attribute name"):
        markup.element("g", {'a"b': "x"})
    with pytest.raises(ValueError, match="swallow"):
        markup.page("t", markup.Markup(""), modules=["let a = '<!--';"])


# ---- matplotlib: "$" is a character, not mathtext -----------------------------------------------


def test_dollar_signs_in_names_draw_as_written():
    """matplotlib reads text between "$" as a formula: "$\\frac$" failed to draw (and with it the
    PNG of every widget's notebook output), "$x$" drew an italic x. Names are drawn as written."""
    names = ("$\\frac$", "$x$")
    lay = sv.layout((4, 4), (2, 2), ["S(0)", "S(1)"], names)
    fig = plot_layout(lay, title="cost $\\frac{a")
    assert to_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    with_dollar = [t for t in fig.findobj(matplotlib.text.Text) if "$" in t.get_text()]
    assert all(not t.get_parse_math() for t in with_dollar)
    drawn = " ".join(t.get_text() for t in with_dollar)
    assert "cost $\\frac{a" in drawn and "$x$" in drawn and "$\\frac$" in drawn
    data, _ = sv.show(lay, title="cost $\\frac{a")._repr_mimebundle_()
    assert base64.b64decode(data["image/png"])[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("kind", ["pipeline", "memory"])
def test_dollar_signs_in_timeline_labels_draw_as_written(kind):
    obj = timeline("$\\frac$") if kind == "pipeline" else memory("$\\frac$")
    fig = sv.plot(obj, title="$\\frac{")
    assert to_png(fig)[:8] == b"\x89PNG\r\n\x1a\n"
    with_dollar = [t for t in fig.findobj(matplotlib.text.Text) if "$" in t.get_text()]
    assert any(t.get_text().startswith("$\\frac{") for t in with_dollar)
    assert all(not t.get_parse_math() for t in with_dollar)
