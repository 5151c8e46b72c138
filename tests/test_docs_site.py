"""The documentation site (``make docs``), built from scratch once per session, and checked.

Each check compares the built pages with an independent source: the names in
``shardviz.__all__``, the error classes found in the package's source, the links and anchors of
the pages themselves, the notebooks' saved outputs, the event classes and a saved trace file.
Sphinx already fails the build on a warning (``-W``); the crawl of the built pages below also
covers what Sphinx does not resolve itself (raw HTML, the README's links into ``docs/``).
"""

from __future__ import annotations

import ast
import dataclasses
import html
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import shardviz

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Seconds a fresh build may take. Measured: about 50 s alone on a 2-core machine; CI shares its
# 2 cores with nothing else, a developer's machine maybe with more.
BUDGET = float(os.environ.get("DOCS_BUILD_BUDGET", "240"))

pytestmark = pytest.mark.slow
SMART_QUOTES = {0x2019: "'", 0x201C: '"', 0x201D: '"'}  # what Sphinx makes of ' and "


@dataclasses.dataclass
class Site:
    html: Path
    returncode: int
    output: str
    seconds: float


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> Site:
    out = tmp_path_factory.mktemp("docs")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(DOCS / "build_site.py"), "--out", str(out), "--fresh"],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    return Site(out / "html", proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start)


def _pages(site: Site) -> list[Path]:
    return sorted(p for p in site.html.rglob("*.html") if "_static" not in p.parts)


class _Page(HTMLParser):
    """The ids and the outgoing references (tag, attribute value) of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.refs: list[tuple[str, str, str]] = []  # (tag, attribute, value)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("id", "name") and (name == "id" or tag == "a"):
                self.ids.add(value)
            if (tag, name) in {("a", "href"), ("link", "href"), ("img", "src"), ("script", "src")}:
                self.refs.append((tag, name, value))
            if tag == "iframe" and name == "src":
                self.refs.append((tag, name, value))


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.mark.timeout(960)
def test_the_site_builds_with_no_warning_within_its_budget(site):
    assert site.returncode == 0, f"the docs build failed (warnings are errors):\n{site.output[-6000:]}"
    assert "WARNING" not in site.output and "ERROR" not in site.output, site.output[-6000:]
    assert (site.html / "index.html").is_file() and (site.html / "docs" / "index.html").is_file()
    assert site.seconds < BUDGET, (
        f"a fresh build of the site took {site.seconds:.0f} s, over its budget of {BUDGET:.0f} s "
        "(DOCS_BUILD_BUDGET): find what grew (python docs/build_site.py --fresh prints the time)"
    )


def test_every_page_is_built(site):
    notebooks = (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")
    sources = [p.relative_to(ROOT).with_suffix(".html") for p in [*DOCS.rglob("*.md"), *notebooks]]
    sources.append(Path("benchmarks/README.html"))
    missing = [str(p) for p in sources if not (site.html / p).is_file()]
    assert not missing, missing


def test_every_internal_link_and_anchor_resolves(site):
    pages = {p: _parse(p) for p in _pages(site)}
    broken = []
    for path, page in pages.items():
        for tag, attr, value in page.refs:
            url = urlsplit(value)
            if url.scheme or url.netloc or value.startswith(("mailto:", "data:")):
                continue
            target = (path.parent / unquote(url.path)).resolve() if url.path else path
            if not target.is_file():
                broken.append(f"{path.relative_to(site.html)}: <{tag} {attr}={value!r}>: no such file")
                continue
            if url.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else _parse(target).ids
                if unquote(url.fragment) not in ids:
                    broken.append(f"{path.relative_to(site.html)}: {value!r}: no id {url.fragment!r} there")
    assert not broken, "\n".join(broken[:50])


def test_nothing_is_loaded_from_the_network(site):
    remote = []
    for path in _pages(site):
        for tag, attr, value in _parse(path).refs:
            # A link (<a>) is followed only when clicked; anything else is loaded with the page.
            if tag != "a" and (urlsplit(value).scheme or value.startswith("//")):
                remote.append(f"{path.relative_to(site.html)}: <{tag} {attr}={value}>")
    for css in (site.html / "_static").rglob("*.css"):
        for url in re.findall(r"url\(\s*['\"]?(https?:)?//", css.read_text(errors="replace")):
            remote.append(f"{css.relative_to(site.html)}: url({url}//...)")
    for js in (site.html / "_static").rglob("*.js"):
        text = js.read_text(errors="replace")
        if re.search(r"""(import|fetch)\s*\(\s*['"]https?://""", text):
            remote.append(f"{js.relative_to(site.html)} loads a URL")
    assert not remote, "\n".join(remote)


def _inventory(site: Site) -> dict[str, tuple[str, str]]:
    """name -> (role, uri) from the site's objects.inv (four header lines, then zlib-compressed
    lines ``name domain:role priority uri display-name``, ``$`` in a uri standing for the name)."""
    raw = (site.html / "objects.inv").read_bytes()
    header = raw.split(b"\n", 4)
    assert header[0] == b"# Sphinx inventory version 2", header[0]
    out = {}
    for line in zlib.decompress(header[4]).decode().splitlines():
        m = re.match(r"(.+?)\s+(\S+:\S+)\s+(-?\d+)\s+(\S*)\s+(.*)", line)
        assert m, line
        name, role, _, uri, _ = m.groups()
        out[name] = (role, uri.replace("$", name) if uri.endswith("$") else uri)
    return out


def _entry_text(site: Site, uri: str) -> str:
    """The text of a reference entry's description (its <dd>), from its page and anchor."""
    page, _, anchor = uri.partition("#")
    text = (site.html / page).read_text(encoding="utf-8")
    m = re.search(rf'<dt[^>]*\bid="{re.escape(anchor)}"[^>]*>.*?</dt>\s*<dd>(.*?)</dd>', text, re.S)
    assert m, f"no entry {anchor} in {page}"
    return html.unescape(re.sub(r"<[^>]+>", "", m.group(1)))


def test_every_public_name_has_a_reference_entry_with_a_docstring(site):
    inventory = _inventory(site)
    missing, empty = [], []
    for name in shardviz.__all__:
        full = f"shardviz.{name}"
        if full not in inventory:
            missing.append(full)
            continue
        _, uri = inventory[full]
        assert uri.startswith("docs/reference/api.html#"), (full, uri)
        # The docstring's first words are in the entry (its own text, not a signature alone).
        obj = getattr(shardviz, name)
        doc = "The installed shardviz's version" if name == "__version__" else (obj.__doc__ or "")
        first = " ".join(re.sub(r"``?", "", doc).split()[:4])
        text = " ".join(_entry_text(site, uri).split())
        text = text.translate(SMART_QUOTES)  # Sphinx's smart quotes
        if not first or first not in text:
            empty.append(f"{full}: {first!r} not in its entry")
    assert not missing, f"public names without a reference entry in docs/reference/api.md: {missing}"
    assert not empty, empty


def _error_classes() -> set[str]:
    """Every class in shardviz's source that derives from ShardvizError or from a Warning."""
    bases: dict[str, list[str]] = {}
    for path in (ROOT / "shardviz").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                names = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                bases[node.name] = names

    def counts(name: str, seen: frozenset[str] = frozenset()) -> bool:
        if name in ("ShardvizError", "Warning") or (name.endswith("Warning") and name not in bases):
            return True
        return name not in seen and any(counts(b, seen | {name}) for b in bases.get(name, []))

    return {name for name in bases if counts(name)}


def test_every_error_and_warning_has_a_reference_entry(site):
    documented = {name.rsplit(".", 1)[-1] for name, (role, uri) in _inventory(site).items()}
    errors = _error_classes()
    assert {"ShardvizError", "TraceFileError", "RankError", "SimulationWarning"} <= errors  # the finder works
    assert not errors - documented, f"add these to docs/reference/errors.md: {sorted(errors - documented)}"


def test_every_notebook_is_rendered_with_its_saved_pictures(site):
    for nb_path in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(nb_path.read_text())
        pictures = sum(
            "image/png" in out.get("data", {}) for cell in nb["cells"] for out in cell.get("outputs", [])
        )
        page = site.html / "notebooks" / f"{nb_path.stem}.html"
        text = page.read_text(encoding="utf-8")
        images = [src for tag, _, src in _parse(page).refs if tag == "img"]
        assert len(images) == pictures, f"{nb_path.name}: {pictures} saved pictures, {len(images)} shown"
        assert all((page.parent / src).is_file() for src in images)
        assert "widget-view+json" not in text  # a widget is its picture, never a script wanting a kernel
        title = next(c for c in nb["cells"] if c["cell_type"] == "markdown")["source"]
        plain = html.unescape(re.sub(r"<[^>]+>", "", text)).translate(SMART_QUOTES)
        assert "".join(title).splitlines()[0].lstrip("# ").replace("`", "") in plain


def test_the_benchmarks_page_is_the_benchmarks_readme(site):
    text = (ROOT / "benchmarks" / "README.md").read_text()
    table_lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [line.split("|")[1].strip() for line in table_lines]
    page = (site.html / "benchmarks" / "README.html").read_text(encoding="utf-8")
    plain = html.unescape(re.sub(r"<[^>]+>", "", page)).translate(SMART_QUOTES)
    rows = [re.sub(r"`", "", r) for r in rows if r]
    assert len(rows) > 10
    assert [r for r in rows if r not in plain] == []


def test_the_readme_links_into_the_docs_resolve(site):
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    local = [link for link in links if not urlsplit(link).scheme]
    assert len(local) > 20
    broken = []
    for link in local:
        path, _, fragment = link.partition("#")
        if not (ROOT / path).exists():
            broken.append(f"{link}: no such file")
            continue
        if fragment:
            built = site.html / Path(path).with_suffix(".html")
            if fragment not in _parse(built).ids:
                broken.append(f"{link}: no id {fragment!r} in {built.relative_to(site.html)}")
    assert not broken, broken


def test_the_readme_example_links_every_shardviz_call_it_makes(site):
    text = (ROOT / "README.md").read_text()
    example = text[text.index("## A first example") : text.index("## Documentation")]
    called = set(re.findall(r"\bsv\.(\w+)\(", example))
    linked = set(re.findall(r"\[`sv\.(\w+)`\]\(docs/reference/api\.md#sv\1\)", example))
    assert called and called <= linked, f"calls without a link to their reference: {called - linked}"


def _table(text: str, heading: str) -> set[str]:
    """The first column's names of the table under ``heading`` on a page."""
    section = text[text.index(heading) + len(heading) :]
    section = section[: section.find("\n#")] if "\n#" in section else section
    return set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.M))


def test_the_trace_format_page_lists_every_field(tmp_path):
    from shardviz.data import events

    text = (DOCS / "reference" / "trace-format.md").read_text()
    common = {f.name for f in dataclasses.fields(events.Event)}
    assert _table(text, "## Events\n") == common
    for kind, cls in events.EVENT_TYPES.items():
        own = {f.name for f in dataclasses.fields(cls)} - common
        assert _table(text, f'### kind "{kind}"\n') == own, kind
    trace = shardviz.plan((8, 8), (2, 2), ["S(0)", "R"], ["R", "R"])
    trace.save(tmp_path / "t.svtrace")
    import zipfile

    with zipfile.ZipFile(tmp_path / "t.svtrace") as z:
        doc = json.loads(z.read("trace.json"))
    assert _table(text, "## trace.json\n") == set(doc)
    snapshot_fields = {"shape", "dtype", "values", "summary"}
    assert _table(text, "## Snapshots\n") == snapshot_fields
    layout = shardviz.layout((4, 2), (2,), ["S(0)"]).to_dict()
    assert _table(text, "## Layouts\n") == set(layout) | {"groups"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(300)
def test_docs_serve_serves_the_site_on_localhost_only(site, tmp_path):
    import psutil

    out = site.html.parent  # the fresh build: serving rebuilds only what changed since
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, str(DOCS / "serve_site.py"), "--port", str(port), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "docs-serve: http://" in line:
                break
        assert f"http://127.0.0.1:{port}/" in "".join(lines), "".join(lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/docs/index.html", timeout=10) as r:
            assert r.status == 200 and b"Where to go" in r.read()
        listening = [
            c.laddr for c in psutil.Process(proc.pid).net_connections() if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(a.ip == "127.0.0.1" for a in listening), listening
        # A second server on the same port says so and names the way out.
        second = subprocess.run(
            [sys.executable, str(DOCS / "serve_site.py"), "--port", str(port), "--out", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert second.returncode != 0 and "DOCS_PORT" in second.stderr, second.stderr
        # An edited page is rebuilt (its modification time is what is watched).
        page = DOCS / "tutorials.md"
        os.utime(page)
        for line in proc.stdout:
            lines.append(line)
            if "docs-serve: built in" in line or "has warnings" in line:
                break
        said = "".join(lines)
        _, rebuilding, after = said.partition("docs/tutorials.md changed: rebuilding")
        assert rebuilding and "docs-serve: built in" in after, said
    finally:
        proc.terminate()
        proc.wait(timeout=30)
