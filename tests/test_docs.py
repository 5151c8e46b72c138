"""Every Python block of README.md and of the documentation's pages (docs/**/*.md) runs as printed,
and the output it shows is what it prints.

How blocks are read, run and compared: ``tests/docblocks.py``. One test per page, each in a fresh
process with an IPython shell, in a scratch folder (blocks write files such as ``layout.html``).
Blocks marked ``<!-- not run: ... -->`` are listed in ``NOT_RUN`` below, so that marking one more
is a visible change here too, never a silent skip.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docblocks import Block, fences, matches, parse

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
TEXTS = {p.relative_to(ROOT).as_posix(): p.read_text() for p in PAGES}
BLOCKS = [b for page, text in TEXTS.items() for b in parse(text, page)]
BY_PAGE: dict[str, list[Block]] = {}
for _b in BLOCKS:
    BY_PAGE.setdefault(_b.page, []).append(_b)

# (page, first line of the block) -> why it cannot run on a CPU-only machine without a cluster.
NOT_RUN: dict[tuple[str, str], str] = {
    (
        "docs/howto/real-process-groups.md",
        'sv.use("nccl", world_size=8)              # 8 engines, one per GPU',
    ): "needs 8 GPUs (nccl)",
    ("docs/howto/real-process-groups.md", 'sv.use("nccl", world_size=16, profile="slurm", timeout=120)'): (
        "needs engines started by ipcluster (a Slurm job, another profile)"
    ),
    ("docs/howto/recording-a-torchrun-job.md", "import shardviz as sv"): (
        "a training script's lines, for torchrun on GPUs (nccl)"
    ),
    (
        "docs/howto/flight-recorder-dumps.md",
        "import shardviz.capture.flight",
    ): "the dump runs in each rank of a torchrun job",
}

# Pages whose blocks start real process groups (ipyparallel engines), and those that take long.
CLUSTER = {"docs/howto/real-process-groups.md"}
SLOW: set[str] = set()

# Fence languages a page may use; a Python block under another name ("py", "pycon", "ipython")
# would be skipped by the runner, so any other language fails test_every_fence_is_known.
LANGUAGES = {"python", "", "text", "bash", "{eval-rst}", "{toctree}", "{include}", "{py:data}"}


def _first_line(block: Block) -> str:
    return next((s.strip() for s in block.code.splitlines() if s.strip()), "")


def test_blocks_not_run_are_the_listed_ones():
    marked = {(b.page, _first_line(b)): b.not_run for b in BLOCKS if b.not_run}
    assert marked == NOT_RUN, (
        "blocks marked '<!-- not run: ... -->' differ from NOT_RUN in tests/test_docs.py: "
        f"marked {marked}, listed {NOT_RUN}. Run the block if it can run here; otherwise list it."
    )


def test_the_pages_have_blocks_to_run():
    run = [b for b in BLOCKS if not b.not_run]
    assert len(run) >= 25, [b.name for b in BLOCKS]
    assert sum(b.expected is not None or len(b.cells) > 1 for b in run) >= 12
    # The README's example runs, with its output shown.
    assert any(b.page == "README.md" and b.expected is not None for b in run)


def test_every_fence_is_known():
    unknown = [f"{page}:{line}: ```{lang}" for page, text in TEXTS.items() for line, lang in fences(text)]
    unknown = [u for u in unknown if u.split("```", 1)[1] not in LANGUAGES]
    assert not unknown, f"fences the runner does not know (a Python block must be ```python): {unknown}"


def test_every_path_and_module_a_page_names_exists():
    # A page that names a file or a module that moved misleads its reader (one named
    # shardviz/adapters/physicsnemo.py long after the adapter moved into capture/).
    paths = {
        p
        for text in TEXTS.values()
        for p in re.findall(r"`((?:shardviz|tests|docs|notebooks|benchmarks)/[\w./-]+)`", text)
    }
    assert len(paths) > 10
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []
    dotted = {n for text in TEXTS.values() for n in re.findall(r"`(shardviz(?:\.[A-Za-z_]\w*)+)`", text)}
    assert len(dotted) > 10
    missing = []
    for name in sorted(dotted):
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            try:
                for attr in parts[i:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                missing.append(name)
            break
        else:
            missing.append(name)
    assert missing == [], f"names on the pages that do not import: {missing}"


def _params() -> list[object]:
    out = []
    for page in BY_PAGE:
        marks = []
        if page in CLUSTER:
            marks.append(pytest.mark.cluster)
        if page in SLOW or page in CLUSTER:
            marks.append(pytest.mark.slow)
        out.append(pytest.param(page, marks=marks, id=page))
    return out


def run_blocks(blocks: list[Block], cwd: Path, timeout: int = 560) -> list[dict[str, str | None]]:
    """Run the blocks' cells in one fresh process; each cell's output and error, in order."""
    cells = [c.code for b in blocks if not b.not_run for c in b.cells]
    (cwd / "cells.json").write_text(json.dumps(cells))
    env = dict(
        os.environ,
        MPLBACKEND="Agg",
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docblocks.py"), "cells.json", "results.json"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    results_file = cwd / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else []
    assert proc.returncode == 0, (
        f"the runner failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    )
    return results


@pytest.mark.timeout(600)  # the cluster page starts gloo engines three times (~130 s here)
@pytest.mark.parametrize("page", _params())
def test_page(page, tmp_path):
    blocks = BY_PAGE[page]
    runnable = [b for b in blocks if not b.not_run]
    if not runnable:
        assert all((b.page, _first_line(b)) in NOT_RUN for b in blocks)
        return
    results = run_blocks(blocks, tmp_path)
    i = 0
    for block in runnable:
        for cell in block.cells:
            assert i < len(results), f"{block.name}: never ran (an earlier cell killed the process?)"
            got = results[i]
            i += 1
            assert got["error"] is None, (
                f"{block.name} raised:\n{got['error']}\nprinted:\n{got['output']}{got.get('stderr', '')}"
            )
            if cell.expected is not None:
                assert matches(cell.expected, got["output"] or ""), (
                    f"{block.name}: printed output differs from the page.\n--- page:\n{cell.expected}\n"
                    f"--- printed:\n{got['output']}"
                )


SAMPLE = """# title
## First
```python
print("a")
```

```
a
```
<!-- not run: needs GPUs -->
```python
sv.use("nccl", world_size=8)
```
### Second
```python
%load_ext shardviz
```
```python
>>> print(1 + 1)
2
>>> x = 3
```
```bash
echo not python
```
```{include} ../README.md
:start-after: <!-- example -->
```
```python
print("after a directive with arguments")
```
"""


def test_the_harness_reads_headings_outputs_markers_and_prompts():
    blocks = parse(SAMPLE, "docs/sample.md")
    assert [(b.page, b.section, b.line, b.not_run) for b in blocks] == [
        ("docs/sample.md", "First", 3, None),
        ("docs/sample.md", "First", 11, "needs GPUs"),
        ("docs/sample.md", "Second", 15, None),
        ("docs/sample.md", "Second", 18, None),
        ("docs/sample.md", "Second", 29, None),
    ]
    assert blocks[0].expected == "a" and blocks[1].expected is None and blocks[2].expected is None
    assert [(c.code, c.expected) for c in blocks[3].cells] == [("print(1 + 1)", "2"), ("x = 3", "")]
    assert blocks[0].name == 'docs/sample.md:3 (First): print("a")'
    assert fences(SAMPLE) == [
        (3, "python"),
        (7, ""),
        (11, "python"),
        (15, "python"),
        (18, "python"),
        (23, "bash"),
        (26, "{include}"),
        (29, "python"),
    ]


def test_outputs_match_exactly_but_for_trailing_spaces_and_ellipsis_lines():
    assert matches("a\nb", "a  \nb\n\n")
    assert not matches("a\nb", "a\nc")
    assert not matches("a", "a\nb")
    assert matches("a\n...\nd", "a\nb\nc\nd")
    assert matches("a\n  ...\nd", "a\nd")
    assert not matches("a\n...\nd", "a\nb\nc")


@pytest.mark.timeout(120)
def test_a_block_that_fails_as_printed_is_reported(tmp_path):
    # The README once used Replicate without importing it.
    (block,) = parse("## S\n```python\nfrom torch.distributed.tensor import Shard\nReplicate()\n```\n")
    (result,) = run_blocks([block], tmp_path)
    assert result["error"] is not None and "NameError: name 'Replicate' is not defined" in result["error"]
