"""``make docs-serve``: the site on http://127.0.0.1:PORT/, rebuilt whenever a source changes.

For reading the documentation while writing it: it builds the site (``docs/build_site.py``),
serves ``OUT/html`` on 127.0.0.1 only, and every second looks at the pages, the notebooks, the
benchmarks' README and the package's sources (docstrings); when one changed it rebuilds, and a
reload of the browser shows the new page. A build with warnings is reported and the last site
stays served (``make docs`` and ``make test`` fail on those warnings). Ctrl-C stops it.

    python docs/serve_site.py [--port 8000] [--out build/docs]
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import build_site  # beside this file

ROOT = build_site.ROOT
HOST = "127.0.0.1"


def sources() -> Iterator[Path]:
    """Every file a page is made from."""
    yield from (ROOT / "docs").rglob("*.md")
    yield ROOT / "docs" / "conf.py"
    yield from (ROOT / "notebooks").glob("*.ipynb")
    yield ROOT / "benchmarks" / "README.md"
    yield ROOT / "README.md"
    yield from (ROOT / "shardviz").rglob("*.py")


def stamp() -> dict[Path, float]:
    """Each source's modification time."""
    out = {}
    for p in sources():
        try:
            out[p] = p.stat().st_mtime
        except FileNotFoundError:  # removed while we looked
            pass
    return out


class QuietHandler(SimpleHTTPRequestHandler):
    """Serves files without a log line per request, which would bury the build's messages."""

    def log_message(self, format: str, *args: object) -> None:
        pass


def build(out: Path) -> None:
    code, seconds = build_site.build(out)
    if code == 0:
        print(f"docs-serve: built in {seconds:.1f} s", flush=True)
    else:
        print("docs-serve: the build has warnings (above; `make docs` fails on them); serving the last site")


def serve(port: int, out: Path) -> None:
    (out / "html").mkdir(parents=True, exist_ok=True)
    handler = functools.partial(QuietHandler, directory=str(out / "html"))
    try:
        server = ThreadingHTTPServer((HOST, port), handler)
    except OSError as e:
        sys.exit(
            f"docs-serve: cannot listen on {HOST}:{port} ({e}); another port: make docs-serve DOCS_PORT=..."
        )
    # Served from the start (the last site, if any, while the first build runs); shutdown() below
    # returns once serve_forever has.
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        seen = stamp()  # before building: an edit made during a build brings the next one
        build(out)
        print(f"docs-serve: http://{HOST}:{port}/ (rebuilt when a source changes; Ctrl-C stops)", flush=True)
        while True:
            time.sleep(1.0)
            now = stamp()
            if now != seen:
                paths = now.keys() | seen.keys()
                changed = sorted(str(p.relative_to(ROOT)) for p in paths if now.get(p) != seen.get(p))
                more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
                print(f"docs-serve: {', '.join(changed[:3])}{more} changed: rebuilding", flush=True)
                seen = now
                build(out)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "docs")
    args = parser.parse_args(argv)
    serve(args.port, args.out)


if __name__ == "__main__":
    main()
