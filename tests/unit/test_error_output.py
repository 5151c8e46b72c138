"""What a user sees when something fails: short tracebacks, and no rank tag on plain errors."""

from __future__ import annotations

import subprocess
import sys
import traceback
from pathlib import Path

import pytest

import shardviz as sv

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (((10, 3), (4,), ["S(2)"]), "placement 'S(2)' shards dim 2, but the tensor has 2 dim(s)"),
        (((10, 3), (4,), ["Q"]), "unknown placement 'Q'"),
        (((10, 3), (0,), ["R"]), "every mesh dim must be a positive int"),
        (((10, 3), (4,), ["R"], ("a", "b")), "give 1 non-empty string(s)"),
    ],
)
def test_a_wrong_layout_argument_raises_from_sv_layout(args, message):
    with pytest.raises((ValueError, TypeError)) as info:
        sv.layout(*args)
    assert message in str(info.value)
    frames = traceback.extract_tb(info.value.__traceback__)
    # This test's line and sv.layout's: none of the cached geometry's validators.
    assert [f.name for f in frames] == [test_a_wrong_layout_argument_raises_from_sv_layout.__name__, "layout"]


def test_a_wrong_placement_shows_a_short_traceback_in_a_notebook():
    from IPython.core.ultratb import VerboseTB

    try:
        sv.layout((10, 3), (4,), ["S(2)"])
    except ValueError as e:
        text = VerboseTB(theme_name="nocolor").text(type(e), e, e.__traceback__)
    lines = text.strip().splitlines()
    assert "lru_cache" not in text and "layout.py" not in text, text
    assert len(lines) <= 20, text  # was 45 lines, most of them the geometry's frames


@pytest.mark.timeout(120)
def test_a_plain_error_after_sv_use_has_no_rank_tag(tmp_path):
    script = "import shardviz as sv\nsv.use('local', world_size=4)\nraise ValueError('plain')\n"
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=100,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 1
    assert "ValueError: plain" in proc.stderr
    assert "[rank" not in proc.stderr, proc.stderr
