"""The built wheel, installed (not editable), works on its own: an editable install would hide
package files that the wheel forgets (notes/testing.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SMOKE = """
import pathlib, sys
import shardviz as sv
assert pathlib.Path(sv.__file__).is_relative_to(pathlib.Path(sys.argv[1])), sv.__file__
lay = sv.layout((10, 3), (4,), ["S(0)"])
out = sv.export_html(lay, pathlib.Path(sys.argv[2]) / "layout.html")
text = out.read_text()
assert 'data-shardviz-view' in text and "export default" in text, "the view's ESM must be inlined"
print(lay.shard(3).shape)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_installed_wheel_renders_a_view(tmp_path, built_wheel):
    target = tmp_path / "site"
    wheel = built_wheel
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    # The dependencies come from this environment; shardviz itself only from the wheel.
    run = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            f"import sys; sys.path.insert(0, {str(target)!r}); exec({SMOKE!r})",
            str(target),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.strip().endswith("(1, 3)")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_installed_wheel_gives_pytest_the_traces_option(tmp_path, built_wheel):
    # Through the wheel's pytest11 entry point alone: no -p, no shardviz on the path but the wheel's.
    import shutil

    target = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(built_wheel),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "tests" / "unit" / "harness_tests.py", work / "test_harness.py")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--shardviz-traces",
            "out",
            "test_harness.py",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=work,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
    )
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert "shardviz traces of failing tests" in run.stdout, run.stdout[-3000:]
    assert sorted(p.suffix for p in (work / "out").iterdir()) == [".html", ".svtrace"]
