"""Client-side pieces of the real backends that need no engines: options, shipping functions."""

from __future__ import annotations

import math
import types

import pytest
import torch
from torch.distributed.tensor import Shard

import shardviz as sv
from shardviz.backends.cluster import ClusterBackend, notebook_imports, ship_function
from shardviz.magics import parse_use

SCALE = 3


def helper(x):
    return x * SCALE


def uses_globals():
    return helper(torch.ones(2)), math.pi, Shard(0), sv.device_type()


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"bogus": 1}, TypeError, r"unknown option\(s\) \['bogus'\].*options are"),
        ({"timeout": 0}, ValueError, "positive number of seconds"),
        ({"timeout": -5}, ValueError, "positive number of seconds"),
    ],
)
def test_options_are_checked_before_anything_starts(options, error, match):
    with pytest.raises(error, match=match):
        ClusterBackend("gloo", 2, **options)
    with pytest.raises(ValueError, match="positive int"):
        ClusterBackend("gloo", 0)


def test_magic_passes_options_through():
    assert parse_use(["gloo", "4", "timeout=10", "cluster_id=abc", "progress=False"]) == (
        "gloo",
        4,
        {"timeout": 10, "cluster_id": "abc", "progress": False},
    )


def test_a_test_module_function_is_sent_by_code_with_what_its_globals_need():
    fn, env = ship_function(uses_globals)
    assert isinstance(fn, types.FunctionType) and fn is not uses_globals
    assert fn.__module__ == "__main__" and fn.__globals__ == {}  # bound to the rank's names there
    assert env["imports"] == {
        "torch": ("module", "torch"),
        "math": ("module", "math"),
        "Shard": ("attr", "torch.distributed.tensor.placement_types", "Shard"),
        "sv": ("module", "shardviz"),
    }
    assert set(env["functions"]) == {"helper"} and env["functions"]["helper"].__code__ is helper.__code__
    assert env["constants"] == {"SCALE": 3}
    assert any(line.startswith("def uses_globals") for line in env["lines"][__file__])


def test_library_functions_are_sent_by_reference():
    fn, env = ship_function(torch.ones)
    assert fn is torch.ones and env["imports"] == {}


def test_notebook_imports_are_the_importable_names():
    ns = {"torch": torch, "Shard": Shard, "sv": sv, "x": torch.ones(1), "_private": math, "local_fn": helper}
    assert notebook_imports(ns) == {
        "torch": ("module", "torch"),
        "Shard": ("attr", "torch.distributed.tensor.placement_types", "Shard"),
        "sv": ("module", "shardviz"),
    }
