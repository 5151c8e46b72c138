"""Binder's files, checked statically (Binder images cannot be built offline)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BINDER = ROOT / "binder"


def test_runtime_is_a_supported_python():
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"


def test_requirements_pin_the_cpu_build_of_torch():
    lines = [ln.strip() for ln in (BINDER / "requirements.txt").read_text().splitlines()]
    reqs = [ln for ln in lines if ln and not ln.startswith("#")]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in reqs
    assert "torch==2.13.0" in reqs  # the CPU wheel from the index above, never a CUDA build
    assert any(r.startswith("jupyterlab") for r in reqs)


def test_post_build_installs_the_project_and_is_executable():
    post = BINDER / "postBuild"
    assert os.access(post, os.X_OK)
    text = post.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert re.search(r"pip install .*-e \"\.\[cluster\]\"", text)


def test_readme_badge_opens_the_tour():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"\(https://mybinder\.org/v2/gh/[\w.-]+/[\w.-]+/HEAD\?labpath=([\w./%-]+)\)", readme)
    assert m, "README needs a Binder launch badge"
    assert (ROOT / m.group(1)).is_file()
