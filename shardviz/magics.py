"""IPython magics: ``%load_ext shardviz``, ``%shardviz use ...``, ``%%spmd``.

Thin wrappers over the Python API: ``%shardviz use gloo 4`` is ``sv.use("gloo", world_size=4)``
and a ``%%spmd`` cell goes to the current backend's ``run_cell`` (the simulator runs it as the body
of ``sv.record()``; real ranks each run it). Arguments are parsed as words and numbers, never
evaluated.
"""

from __future__ import annotations

import shlex
from typing import Any

from IPython.core.magic import Magics, cell_magic, line_magic, magics_class

from .backends import choose

USAGE = """\
%shardviz use local [N]            simulate N ranks in this kernel (default 4)
%shardviz use threads [N]          simulate N ranks in this kernel, one thread per rank
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
        raise ValueError("usage: %shardviz use <local|threads|gloo|nccl> [N] [key=value ...]")
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
            backend = choose.use(name, world_size, **options)
            print(f"shardviz: {backend.name} backend, {backend.world_size} ranks")
            return None
        if cmd == "restart":
            backend = choose.restart()
            print(f"shardviz: restarted the {backend.name} backend, {backend.world_size} ranks")
            return None
        if cmd == "status":
            print(f"shardviz: {choose.current()!r}")
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
        if compare:
            from .compare import compare_cell

            return compare_cell(cell, self.shell, values)
        return choose.current().run_cell(cell, self.shell, values=values)


def load_ipython_extension(ipython: Any) -> None:
    ipython.register_magics(ShardvizMagics)
