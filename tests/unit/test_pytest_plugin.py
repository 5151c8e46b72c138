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
from hypothesis import given
from hypothesis import strategies as st

import shardviz as sv
from shardviz.backends import session
from shardviz.pytest_plugin import FileNames, file_stem

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
    stem = file_stem(f"test_harness.py::{CLASS}::test_gather_fails")
    assert stem.startswith(f"test_harness.py--{CLASS}--test_gather_fails.")
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
    stem = file_stem("tests/unit/test_a.py::TestX::test_y[1-x/y]")
    assert stem.startswith("tests.unit.test_a.py--TestX--test_y-1-x.y.") and len(stem.split(".")[-1]) == 10
    long = file_stem("t.py::" + "x" * 300)
    assert len(long) == 130 + 11 and long != file_stem("t.py::" + "x" * 299 + "z")
    # ids that read alike (the cases that overwrote each other's files)
    alike = ["a/b", "a.b", "a b", "a-b", "\u00e9", "\u00fc", "x::y", "x--y", "", "/", ".."]
    assert len({file_stem(f"t.py::test[{i}]") for i in alike}) == len(alike)


# Test ids as pytest makes them (parametrize ids, escaping off included, class and file names).
_ID_PART = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40
)


@given(
    ids=st.lists(
        st.builds(lambda a, b: f"{a}::{b}", _ID_PART, _ID_PART), min_size=2, max_size=30, unique=True
    )
)
def test_distinct_test_ids_get_distinct_files_all_inside_the_folder(ids):
    names = FileNames()
    folder = Path("/traces")
    stems = [names(i) for i in ids]
    assert len(set(stems)) == len(ids)  # distinct ids: distinct files
    assert [names(i) for i in ids] == stems  # the same id: the same file, all session long
    for stem in stems:
        for suffix in (".svtrace", ".html", ".12.svtrace"):
            name = stem + suffix
            assert (folder / name).parent == folder and os.sep not in name and "\x00" not in name
            assert not name.startswith(".") and name.isascii() and len(name.encode()) <= 255


def test_the_rare_clash_of_two_short_hashes_still_gives_two_files(monkeypatch):
    names = FileNames()
    monkeypatch.setattr("shardviz.pytest_plugin.HASH_CHARS", 0)  # every short hash clashes
    first, second = names("t.py::test[a/b]"), names("t.py::test[a.b]")
    assert first != second and len(second.split(".")[-1]) == 64


# --- under bad input: ids that read alike, planted links, a bad folder, the plugin's own failure --

_ALIKE_IDS = ["a/b", "a.b", "a b", "a-b", "\u00e9", "\u00fc", "x::y", "x--y"]

_ALIKE_TESTS = """
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensorMode

IDS = {ids!r}


@pytest.fixture(scope="module", autouse=True)
def world():
    dist.init_process_group("fake", rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def communicate(value):
    with LocalTensorMode(2) as mode:
        dist.all_reduce(mode.rank_map(lambda r: torch.full((2,), float(value))))


@pytest.mark.parametrize("i", range(len(IDS)), ids=IDS)
def test_alike(i):
    communicate(i)
    assert False, "fails on purpose"


def test_passes():
    communicate(100)


def test_the_folder_is_taken_away():
    shutil.copytree("traces", "kept")  # what was saved so far, for the checks
    shutil.rmtree("traces")
    Path("traces").write_text("no longer a folder")


def test_fails_after_the_folder_is_gone():
    communicate(200)
    assert False, "fails on purpose too"
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ids_that_read_alike_links_and_a_broken_folder_lose_no_trace(tmp_path):
    (tmp_path / "test_alike.py").write_text(_ALIKE_TESTS.format(ids=_ALIKE_IDS))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\ndisable_test_id_escaping_and_forfeit_all_rights_to_community_support = true\n"
    )
    traces = tmp_path / "traces"
    traces.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = file_stem("test_alike.py::test_alike[a/b]")  # a predictable name, linked out of DIR
    for suffix in (".svtrace", ".html"):
        (traces / f"{planted}{suffix}").symlink_to(outside / f"victim{suffix}")
    (outside / "victim.html").write_text("mine")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_shardviz_pytest", "-W",
         "default", "--shardviz-traces", "traces", "test_alike.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "INTERNALERROR" not in out, out[-3000:]
    assert "9 failed, 2 passed" in out, out[-3000:]  # every test ran, to the end
    # The plugin's own failure (its folder taken away mid-session) is a warning and a summary line.
    assert "ShardvizPluginWarning" in out and "test_fails_after_the_folder_is_gone: trace not saved" in out
    assert (outside / "victim.html").read_text() == "mine" and not (outside / "victim.svtrace").exists()
    # Before the folder went, each failing test left its own trace, named in the summary once.
    listed = [line.split()[0] for line in proc.stdout.splitlines() if line.endswith("the player)")]
    assert len(listed) == len(set(listed)) == len(_ALIKE_IDS)
    for i, test_id in enumerate(_ALIKE_IDS):
        name = f"{file_stem(f'test_alike.py::test_alike[{test_id}]')}.svtrace"
        assert str(traces / name) in listed
        (ev,) = sv.load(tmp_path / "kept" / name).collectives()  # this test's own trace: its value
        np.testing.assert_array_equal(ev.inputs[0].values, [float(i)] * 2)
    kept = sorted(p.name for p in (tmp_path / "kept").iterdir())
    assert len(kept) == 2 * len(_ALIKE_IDS) and all(not (tmp_path / "kept" / n).is_symlink() for n in kept)
    assert traces.is_file()  # the user's test made it a file; nothing of the plugin's wrote there


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["a-file", "a-file/below", "/proc/shardviz-traces"])
def test_a_folder_that_cannot_hold_traces_is_one_usage_error_at_start_up(tmp_path, where):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert True\n")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "_shardviz_pytest",
         "--shardviz-traces", where, "test_one.py"],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=100,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, out[-2000:]
    errors = [line for line in out.splitlines() if line.startswith("ERROR:")]
    assert len(errors) == 1 and "--shardviz-traces" in errors[0], out[-2000:]
    assert "INTERNALERROR" not in out and "passed" not in out
    assert (tmp_path / "a-file").read_text() == "x"
