"""``pytest --shardviz-traces DIR``: a failing test that ran under torch's LocalTensorMode leaves
its trace and an offline player in DIR, a passing one nothing (tests/unit/harness_tests.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import shardviz as sv
from shardviz.pytest_plugin import file_stem

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("harness_tests.py")
CLASS = "RedistributeTestWithLocalTensor"


def run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    shutil.copy(HARNESS, folder / "test_harness.py")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
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
    assert "2 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
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


@pytest.mark.timeout(300)
def test_without_the_option_nothing_is_recorded(tmp_path):
    proc = run_pytest(tmp_path, "test_harness.py")
    assert proc.returncode == 1 and "2 failed, 1 passed" in proc.stdout, proc.stdout[-3000:]
    assert not (tmp_path / "traces").exists()
    assert "shardviz traces" not in proc.stdout


def test_test_ids_become_file_names():
    assert (
        file_stem("tests/unit/test_a.py::TestX::test_y[1-x/y]") == "tests.unit.test_a.py--TestX--test_y-1-x.y"
    )
    long = file_stem("t.py::" + "x" * 300)
    assert len(long) == 143 and long != file_stem("t.py::" + "x" * 299 + "z")
