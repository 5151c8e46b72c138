"""pytest's entry point for shardviz (``pytest --shardviz-traces DIR``), kept outside the package
so that every pytest run in an environment with shardviz installed does not import torch: the
recording machinery, ``shardviz.pytest_plugin``, is imported only when the option is given."""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    parser.getgroup("shardviz").addoption(
        "--shardviz-traces",
        metavar="DIR",
        default=None,
        help="record every test that enters torch's LocalTensorMode and save a shardviz trace "
        "(DIR/<test id>.svtrace) and an offline player (DIR/<test id>.html) of each one that fails",
    )


def pytest_configure(config: Any) -> None:
    folder = config.getoption("shardviz_traces", None)
    if folder:
        from shardviz.pytest_plugin import TracesOfFailures

        config.pluginmanager.register(TracesOfFailures(folder), "shardviz-traces")
