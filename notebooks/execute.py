"""Run the teaching notebooks top to bottom and save them with their outputs (``make notebooks``).

Saved outputs are what a reader sees without a kernel (widgets keep a PNG and a text fallback),
and what ``pytest --nbval-lax`` compares for cells marked ``# NBVAL_CHECK_OUTPUT``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    print(f"executing {path.name} ...", flush=True)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps: noise in diffs
    nb.metadata.pop("widgets", None)  # live widget state is not kept; each widget keeps a PNG
    nbformat.write(nb, path)
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in HERE.glob("[0-9][0-9]_*.ipynb"))
    for name in names:
        execute(HERE / Path(name).name)
