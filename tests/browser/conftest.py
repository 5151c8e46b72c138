"""One Chromium per test session (Debian's, through the playwright package), never a network.

Outside CI a missing Chromium skips these tests with the reason; with ``CI=true`` it fails them,
since .ci/run installs Chromium and a skipped browser test would hide a broken view.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("SHARDVIZ_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"browser tests must run in CI, but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        _unavailable(f"the playwright package is missing ({e}); pip install -e '.[test]'")
    if not Path(CHROMIUM).exists():
        _unavailable(
            f"Chromium is not at {CHROMIUM}: apt-get install -y chromium (never `playwright install`)"
        )
    pw = sync_playwright().start()
    try:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=ARGS, timeout=60_000)
    except Exception as e:
        pw.stop()
        _unavailable(f"Chromium at {CHROMIUM} did not start: {e}")
    yield b
    b.close()
    pw.stop()


class Page:
    """A fresh page that blocks every non-local request and collects errors."""

    def __init__(self, page: Any) -> None:
        self.page = page
        self.errors: list[str] = []
        self.blocked: list[str] = []
        page.on("pageerror", lambda e: self.errors.append(f"pageerror: {e}"))
        page.on(
            "console",
            lambda m: self.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None,
        )
        page.route("**/*", self._route)
        page.set_default_timeout(15_000)

    def _route(self, route: Any) -> None:
        url = route.request.url
        if url.startswith(("file://", "data:", "blob:", "http://127.0.0.1")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()


@pytest.fixture
def page(browser: Any) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1200, "height": 900})
    p = Page(context.new_page())
    yield p
    context.close()
