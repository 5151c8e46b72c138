"""The notebooks' lists (the tour's "Where next", the tutorials page's table and its table of
contents) name every notebook in notebooks/, in order, and each saved notebook carries the
kernelspec JupyterLab writes when it opens it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NAME = re.compile(r"`(\d\d_[a-z0-9_]+)`")


def _stems() -> set[str]:
    return {p.stem for p in NOTEBOOKS}


def test_the_tour_points_to_every_other_notebook():
    nb = json.loads((ROOT / "notebooks" / "01_tour.ipynb").read_text())
    (where,) = ["".join(c["source"]) for c in nb["cells"] if "".join(c["source"]).startswith("## Where next")]
    assert set(NAME.findall(where)) == _stems() - {"01_tour"}, where


def test_the_tutorials_page_lists_every_notebook_in_order():
    text = (ROOT / "docs" / "tutorials.md").read_text()
    listed = re.findall(r"^\| \[`(\d\d_[a-z0-9_]+)`\]\(\.\./notebooks/\1\.ipynb\)", text, flags=re.M)
    assert listed == sorted(_stems()), listed
    toctree = text[text.index("```{toctree}") :]
    assert re.findall(r"^\.\./notebooks/(\S+)$", toctree, flags=re.M) == sorted(_stems())


def _execute_module():
    spec = importlib.util.spec_from_file_location("nb_execute", ROOT / "notebooks" / "execute.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_kernelspec_is_the_one_jupyterlab_writes(path):
    # JupyterLab sets {name, display_name, language} from the kernel's installed spec on opening.
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec("python3")
    expected = {"display_name": spec.display_name, "language": spec.language, "name": "python3"}
    assert json.loads(path.read_text())["metadata"]["kernelspec"] == expected
    assert _execute_module().kernelspec_metadata() == expected  # what `make notebooks` saves
