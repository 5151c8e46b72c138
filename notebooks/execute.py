"""Run the teaching notebooks top to bottom and save them with their outputs (``make notebooks``).

Saved outputs are what a reader sees without a kernel (widgets keep a PNG and a text fallback),
and what ``pytest --nbval-lax`` compares for cells marked ``# NBVAL_CHECK_OUTPUT``. The metadata is
what JupyterLab writes when it opens a notebook (the kernel's spec and language info), so that
opening one in ``make demo`` leaves ``git status`` clean.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import nbformat
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
KERNEL = "python3"


def kernelspec_metadata(name: str = KERNEL) -> dict[str, str]:
    """The notebook's ``kernelspec`` as JupyterLab sets it on opening: name, and the installed
    kernel's display name and language (``Python 3 (ipykernel)`` for ipykernel's)."""
    spec = KernelSpecManager().get_kernel_spec(name)
    return {"display_name": spec.display_name, "language": spec.language, "name": name}


def execute(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    print(f"executing {path.name} ...", flush=True)
    NotebookClient(nb, timeout=600, kernel_name=KERNEL, resources={"metadata": {"path": str(HERE)}}).execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps: noise in diffs
    nb.metadata.pop("widgets", None)  # live widget state is not kept; each widget keeps a PNG
    nb.metadata["kernelspec"] = kernelspec_metadata()  # nbclient keeps the old one; JupyterLab would not
    nbformat.write(nb, path)
    print(f"  done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    names = sys.argv[1:] or sorted(p.name for p in HERE.glob("[0-9][0-9]_*.ipynb"))
    for name in names:
        execute(HERE / Path(name).name)
