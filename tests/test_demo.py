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
