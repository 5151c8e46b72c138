"""Binder's files, checked statically (Binder images cannot be built offline)."""

from __future__ import annotations

import os
import re
import subprocess
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


def test_post_build_installs_what_make_demo_installs_and_is_executable():
    post = BINDER / "postBuild"
    assert os.access(post, os.X_OK)
    text = post.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    # the demo's extra, then torchtitan and PhysicsNeMo with --no-deps, pinned by the Makefile
    assert re.search(r"pip install .*-e \"\.\[notebook\]\"", text)
    assert re.search(r"pip install .*--no-deps \$\(make -s frameworks\)", text)
    made = subprocess.run(["make", "-s", "frameworks"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    demo = subprocess.run(["make", "-n", "demo", "VENV=/none"], cwd=ROOT, capture_output=True, text=True)
    for pin in made.stdout.split():
        assert pin in demo.stdout, pin
    assert "torchtitan==" in made.stdout and "nvidia-physicsnemo==" in made.stdout


def test_readme_badge_opens_the_tour():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"\(https://mybinder\.org/v2/gh/[\w.-]+/[\w.-]+/HEAD\?labpath=([\w./%-]+)\)", readme)
    assert m, "README needs a Binder launch badge"
    assert (ROOT / m.group(1)).is_file()
