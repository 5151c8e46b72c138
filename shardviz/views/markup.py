"""The one way strings reach HTML and SVG markup: every view's markup is built here.

Names of modules, ops, mesh dims, notes and sources come from traces, which may be files from
anywhere; a name like ``x"><script>`` must show as that text, never run. So no view formats a
string into markup itself: ``element`` escapes every attribute value and text child, ``escape``
is the same escaping for a string alone, ``script_json`` is JSON safe to put in a ``<script>``
element, and ``page`` writes a whole offline page with a Content-Security-Policy that lets only
its own scripts and styles run and lets nothing reach the network.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any


class Markup(str):
    """Text that is markup already (escaped, or built by :func:`element`): escaped no further."""

    __slots__ = ()


# Characters no HTML or XML text may hold (controls, lone surrogates, noncharacters): shown as
# U+FFFD, so the page stays well-formed, writes as UTF-8, and an SVG saved alone parses as XML.
_UNFIT = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff\ufffe\uffff]")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]*\Z")
_VOID = frozenset({"meta", "link", "br", "hr", "img", "input"})
# element() quotes every attribute value with '"', so "'" needs no escape (a CSP stays readable).
_ESCAPES = str.maketrans({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"})


def escape(value: object) -> Markup:
    """``value`` as text that is safe in element content and in a double-quoted attribute value."""
    if isinstance(value, Markup):
        return value
    return Markup(_UNFIT.sub("\ufffd", str(value)).translate(_ESCAPES))


def element(tag: str, attrs: Mapping[str, object] | None = None, *children: object) -> Markup:
    """``<tag attr="value">children</tag>``: values and plain-string children are escaped,
    :class:`Markup` children are nested as they are; an attribute whose value is None is left out."""
    _check_name(tag)
    parts = [f"<{tag}"]
    for name, value in (attrs or {}).items():
        _check_name(name)
        if name.lower().startswith("on"):
            raise ValueError(f"event handler attribute {name!r}: markup here carries no script")
        if value is not None:
            parts.append(f' {name}="{escape(value)}"')
    parts.append(">")
    if tag in _VOID:
        if children:
            raise ValueError(f"<{tag}> holds no content")
        return Markup("".join(parts))
    parts.extend(escape(c) for c in children)
    parts.append(f"</{tag}>")
    return Markup("".join(parts))


def join(items: Iterable[object]) -> Markup:
    """Several children as one piece of markup (plain strings escaped)."""
    return Markup("".join(escape(i) for i in items))


def script_json(obj: Any) -> str:
    """JSON that is inert inside ``<script type="application/json">``.

    Inside a script element the HTML parser ends the element at ``</script`` and changes state at
    ``<!--`` and ``<script``, whatever the JavaScript means, so ``<``, ``>`` and ``&`` become
    ``\\u003c`` ``\\u003e`` ``\\u0026`` (the same strings to JSON.parse). ``ensure_ascii`` writes
    every other non-ASCII character, U+2028 / U+2029 and lone surrogates included, as an escape.
    """
    text = json.dumps(obj, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _raw(kind: str, text: str) -> str:
    """The text of an inline <script> or <style>: it must not end or escape its element early."""
    low = text.lower()
    for bad in (f"</{kind}", "<!--", "<script"):
        if bad in low:
            raise ValueError(f"inline <{kind}> text holds {bad!r}, which would end or swallow its element")
    return text


def csp_hash(text: str) -> str:
    """The CSP source expression that allows exactly one inline script or style: its sha256."""
    digest = base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii")
    return f"'sha256-{digest}'"


def csp(scripts: Iterable[str] = (), styles: Iterable[str] = (), *, blob_modules: bool = False) -> str:
    """A policy under which nothing loads from anywhere: the page's own inline scripts and styles
    (by hash) run, and, with ``blob_modules``, the modules its script makes as blob: URLs."""
    directives = ["default-src 'none'", "base-uri 'none'", "form-action 'none'"]
    script_src = [csp_hash(s) for s in scripts] + (["blob:"] if blob_modules else [])
    if script_src:
        directives.append("script-src " + " ".join(script_src))
    style_src = [csp_hash(s) for s in styles]
    if style_src:
        directives.append("style-src " + " ".join(style_src))
    return "; ".join(directives)


def page(
    title: str,
    body: Markup,
    *,
    styles: Iterable[str] = (),
    modules: Iterable[str] = (),
    blob_modules: bool = False,
) -> str:
    """One offline HTML document: ``body`` (markup), then each of ``modules`` as an inline module
    script, with a Content-Security-Policy that allows those scripts and ``styles`` and nothing
    else. Scripts and styles are the package's own files; data goes in the body, through
    :func:`element` or :func:`data_block`."""
    style_list = [_raw("style", s) for s in styles]
    module_list = [_raw("script", s) for s in modules]
    head = join(
        [
            Markup('<meta charset="utf-8">'),
            element(
                "meta",
                {
                    "http-equiv": "Content-Security-Policy",
                    "content": csp(module_list, style_list, blob_modules=blob_modules),
                },
            ),
            element("meta", {"name": "viewport", "content": "width=device-width, initial-scale=1"}),
            element("title", {}, title),
            *(Markup(f"<style>{s}</style>") for s in style_list),
        ]
    )
    scripts = "".join(f'<script type="module">{s}</script>\n' for s in module_list)
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n{head}\n</head>\n'
        f"<body>\n{body}\n{scripts}</body>\n</html>\n"
    )


def data_block(element_id: str, obj: Any) -> Markup:
    """``obj`` as JSON in a ``<script type="application/json">`` element (data, never run)."""
    _check_name(element_id)
    return Markup(f'<script type="application/json" id="{element_id}">{script_json(obj)}</script>')


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{name!r} is not a tag or attribute name")
