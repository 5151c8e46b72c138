"""pytest's entry point for shardviz (``pytest --shardviz-traces DIR``), kept outside the package
so that every pytest run in an environment with shardviz installed does not import torch: the
recording machinery, ``shardviz.pytest_plugin``, is imported only when the option is given."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any


def pytest_addoption(parser: Any) -> None:
    parser.getgroup("shardviz").addoption(
        "--shardviz-traces",
        metavar="DIR",
        default=None,
        help="record every test that enters torch's LocalTensorMode and save a shardviz trace "
        "(DIR/<test id>.svtrace) and an offline player (DIR/<test id>.html) of each one that fails",
    )


def prepared_folder(value: str) -> tuple[Path, list[Path]]:
    """``--shardviz-traces DIR`` made ready before any test runs: the folder (created, with its
    missing parents, which are listed), or one usage error saying why it cannot hold traces (a
    file, a path under a file, a place this process cannot write)."""
    import pytest

    folder = Path(value).expanduser().absolute()
    created: list[Path] = []
    missing = folder
    while not missing.exists() and missing.parent != missing:
        created.append(missing)
        missing = missing.parent
    if missing.exists() and not missing.is_dir():
        what = "is a file" if missing == folder else f"lies under {missing}, which is a file"
        raise pytest.UsageError(f"--shardviz-traces {value}: {folder} {what}; name a folder for the traces")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".shardviz-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise pytest.UsageError(
            f"--shardviz-traces {value}: traces cannot be written in {folder} ({e.strerror or e}); "
            "name a folder this user can write"
        ) from None
    return folder, created[::-1]


def pytest_configure(config: Any) -> None:
    folder = config.getoption("shardviz_traces", None)
    if folder:
        path, created = prepared_folder(folder)
        from shardviz.pytest_plugin import TracesOfFailures

        config.pluginmanager.register(TracesOfFailures(path, created), "shardviz-traces")
