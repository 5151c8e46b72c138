"""IPython magics: ``%load_ext shardviz``, ``%shardviz use ...``, ``%%spmd``.

Thin wrappers over the Python API: ``%shardviz use gloo 4`` is ``sv.use("gloo", world_size=4)``
and a ``%%spmd`` cell is the body of ``sv.record()`` (or ``sv.run`` on a real backend). Arguments
are parsed as words and numbers, never evaluated.
"""

from __future__ import annotations

import ast
import itertools
import linecache
import shlex
from typing import Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from . import backends
from .record import record

_cells = itertools.count(1)

USAGE = """\
%shardviz use local [N]            simulate N ranks in this kernel (default 4)
%shardviz use gloo N [key=value]   N real CPU processes (ipyparallel engines)
%shardviz use nccl N [key=value]   N real GPU processes, one per GPU
%shardviz restart                  rebuild the current backend
%shardviz status                   show the current backend
%%spmd [--values=all|none|BYTES]   run the cell on every rank and record it (sv.last_trace())
%%spmd --compare                   run it in the simulator and on the real ranks; report differences"""


def _number_or_word(text: str) -> Any:
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    if text in ("True", "False"):
        return text == "True"
    return text


def parse_use(words: list[str]) -> tuple[str, int | None, dict[str, Any]]:
    """``use <backend> [N] [key=value ...]`` as (backend, world_size, options)."""
    if not words:
        raise ValueError("usage: %shardviz use <local|gloo|nccl> [N] [key=value ...]")
    name, rest = words[0], words[1:]
    world_size = None
    options: dict[str, Any] = {}
    for w in rest:
        if "=" in w:
            key, _, value = w.partition("=")
            options[key.lstrip("-").replace("-", "_")] = _number_or_word(value)
        elif world_size is None:
            try:
                world_size = int(w)
            except ValueError:
                raise ValueError(
                    f"world size {w!r} is not a whole number; usage: %shardviz use {name} 4"
                ) from None
        else:
            raise ValueError(f"unexpected argument {w!r}; usage: %shardviz use {name} 4 [key=value ...]")
    return name, world_size, options


def parse_values(text: str) -> str | int:
    if text in ("all", "none"):
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f'--values={text!r}: use "all", "none" or a byte budget such as 1000000') from None


@magics_class
class ShardvizMagics(Magics):
    @line_magic
    def shardviz(self, line: str) -> Any:
        """Choose or inspect the backend; ``%shardviz help`` lists the commands."""
        words = shlex.split(line)
        if not words or words[0] in ("help", "-h", "--help"):
            print(USAGE)
            return None
        cmd, rest = words[0], words[1:]
        if cmd == "use":
            name, world_size, options = parse_use(rest)
            backend = backends.use(name, world_size, **options)
            print(f"shardviz: {backend.name} backend, {backend.world_size} ranks")
            return None
        if cmd == "restart":
            backend = backends.restart()
            print(f"shardviz: restarted the {backend.name} backend, {backend.world_size} ranks")
            return None
        if cmd == "status":
            print(f"shardviz: {backends.current()!r}")
            return None
        raise ValueError(f"unknown %shardviz command {cmd!r}\n{USAGE}")

    @cell_magic
    def spmd(self, line: str, cell: str) -> Any:
        """Run the cell as SPMD code on every rank of the current backend, recorded."""
        values: str | int | None = None
        compare = False
        for word in shlex.split(line):
            if word.startswith("--values="):
                values = parse_values(word.split("=", 1)[1])
            elif word == "--compare":
                compare = True
            else:
                raise ValueError(f"unknown %%spmd option {word!r}\n{USAGE}")
        backend = backends.current()
        if compare:
            from .compare import compare_cell

            return compare_cell(cell, self.shell, values)
        if backend.name != "local":
            return backend.run_cell(cell, self.shell, values=values)  # type: ignore[attr-defined]
        body, last = compile_cell(cell)
        ns = self.shell.user_ns  # type: ignore[union-attr]
        kwargs = {} if values is None else {"values": values}
        with record(**kwargs):
            if body is not None:
                exec(body, ns)
            result = eval(last, ns) if last is not None else None
        return result


def compile_cell(cell: str) -> tuple[Any, Any]:
    """Compile a cell into (statements, last expression or None), registered for tracebacks."""
    filename = f"<spmd-cell-{next(_cells)}>"
    linecache.cache[filename] = (len(cell), None, cell.splitlines(keepends=True), filename)
    return split_cell(cell, filename)


def split_cell(cell: str, filename: str) -> tuple[Any, Any]:
    """(statements, last expression or None) of a cell compiled under ``filename``; real ranks
    compile a cell under the notebook's file name so that traces and tracebacks agree."""
    tree = ast.parse(cell, filename=filename)
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr) and not cell.rstrip().endswith(";"):
        tree.body.pop()
        last = compile(ast.Expression(tail.value), filename, "eval")
    body = compile(tree, filename, "exec") if tree.body else None
    return body, last


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(ShardvizMagics)
