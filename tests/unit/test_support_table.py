"""The torch support page's table of what each torch gives, checked on the torch this runs on (each CI tier
runs it on its own: 2.11, 2.13, 2.15)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardviz.capture import torch as _torch

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "torch-support.md"
HERE = ".".join(torch.__version__.split("+")[0].split(".")[:2])


def table() -> dict[str, dict[str, str]]:
    text = PAGE.read_text()
    lines = text[text.index("| on torch |") :].splitlines()
    rows = lines[: next(i for i, line in enumerate(lines) if not line.startswith("|"))]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    out = {}
    for line in rows[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        out[cells[0]] = dict(zip(head[1:], cells[1:], strict=True))
    return out


def row(start: str) -> dict[str, str]:
    (name,) = [k for k in table() if k.startswith(start)]
    return table()[name]


def test_the_columns_start_at_the_oldest_torch_the_gate_accepts():
    columns = list(row("simulator"))
    assert columns[0] == "{}.{}".format(*_torch.MIN_TORCH)
    assert columns[-1] == "{}.{}".format(*_torch.TESTED_UP_TO)


@pytest.mark.skipif(HERE not in row("simulator"), reason=f"torch {HERE} has no column")
def test_the_compile_row_says_what_this_torch_does():
    cell = row("`torch.compile`")[HERE]
    assert ("uncompiled" in cell) == (not _torch.COMPILES_IN_SIMULATION), cell


@pytest.mark.timeout(120)
@pytest.mark.skipif(HERE not in row("simulator"), reason=f"torch {HERE} has no column")
@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None, reason="torchtitan is not installed")
def test_the_torchtitan_row_says_whether_it_imports_here():
    cell = row("notebook 09")[HERE]
    done = subprocess.run(
        [sys.executable, "-c", "import torchtitan.models.llama3"], capture_output=True, timeout=110
    )
    assert (cell != "–") == (done.returncode == 0), (cell, done.stderr[-500:])
