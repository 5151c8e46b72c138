"""`make demo` from the README: it serves JupyterLab with token login on the given port."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
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
    assert not any(".[test]" in line for line in installs), proc.stdout
    # torchtitan (09) and PhysicsNeMo (10) without their dependencies, which would replace torch
    for name in ("torchtitan==", "nvidia-physicsnemo=="):
        (line,) = [line for line in installs if name in line]
        assert "--no-deps" in line, line


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
    assert names("titan") | names("physicsnemo") <= notebook  # what 09's and 10's imports need
    assert not notebook & {"pytest", "playwright", "ruff", "mypy", "nbval", "hypothesis", "build"}


DEMO_VENV = ROOT / "build" / "demo-venv"
FIND_TEST_TOOLS = "import importlib.util as u; print([m for m in ('pytest', 'nbval') if u.find_spec(m)])"


def listed_notebooks() -> list[str]:
    """The notebooks the tutorials page lists (the README links to it)."""
    text = (ROOT / "docs" / "tutorials.md").read_text()
    return re.findall(r"^\| \[`(\d\d_[a-z0-9_]+)`\]\(\.\./notebooks/\1\.ipynb\)", text, flags=re.M)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_every_notebook_the_tutorials_page_lists_runs_in_the_demo_environment(tmp_path):
    """The environment is built by the Makefile's own `make demo` rule (into build/demo-venv, kept
    while pyproject.toml is unchanged), and each notebook runs top to bottom in a kernel of it."""
    import json

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    build = subprocess.run(
        ["make", f"VENV={DEMO_VENV}", f"{DEMO_VENV}/.installed-demo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    python = DEMO_VENV / "bin" / "python"
    # Nothing of the test toolchain: the notebooks get no help from it.
    absent = subprocess.run(
        [python, "-c", FIND_TEST_TOOLS],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert absent.stdout.strip() == "[]", absent
    spec = tmp_path / "kernels" / "shardviz-demo"
    spec.mkdir(parents=True)
    argv = [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    kernel = {"argv": argv, "display_name": "demo", "language": "python"}
    (spec / "kernel.json").write_text(json.dumps(kernel))
    names = listed_notebooks()
    assert sorted(names) == sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    # nbval as `make test` would run them (outputs of `# NBVAL_CHECK_OUTPUT` cells compared), in a
    # kernel of the demo's environment; `make test` leaves notebooks/ to this test.
    paths = [f"notebooks/{name}.ipynb" for name in sorted(names)]
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--nbval-kernel-name=shardviz-demo",
            *paths,
        ],
        cwd=ROOT,
        env={**env, "JUPYTER_PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=3000,
    )
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
