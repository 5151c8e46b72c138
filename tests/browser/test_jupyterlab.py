"""The tour as a user sees it: JupyterLab in Debian's Chromium, every cell run, widgets clicked.

One JupyterLab server for the session (its own settings and a copy of the notebooks, so the
repository is never written), stopped by PID. The page runs all cells of 01_tour, waits for the
layout view to draw one region per rank, clicks a rank, and checks the kernel saw the click.
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A JupyterLab server on 127.0.0.1 serving a copy of the notebooks; yields its base URL."""
    work = tmp_path_factory.mktemp("lab")
    root = work / "notebooks"
    shutil.copytree(NOTEBOOKS, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    settings = work / "settings" / "@jupyterlab" / "notebook-extension"
    settings.mkdir(parents=True)
    # Without it a "Select Kernel" dialog blocks Run All (notes/browser.md).
    (settings / "tracker.jupyterlab-settings").write_text(json.dumps({"autoStartDefaultKernel": True}))
    apputils = work / "settings" / "@jupyterlab" / "apputils-extension"
    apputils.mkdir(parents=True)
    (apputils / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    port = _free_port()
    log = open(work / "lab.log", "w")  # noqa: SIM115 - closed in the finalizer
    env = dict(
        os.environ,
        JUPYTER_RUNTIME_DIR=str(work / "runtime"),
        JUPYTER_CONFIG_DIR=str(work / "config"),
        JUPYTER_DATA_DIR=str(work / "data"),
    )
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        f"--port={port}",
        "--ip=127.0.0.1",
        "--allow-root",
        "--ServerApp.port_retries=0",
        "--IdentityProvider.token=",
        "--ServerApp.password=",
        f"--ServerApp.root_dir={root}",
        "--LabApp.extension_manager=readonly",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
        "--LabApp.expose_app_in_browser=True",
        f"--LabApp.user_settings_dir={work / 'settings'}",
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                pytest.fail(f"JupyterLab exited: {(work / 'lab.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/status", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not start: {(work / 'lab.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


KERNEL_IDLE = """() => {
    const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
    const ctx = w && w.sessionContext;
    const kernel = ctx && ctx.isReady && ctx.session && ctx.session.kernel;
    return !!(kernel && kernel.status === 'idle');
}"""


def run_all(page, notebook: str, lab_url: str) -> None:
    page.goto(f"{lab_url}/lab/tree/{notebook}")
    # Cells sent before the kernel is ready are dropped, not queued: wait for an idle kernel.
    page.wait_for_function(KERNEL_IDLE, timeout=120_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")


def run_code(page, source: str) -> str:
    """Append a code cell, run it in the notebook's kernel, and return its output text."""
    page.evaluate(
        """(source) => {
            const nb = window.jupyterapp.shell.currentWidget.content;
            nb.model.sharedModel.insertCell(nb.model.cells.length, {cell_type: 'code', source});
            nb.activeCellIndex = nb.model.cells.length - 1;
        }""",
        source,
    )
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-cell')")
    out = page.locator(".jp-Notebook .jp-Cell").last.locator(".jp-OutputArea-output")
    out.wait_for()
    page.wait_for_function(KERNEL_IDLE)
    return out.inner_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tour_in_jupyterlab(lab, page, artifacts):
    p = page.page
    p.set_default_timeout(90_000)
    run_all(p, "01_tour.ipynb", lab)
    view = p.locator("[data-shardviz-view='layout']").first
    view.wait_for()
    regions = view.locator("[data-rank]")
    assert {regions.nth(i).get_attribute("data-rank") for i in range(regions.count())} == {"0", "1", "2", "3"}
    player = p.locator("[data-shardviz-view='player']").first
    player.wait_for()
    p.wait_for_function(KERNEL_IDLE)

    # Click rank 2 in the first layout view: the kernel's widget sees it.
    view.locator(".sv-mesh [data-rank='2']").first.click()
    assert "selected: 2" in run_code(p, 'print("selected:", view.selected)')

    # Step the player with its buttons: the synced step reaches Python.
    player.scroll_into_view_if_needed()
    assert player.locator("[data-step]").first.get_attribute("data-step") == "0"
    player.locator("[data-action='next']").first.click()
    player.locator("[data-step='1']").first.wait_for()
    assert "player step: 1" in run_code(p, 'print("player step:", player.step)')
    player.locator("[data-action='prev']").first.click()
    player.locator("[data-step='0']").first.wait_for()
    player.locator("[data-action='last']").first.click()
    player.locator("[data-step='1']").first.wait_for()
    assert "player step: 1" in run_code(p, 'print("player step:", player.step)')

    p.screenshot(path=str(artifacts / "jupyterlab_tour.png"), full_page=True)
    view.scroll_into_view_if_needed()
    view.screenshot(path=str(artifacts / "jupyterlab_layout_view.png"))
    player.scroll_into_view_if_needed()
    player.screenshot(path=str(artifacts / "jupyterlab_player.png"))
    assert page.errors == [], page.errors


CONTENTS_PUT = """([name, content]) =>
    window.jupyterapp.serviceManager.contents.save(name, {type: 'file', format: 'text', content})
        .then(() => true)"""
CONTENTS_GET = """(name) =>
    window.jupyterapp.serviceManager.contents.get(name, {type: 'file', format: 'text', content: true})
        .then((m) => m.content)"""
# The notebook is opened as a widget the test holds, never found as "the current widget": a
# restored workspace can keep another tab current, and then another notebook was saved.
OPEN = """async (name) => {
    const w = await window.jupyterapp.commands.execute('docmanager:open', {path: name, factory: 'Notebook'});
    await w.context.ready;
    window.__svNotebook = w;
    return w.context.path;
}"""
# The kernel is up and has told the notebook its language: what JupyterLab writes on opening.
KERNEL_INFO_IN = """() => {
    const w = window.__svNotebook;
    const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
    return !!(kernel && kernel.status === 'idle' && w.content.model.getMetadata('language_info'));
}"""
SAVE = "() => window.__svNotebook.context.save().then(() => true)"
SAVED = "() => !window.__svNotebook.content.model.dirty"
CLOSE = """async () => {
    const w = window.__svNotebook;
    await w.sessionContext.shutdown();
    w.dispose();
    return true;
}"""


@pytest.mark.slow
@pytest.mark.timeout(900)  # a kernel per notebook: ~150 s on an idle 2-core machine
def test_opening_and_saving_each_notebook_changes_no_byte(lab, page):
    """JupyterLab sets the kernelspec and language_info when it opens a notebook (and autosaves):
    saved notebooks must already hold what it writes, or a demo leaves `git status` dirty."""
    p = page.page
    p.set_default_timeout(120_000)
    changed = []
    p.goto(f"{lab}/lab")
    p.wait_for_function("() => !!(window.jupyterapp && window.jupyterapp.serviceManager.isReady)")
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        original = path.read_text()
        name = f"roundtrip-{path.name}"
        p.evaluate(CONTENTS_PUT, [name, original])  # the page's own API: it holds the XSRF cookie
        assert p.evaluate(OPEN, name) == name
        p.wait_for_function(KERNEL_INFO_IN)
        p.evaluate(SAVE)
        p.wait_for_function(SAVED)
        saved = p.evaluate(CONTENTS_GET, name)
        p.evaluate(CLOSE)
        if saved != original:
            diff = difflib.unified_diff(
                original.splitlines(), saved.splitlines(), path.name, "saved", lineterm=""
            )
            changed.append("\n".join(list(diff)[:40]))
    assert not changed, "JupyterLab rewrote:\n" + "\n".join(changed)
