"""A ``%%spmd`` cell as code: its statements and its last expression, compiled and run.

Neutral ground between the notebook front end (``magics``), the backends that run cells (the
simulator, the real ranks) and ``%%spmd --compare``: no IPython, no torch, so a backend can run a
cell without importing the front end.
"""

from __future__ import annotations

import ast
import itertools
import linecache
from types import CodeType
from typing import Any

_cells = itertools.count(1)


def compile_cell(cell: str) -> tuple[CodeType | None, CodeType | None]:
    """Compile a cell into (statements, last expression or None), registered for tracebacks."""
    filename = f"<spmd-cell-{next(_cells)}>"
    linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
    return split_cell(cell, filename)


def split_cell(cell: str, filename: str) -> tuple[CodeType | None, CodeType | None]:
    """(statements, last expression or None) of a cell compiled under ``filename``; real ranks
    compile a cell under the notebook's file name so that traces and tracebacks agree.

    A last expression followed by ``;`` is a statement, as in IPython: its value is not shown."""
    tree = ast.parse(cell, filename=filename)
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr) and not cell.rstrip().endswith(";"):
        tree.body.pop()
        last = compile(ast.Expression(tail.value), filename, "eval")
    body = compile(tree, filename, "exec") if tree.body else None
    return body, last


def run_compiled(body: CodeType | None, last: CodeType | None, ns: dict[str, Any]) -> Any:
    """Run a compiled cell in ``ns``; its last expression's value, or None."""
    if body is not None:
        exec(body, ns)
    return eval(last, ns) if last is not None else None
