"""Issue 27 item 1: ``sv.plot(...)`` as a cell's last expression shows a picture in a notebook
without ``%matplotlib inline``, and a plain script's matplotlib backend is left alone."""

from __future__ import annotations

import base64
import os
import subprocess
import sys

import pytest
from nbcells import run_cells

PNG = b"\x89PNG\r\n\x1a\n"


def pngs(outputs) -> list[bytes]:
    return [
        base64.b64decode(o.data["image/png"])
        for o in outputs
        if o.output_type in ("execute_result", "display_data") and "image/png" in o.data
    ]


@pytest.mark.timeout(180)
def test_plot_as_last_expression_shows_a_png(tmp_path):
    out = run_cells(
        [
            "import shardviz as sv",
            "sv.plot(sv.layout((4, 4), (2,), ['S(0)']))",
            "from shardviz.data.pipeline import Interval, Timeline\n"
            "sv.plot(Timeline((0,), (Interval(0, 0.0, 1.0, 'forward', 0, 0, 1, 'F0'),), (), 1.0))",
            "import matplotlib\nprint(matplotlib.get_backend())",
        ],
        tmp_path,
    )
    for i in (1, 2):
        images = pngs(out[i])
        assert len(images) == 1, out[i]
        assert images[0].startswith(PNG) and len(images[0]) > 1000


@pytest.mark.timeout(120)
def test_a_plain_script_keeps_its_backend():
    env = {"MPLBACKEND": "pdf", "PATH": "/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    code = (
        "import matplotlib\nbefore = matplotlib.get_backend()\n"
        "import shardviz as sv\nfig = sv.plot(sv.layout((4, 4), (2,), ['S(0)']))\n"
        "import matplotlib.figure\nassert isinstance(fig, matplotlib.figure.Figure)\n"
        "print(before == matplotlib.get_backend(), matplotlib.get_backend())"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "pdf"]
