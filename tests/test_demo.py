"""`make demo` from the README: it serves JupyterLab with token login on the given port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_make_demo_serves_jupyterlab(tmp_path):
    port = free_port()
    log = tmp_path / "demo.log"
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"), JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"))
    with open(log, "w") as out:
        proc = subprocess.Popen(
            ["make", "demo", f"PORT={port}"],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        url = None
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and url is None:
            assert proc.poll() is None, log.read_text()
            m = re.search(rf"(http://127\.0\.0\.1:{port}/lab\S*\?token=\w+)", log.read_text())
            url = m.group(1) if m else None
            time.sleep(0.5)
        assert url, log.read_text()
        # Without the token the server asks for a login; with it, JupyterLab's page arrives.
        token = url.split("token=")[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}") as r:
            assert r.status == 200
        with urllib.request.urlopen(url) as r:
            page = r.read().decode()
        assert "JupyterLab" in page
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents")
        assert e.value.code == 403
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.timeout(60)
def test_make_demo_installs_the_notebook_extra_not_the_test_toolchain(tmp_path):
    # A dry run into a venv that does not exist yet: the commands a fresh machine would run.
    proc = subprocess.run(
        ["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    installs = [line for line in proc.stdout.splitlines() if "pip install" in line]
    assert any('-e ".[notebook]"' in line for line in installs), proc.stdout
    assert not any(".[test]" in line or "torchtitan" in line for line in installs), proc.stdout


def test_the_notebook_extra_has_what_the_notebooks_need_and_no_test_tools():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        out: set[str] = set()
        for req in extras[extra]:
            m = re.match(r"shardviz\[([\w,]+)\]", req)
            if m:
                for sub in m.group(1).split(","):
                    out |= names(sub)
            else:
                out.add(re.split(r"[<>=!; \[]", req)[0].lower())
        return out

    notebook = names("notebook")
    assert {"jupyterlab", "ipykernel", "ipyparallel"} <= notebook  # 06_real_mesh starts gloo engines
    assert not notebook & {"pytest", "playwright", "ruff", "mypy", "nbval", "hypothesis", "build"}
