"""Bytes in words: one rule (``describe.bytes_text``) for every table and view, and the same rule in
the widgets' JavaScript (``bytesText`` in views/static/common.js), checked by running that JS."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from shardviz.data import cost, describe
from shardviz.data.limits import DEFAULTS, over
from shardviz.data.memory import MemoryTimeline

COMMON_JS = Path(describe.__file__).resolve().parents[1] / "views" / "static" / "common.js"

# Written by hand: exact below 1 KiB, then one decimal in the largest binary unit, ".0" dropped,
# rounded half up (0.5 B -> 1 B; 1.25 KiB -> 1.3 KiB).
CASES = {
    0: "0 B",
    1: "1 B",
    0.5: "1 B",
    768: "768 B",
    1023: "1023 B",
    1024: "1 KiB",
    1280: "1.3 KiB",
    1536: "1.5 KiB",
    1.75 * 2**20: "1.8 MiB",
    7 * 2**20: "7 MiB",
    2**30: "1 GiB",
    1.5 * 2**30: "1.5 GiB",
    3 * 2**40: "3 TiB",
    5 * 2**50: "5 PiB",
    3000 * 2**50: "3000 PiB",
    -2048: "-2 KiB",
}


def test_the_rule():
    assert {n: describe.bytes_text(n) for n in CASES} == CASES


def test_exact_bytes_beside_the_rule():
    assert describe.bytes_exact(1000) == "1000 B"
    assert describe.bytes_exact(1536) == "1536 B (1.5 KiB)"


def test_every_table_uses_it():
    """The cost table, the memory timeline, a loading cap: all in the same words."""
    assert "total: 0 B bus bytes per rank" in str(cost.CostSummary(cost.link(None), [], {}, {}))
    m = MemoryTimeline(1, (None,), [[1536]], [3 * 2**20], (None,))
    assert "peak 3145728 B (3 MiB)" in repr(m)
    err = over("f.svtrace", "the array", 3 * 2**29, "member_bytes", DEFAULTS)  # the cap: 1 GiB
    assert "1.5 GiB" in str(err) and "cap of 1 GiB" in str(err)


def _js_function(name: str) -> str:
    """The source of one top-level function of common.js (and the constants before it)."""
    src = COMMON_JS.read_text(encoding="utf-8")
    start = src.index(f"function {name}(")
    end = src.index("\n}\n", start) + 3
    consts = "".join(m.group(0) for m in re.finditer(r"(?m)^const BYTE_UNITS = .*\n", src))
    return consts + src[start:end]


def test_the_javascript_says_the_same():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (make lint installs it with npm)")
    values = list(CASES)
    script = _js_function("bytesText") + f"console.log(JSON.stringify({json.dumps(values)}.map(bytesText)));"
    out = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == [CASES[n] for n in values]
