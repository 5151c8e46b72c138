"""Cells run in a real kernel by nbclient, and their outputs read back as text.

Importable from every test folder: ``tests/conftest.py`` puts this folder on ``sys.path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import nbformat
from nbclient import NotebookClient


def run_cells(cells: list[str], path: Path, timeout: int = 120) -> list[list[Any]]:
    """Each cell's outputs, from one fresh kernel started in ``path``; errors do not stop the run."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=True,
        resources={"metadata": {"path": str(path)}},
    )
    client.execute()
    return [c.outputs for c in nb.cells]


def text(outputs: list[Any], mime: str = "text/plain") -> str:
    """What a cell showed: streams, ``mime`` of its results and displays, and any error line."""
    parts = []
    for o in outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            parts.append(o.data.get(mime, ""))
        elif o.output_type == "error":
            parts.append(f"{o.ename}: {o.evalue}")
    return "".join(parts)
