"""The Python blocks of README.md and of the documentation's pages, read and run as a reader would
run them (``tests/test_docs.py``).

Reading: a page's ```` ```python ```` blocks run in order, in one fresh IPython shell of their own
(a fresh process per page, so that every page holds its own imports and data; a block starting
with ``%`` is a magic, as in a notebook); a block is named by its page, its line and the heading
above it. A block shows output in one of two ways, and that output is compared:

- an output block right after it (```` ``` ```` or ```` ```text ````, nothing but blank lines
  between): what the whole block prints on stdout (warnings on stderr are not compared), the
  last expression's value included as a notebook shows it (its text form, without ``Out[n]``);
- ``>>>`` prompts: each statement runs as one cell and the lines after it, up to the next
  prompt, are what it prints (doctest style).

Normalisation, the only one: trailing spaces and blank lines at the ends are ignored, and an
expected line that is ``...`` alone (indented or not) stands for any number of lines.

A block that cannot run here (nccl on GPUs, several machines, Slurm) has an HTML comment on the
line before it: ``<!-- not run: needs GPUs (nccl) -->``. The test lists those blocks by name.

Run as a script (``python tests/docblocks.py CELLS.json RESULTS.json``) it executes the cells of
one page and writes, per cell, what it printed and the error it raised, if any.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

FENCE = re.compile(r"^```(\S*)(?:\s.*)?$")  # the language, then a directive's arguments (MyST)
HEADING = re.compile(r"^#{1,6} (.+)$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")
ELLIPSIS = "..."


@dataclass
class Cell:
    """One unit of execution: a whole block, or one ``>>>`` statement of a block."""

    code: str
    expected: str | None  # None: printed output not compared


@dataclass
class Block:
    page: str  # the file, relative to the repository (README.md, docs/howto/...)
    section: str  # the heading the block is under
    line: int  # 1-based line of the opening fence
    code: str
    expected: str | None = None
    not_run: str | None = None
    cells: list[Cell] = field(default_factory=list)

    @property
    def name(self) -> str:
        first = next((s for s in self.code.splitlines() if s.strip()), "")
        return f"{self.page}:{self.line} ({self.section}): {first.strip()[:60]}"


def _doctest_cells(code: str) -> list[Cell] | None:
    lines = code.splitlines()
    if not lines or not lines[0].startswith(">>> "):
        return None
    cells: list[Cell] = []
    src: list[str] = []
    out: list[str] = []

    def flush() -> None:
        if src:
            cells.append(Cell("\n".join(src), "\n".join(out)))

    for line in lines:
        if line.startswith(">>> "):
            flush()
            src, out = [line[4:]], []
        elif line.startswith("... ") or line == "...":
            if out:
                out.append(line)  # an ellipsis line of the expected output
            else:
                src.append(line[4:])
        else:
            out.append(line)
    flush()
    return cells


def parse(text: str, page: str = "") -> list[Block]:
    """Every ``python`` block of a page, with its heading, output and ``not run`` reason."""
    lines = text.splitlines()
    blocks: list[Block] = []
    section = ""
    i = 0
    previous: Block | None = None  # the last python block, while only blank lines follow it
    while i < len(lines):
        line = lines[i]
        h = HEADING.match(line)
        if h:
            section = h.group(1).strip()
            previous = None
        m = FENCE.match(line)
        if not m:
            if line.strip():
                previous = None
            i += 1
            continue
        lang = m.group(1)
        end = i + 1
        while end < len(lines) and not lines[end].startswith("```"):
            end += 1
        body = "\n".join(lines[i + 1 : end])
        if lang == "python":
            marker = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            nm = NOT_RUN.match(marker.strip())
            block = Block(page, section, i + 1, body, not_run=nm.group(1) if nm else None)
            block.cells = _doctest_cells(body) or [Cell(body, None)]
            blocks.append(block)
            previous = block
        elif lang in ("", "text") and previous is not None and previous.expected is None:
            if len(previous.cells) == 1 and previous.cells[0].expected is None:
                previous.expected = previous.cells[0].expected = body
            previous = None
        else:
            previous = None
        i = end + 1
    return blocks


def fences(text: str) -> list[tuple[int, str]]:
    """(line, language) of every fenced block of a page, Python or not."""
    out = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            out.append((i + 1, m.group(1)))
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
        i += 1
    return out


def _clean(text: str) -> list[str]:
    lines = [s.rstrip() for s in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def matches(expected: str, actual: str) -> bool:
    """``actual`` equals ``expected`` line by line, where an expected ``...`` line stands for any
    number of lines (trailing spaces and blank lines at the ends ignored)."""
    exp, act = _clean(expected), _clean(actual)

    def match(i: int, j: int) -> bool:
        if i == len(exp):
            return j == len(act)
        if exp[i].strip() == ELLIPSIS:
            return any(match(i + 1, k) for k in range(j, len(act) + 1))
        return j < len(act) and exp[i] == act[j] and match(i + 1, j + 1)

    return match(0, 0)


def _run(cells_path: str, results_path: str) -> None:
    """Run the cells in one IPython shell; record each one's printed output and error."""
    import contextlib
    import io
    import traceback

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.separate_out = ""  # no blank line before a displayed value
    shell.colors = "nocolor"
    shell.displayhook.write_output_prompt = lambda: None  # a value shows as in a notebook: no Out[n]
    cells = json.loads(Path(cells_path).read_text())
    results = []
    for code in cells:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            result = shell.run_cell(code, store_history=True)
        error = result.error_before_exec or result.error_in_exec
        results.append(
            {
                "output": out.getvalue(),
                "stderr": err.getvalue(),
                "error": "".join(traceback.format_exception(error)) if error is not None else None,
            }
        )
        Path(results_path).write_text(json.dumps(results))  # kept if a later cell kills the process
        if error is not None:
            break


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2])
