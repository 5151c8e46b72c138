"""``import shardviz`` loads what the first call needs, not the pictures, widgets or recorder.

Checked in a fresh interpreter (this one has them loaded already): which modules ``import
shardviz`` put in ``sys.modules``, and that each public name still resolves to what it was.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("matplotlib", "anywidget", "ipywidgets", "shardviz.capture.recorder", "torch.distributed.tensor")


def _fresh(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_import_shardviz_loads_no_pictures_widgets_or_recorder():
    out = _fresh(
        "import sys, json, shardviz\n"
        f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))"
    )
    assert json.loads(out) == []


def test_every_public_name_resolves_after_a_bare_import():
    """Each name of ``__all__`` in a fresh process, in the order a user may touch them: a function
    named like its module (``record``, ``show``, ``diff``, ``compare``) stays the function after
    that module is imported, and ``dir()`` lists every name before any was used."""
    out = _fresh(
        "import json, types, shardviz as sv\n"
        "missing = sorted(set(sv.__all__) - set(dir(sv)))\n"
        "import shardviz.show, shardviz.record, shardviz.diff, shardviz.compare\n"
        "kinds = {n: type(getattr(sv, n)).__name__ for n in sv.__all__}\n"
        "print(json.dumps([missing, kinds]))"
    )
    missing, kinds = json.loads(out)
    assert missing == []
    assert {n: k for n, k in kinds.items() if k == "module"} == {}
    assert kinds["record"] == kinds["show"] == kinds["diff"] == kinds["compare"] == "function"
    assert kinds["Trace"] == "type" and kinds["__version__"] == "str"


def test_first_picture_in_a_fresh_process(tmp_path):
    """The README's first picture from a bare interpreter: a 4-rank DTensor drawn to PNG, loading
    matplotlib and no widget (anywidget, ipywidgets: every view's module imported when first drawn)."""
    png = tmp_path / "dt.png"
    out = _fresh(
        "import torch, shardviz as sv\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from torch.distributed.tensor import Shard, distribute_tensor\n"
        "sv.use('local', world_size=4)\n"
        "with sv.record():\n"
        "    mesh = init_device_mesh('cpu', (4,))\n"
        "    dt = distribute_tensor(torch.arange(30.0).reshape(10, 3), mesh, [Shard(0)])\n"
        f"sv.plot(dt).savefig({str(png)!r})\n"
        "import sys, json\n"
        f"print(json.dumps(sorted(m for m in {list(HEAVY)!r} if m in sys.modules)))"
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(out) == ["matplotlib", "shardviz.capture.recorder", "torch.distributed.tensor"]
