"""Build the documentation site: ``make docs``, ``make docs-serve`` and the tests all build it here.

Warnings are errors (``-W``, with ``--keep-going`` so that one build lists them all) and every
cross-reference into shardviz is checked (``-n``). The source folder is the repository (see
``docs/conf.py``); the site goes to ``OUT/html`` and Sphinx's cache to ``OUT/doctrees``, so a
second build only rereads what changed. ``--fresh`` ignores the cache (the tests time a fresh build).

    python docs/build_site.py [--out build/docs] [--fresh] [--budget SECONDS]

It prints how long the build took; with ``--budget`` a build that takes longer fails, which is how CI
notices the site growing slow.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command(out: Path, fresh: bool = False) -> list[str]:
    """The sphinx-build command line for a site in ``out/html``."""
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]
    cmd += ["-c", str(ROOT / "docs"), "-d", str(out / "doctrees")]
    if fresh:
        cmd.append("-E")
    return [*cmd, str(ROOT), str(out / "html")]


def build(out: Path, fresh: bool = False) -> tuple[int, float]:
    """Build the site; Sphinx's exit status and the seconds it took."""
    start = time.perf_counter()
    code = subprocess.call(command(out, fresh), cwd=ROOT)
    return code, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "docs", help="default: build/docs")
    parser.add_argument("--fresh", action="store_true", help="rebuild every page, ignoring the cache")
    parser.add_argument("--budget", type=float, default=None, help="fail past this many seconds")
    args = parser.parse_args(argv)
    print(f"building the site in {args.out / 'html'} ...", file=sys.stderr, flush=True)
    code, seconds = build(args.out, args.fresh)
    index = args.out / "html" / "index.html"
    if code != 0:
        print(f"docs: the build failed after {seconds:.1f} s (warnings are errors: above)", file=sys.stderr)
        return code
    print(f"docs: built in {seconds:.1f} s: {index}", file=sys.stderr)
    if args.budget is not None and seconds > args.budget:
        print(f"docs: the build took {seconds:.1f} s, over its budget ({args.budget:.0f} s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
