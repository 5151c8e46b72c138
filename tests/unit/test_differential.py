"""The differential test of the simulator (issue 30): random small DTensor programs (``differential``)
run in plain torch on full tensors, in the lockstep simulator, on one thread per rank and on the
batched engine; every result and gradient, on every rank, equals plain torch's, and every
simulation's trace is event-equal to lockstep's. A program every simulation refuses alike (torch's
DTensor has no way to run it) is counted as a refusal, never as a pass of the comparison.

Fixed seed (the CI hypothesis profile derandomizes), examples per world size grouped so that
each world's process group is built once per batch. ``SHARDVIZ_DIFFERENTIAL_EXAMPLES=N`` runs N
per world size (default 10), and ``SHARDVIZ_DIFFERENTIAL_COLLECT=1`` goes on past a disagreement
to list every one; the findings of a long run are kept below as regression tests.
"""

from __future__ import annotations

import collections
import os

import pytest
from differential import WORLDS, Program, check, programs
from hypothesis import HealthCheck, given, settings

import shardviz as sv

EXAMPLES = int(os.environ.get("SHARDVIZ_DIFFERENTIAL_EXAMPLES", "10"))
# A long run goes on past a disagreement, to find every one: each is listed when the test fails.
COLLECT = os.environ.get("SHARDVIZ_DIFFERENTIAL_COLLECT") == "1"

pytestmark = pytest.mark.timeout(max(600, 20 * EXAMPLES))

# What the programs came to (printed at the end with ``pytest -s``): agreed, or refused alike by
# both simulations with torch's message.
OUTCOMES: collections.Counter[str] = collections.Counter()


@pytest.fixture(autouse=True, scope="module")
def _back_to_local():
    yield
    sv.use("local", world_size=4)
    if OUTCOMES:
        print("\ndifferential test outcomes:")
        for what, n in OUTCOMES.most_common():
            print(f"  {n:5d}  {what}")


@pytest.mark.slow  # ~2 minutes for all world sizes: in `make test`, not `make test-unit`
@pytest.mark.parametrize("world", WORLDS)
def test_random_programs_agree_on_every_side(world):
    found: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(prog=programs(world))
    def one(prog: Program) -> None:
        try:
            refused = check(prog)
        except AssertionError as e:
            if not COLLECT:
                raise
            OUTCOMES[f"world {world}: DISAGREED"] += 1
            found.append(f"{prog!r}\n  {str(e).splitlines()[0][:400]}")
            return
        OUTCOMES[f"world {world}: agreed" if refused is None else f"refused alike: {refused[:150]}"] += 1

    one()
    if found:
        pytest.fail(f"{len(found)} program(s) the sides disagree on:\n" + "\n".join(found), pytrace=False)


# --- what long runs found, kept ------------------------------------------------------------------

FOUND = {
    # Lockstep: a seeded torch.Generator of the program's own gave each rank the next rank's numbers
    # (LocalTensorMode ran the ranks one after another on the one generator object).
    "own generator": Program((2,), "float32", (1,), ("R",), (("scale",),), False, 0),
    # Threads: DTensor's redistribute planner, cached by mesh and metadata, was shared by the rank
    # threads: rank 0 read rank 4's coordinate and gathered its one row unpadded.
    "planner per rank": Program(
        (2, 4), "float32", (1,), ("R", "R"), (("redistribute", ("S(0)", "S(0)")),), False, 0
    ),
    # Threads: the reduce-scatter of an empty Partial split it into one part, not six.
    "empty reduce-scatter": Program((6,), "float32", (0,), ("P",), (("redistribute", ("S(0)",)),), False, 0),
}


@pytest.mark.parametrize("name", sorted(FOUND))
def test_what_the_differential_test_found(name):
    assert check(FOUND[name]) is None
