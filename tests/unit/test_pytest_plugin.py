"""``pytest --shardviz-traces DIR``: a failing test that ran under torch's LocalTensorMode leaves
its trace and an offline player in DIR, a passing one nothing (tests/unit/harness_tests.py)."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import unittest
from pathlib import Path

import harness_tests
import numpy as np
import pytest

import shardviz as sv
from shardviz.backends import session
from shardviz.pytest_plugin import file_stem

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("harness_tests.py")
CLASS = "RedistributeTestWithLocalTensor"


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(HARNESS, folder / "test_harness.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT), HARNESS_OUTCOME=str(folder / "recorded.txt"))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_shardviz_pytest", *args],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


@pytest.mark.timeout(300)
def test_a_failing_harness_test_leaves_its_trace_and_player(tmp_path):
    proc = run_pytest(tmp_path, "--shardviz-traces", "traces", "test_harness.py")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "2 failed, 2 passed" in proc.stdout, proc.stdout[-3000:]
    stem = f"test_harness.py--{CLASS}--test_gather_fails"
    # The passing test, and the failing one that communicated nothing, leave nothing.
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == [f"{stem}.html", f"{stem}.svtrace"]
    assert f"traces/{stem}.svtrace" in proc.stdout  # named in the terminal summary
    assert "test_fails_before_any_collective: ran under LocalTensorMode but recorded no event" in proc.stdout

    trace = sv.load(tmp_path / "traces" / f"{stem}.svtrace")
    ops = [(e.kind, getattr(e, "op", None)) for e in trace.events]
    assert ("collective", "scatter") in ops and ("redistribute", None) in ops
    (gather,) = [e for e in trace.events if getattr(e, "op", None) == "all_gather"]
    assert gather.groups == ((0, 1, 2, 3),)
    for rank in range(4):  # every rank gathers the whole arange(8)
        np.testing.assert_array_equal(gather.inputs[rank].values, np.arange(8.0)[2 * rank : 2 * rank + 2])
        np.testing.assert_array_equal(gather.outputs[rank].values, np.arange(8.0))
    html = (tmp_path / "traces" / f"{stem}.html").read_text()
    assert "data-shardviz-view" in html and "all_gather" in html

    # The passive recording changed nothing: dist.reduce ends as it does with no recording at all.
    previous = session.peek()  # the harness makes its own default process group
    if previous is not None:
        previous.close()
        session.install(None)
    os.environ["HARNESS_OUTCOME"] = str(tmp_path / "plain.txt")
    try:
        test = harness_tests.RedistributeTestWithLocalTensor("test_reduce_runs_as_without_shardviz")
        assert unittest.TextTestRunner(stream=io.StringIO()).run(test).wasSuccessful()
    finally:
        del os.environ["HARNESS_OUTCOME"]
    assert (tmp_path / "recorded.txt").read_text() == (tmp_path / "plain.txt").read_text()


@pytest.mark.timeout(120)
def test_without_the_option_the_plugin_imports_nothing_heavy(tmp_path):
    (tmp_path / "test_light.py").write_text(
        "import sys\n\ndef test_light():\n    assert 'torch' not in sys.modules\n"
        "    assert 'shardviz' not in sys.modules\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "_shardviz_pytest",
            "test_light.py",
        ],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (
        "--shardviz-traces"
        in subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "_shardviz_pytest", "--help"],
            cwd=tmp_path,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=100,
        ).stdout
    )


def test_test_ids_become_file_names():
    assert (
        file_stem("tests/unit/test_a.py::TestX::test_y[1-x/y]") == "tests.unit.test_a.py--TestX--test_y-1-x.y"
    )
    long = file_stem("t.py::" + "x" * 300)
    assert len(long) == 143 and long != file_stem("t.py::" + "x" * 299 + "z")
