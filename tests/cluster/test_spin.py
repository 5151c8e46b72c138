"""A rank that runs Python past the spin limit without reaching a collective is reported by rank,
with its stack, while it runs; it is stopped only when asked (``on_spin="interrupt"``). Messages
say whether each rank is inside a collective or running Python.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
import warnings

import pytest

import shardviz as sv
from shardviz.backends import rank as rank_module
from shardviz.backends.cluster import RankError, RankRun, SpinningRankWarning, where_text
from shardviz.backends.cluster import backend as cluster_module

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

TIMEOUT = 5  # process-group timeout: each hang costs one
SPIN = 1.5  # spin limit in these tests (seconds)

SETUP = "import torch\nimport torch.distributed as dist"
ALL_REDUCE = "t = torch.ones(2)\ndist.all_reduce(t)\nt"
SPINS_FOREVER = (
    "t = torch.ones(2)\nif dist.get_rank() == 1:\n    while True:\n        pass\ndist.all_reduce(t)"
)


def spmd(ip, cell):
    t0 = time.monotonic()
    try:
        return ip.run_cell_magic("spmd", "", cell), time.monotonic() - t0
    except BaseException as e:
        e.elapsed = time.monotonic() - t0
        raise


def test_a_slow_rank_is_reported_with_its_stack_and_left_to_finish(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=10, spin_limit=SPIN)
    cell = (
        "import time\nt = torch.ones(2)\nif dist.get_rank() == 1:\n    t1 = time.time()\n"
        "    while time.time() - t1 < 4:\n        pass\ndist.all_reduce(t)\nt"
    )
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *a, **k: seen.append((time.monotonic() - t0, str(message)))
        out, elapsed = spmd(ip, cell)
    assert out.tolist() == [2.0, 2.0]  # reported, not stopped: the cell finished as written
    assert elapsed >= 4
    assert len(seen) == 1, seen  # once per rank and stretch, not every second
    when, text = seen[0]
    assert SPIN <= when < 4, "reported while rank 1 was still spinning"
    assert text.startswith("rank 1 has run Python for ")
    assert "without reaching a collective (spin_limit 1.5 s), at line 5: while time.time() - t1 < 4:" in text
    assert 'File "<spmd-cell-' in text and "line 5, in <module>" in text  # its stack
    assert "rank 0: waiting in all_reduce #1 on group [0,1] (line 7: dist.all_reduce(t))" in text


def test_a_spinning_rank_is_stopped_when_asked(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=TIMEOUT, spin_limit=SPIN, on_spin="interrupt")
    with pytest.raises(RankError) as info:
        spmd(ip, SPINS_FOREVER)
    err = info.value
    assert SPIN <= err.elapsed < TIMEOUT  # before rank 0's all_reduce times out
    assert err.ranks == [1] and err.errors[1]["ename"] == "KeyboardInterrupt"
    assert err.spinning[1]["where"] == "line 3: while True:" and err.spinning[1]["seconds"] >= SPIN
    assert str(err).startswith("rank 1 was stopped (on_spin='interrupt'): it ran Python for "), str(err)
    assert err.where[0].startswith("waiting in all_reduce #1 on group [0,1]")
    assert err.where[1].startswith("stopped by on_spin='interrupt' after running Python for ")
    assert "rank 0 to leave its collective" in str(err)  # what sv.restart() will wait for
    sv.restart()
    out, _ = spmd(ip, ALL_REDUCE)
    assert out.tolist() == [2.0, 2.0]


def test_ranks_stopped_outside_any_collective_leave_the_process_group_usable(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=TIMEOUT, spin_limit=SPIN, on_spin="interrupt")
    with pytest.raises(RankError) as info:
        spmd(ip, "import time\ntime.sleep(60)")  # a C call, interrupted as Ctrl-C would
    assert info.value.ranks == [0, 1] and info.value.elapsed < 10
    assert set(info.value.spinning) == {0, 1}
    out, _ = spmd(ip, ALL_REDUCE)  # no restart: no rank was inside a collective
    assert out.tolist() == [2.0, 2.0]


def test_a_rank_that_catches_the_interrupt_is_reported_as_still_running(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=10, spin_limit=SPIN, on_spin="interrupt")
    cell = (
        "import time\nif dist.get_rank() == 1:\n    try:\n        while True:\n            pass\n"
        "    except KeyboardInterrupt:\n        t1 = time.time()\n        while time.time() - t1 < 2.5:\n"
        "            pass\ndist.get_rank()"
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out, _ = spmd(ip, cell)
    assert out == {0: 0, 1: 1}  # the cell went on as written: it caught the interrupt
    texts = [str(w.message) for w in seen if issubclass(w.category, SpinningRankWarning)]
    assert len(texts) == 1, texts
    assert (
        texts[0].startswith("rank 1 has run Python for ") and "at line 8: while time.time() - t1" in texts[0]
    )
    assert "on_spin='interrupt' could not stop it" in texts[0]


def test_the_warning_made_an_error_stops_the_ranks(ip, gloo):
    ip.run_cell(SETUP)
    gloo(2, timeout=TIMEOUT, spin_limit=SPIN)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SpinningRankWarning)
        with pytest.raises(SpinningRankWarning, match="has run Python for") as info:
            spmd(ip, "while True:\n    pass")
    assert info.value.elapsed < TIMEOUT
    out, _ = spmd(ip, ALL_REDUCE)  # both ranks were stopped outside any collective: no restart
    assert out.tolist() == [2.0, 2.0]


def test_a_rank_spinning_past_the_timeout_is_said_to_run_python(ip, gloo):
    """Rank 0 times out in all_reduce while rank 1 spins. The error says rank 1 is running Python
    (where), not inside a collective, and sv.restart() interrupts it instead of waiting it out."""
    ip.run_cell(SETUP)
    gloo(2, timeout=TIMEOUT, spin_limit=SPIN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SpinningRankWarning)
        with pytest.raises(RankError) as info:
            spmd(ip, SPINS_FOREVER)
    err = info.value
    assert "while rank 1 is running Python, outside any collective" in str(err)
    assert err.where[1].startswith("running Python for ") and err.where[1].endswith("at line 3: while True:")
    assert "it interrupts rank 1 (running Python, outside any collective), then rebuilds" in str(err)
    t0 = time.monotonic()
    sv.restart()
    assert time.monotonic() - t0 < TIMEOUT  # interrupted, not waited for nor replaced
    out, _ = spmd(ip, ALL_REDUCE)
    assert out.tolist() == [2.0, 2.0]


def test_ctrl_c_says_which_rank_was_in_a_collective_and_which_ran_python(ip, gloo, monkeypatch):
    ip.run_cell(SETUP)
    backend = gloo(2, timeout=8)
    wait = concurrent.futures.wait
    at = time.monotonic() + 1.5
    pressed = []

    def wait_then_ctrl_c(*args, **kwargs):  # the notebook's Ctrl-C, 1.5 s into the cell
        if not pressed and time.monotonic() > at:
            pressed.append(True)
            raise KeyboardInterrupt
        return wait(*args, **kwargs)

    monkeypatch.setattr(cluster_module.concurrent.futures, "wait", wait_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt) as info:
        spmd(ip, SPINS_FOREVER)
    monkeypatch.undo()
    text = str(info.value)
    assert "rank 0: waiting in all_reduce #1 on group [0,1] (line 5: dist.all_reduce(t))" in text
    assert "rank 1: running outside any collective" in text
    assert "rank 1 stopped." in text and "rank 0 did not stop" in text
    assert backend.broken.startswith("interrupted while rank 0 was waiting in all_reduce #1")
    assert "rank 1" not in backend.broken
    sv.restart()
    out, _ = spmd(ip, ALL_REDUCE)
    assert out.tolist() == [2.0, 2.0]


# --- the pieces, in this process ----------------------------------------------------------------


def _spin_in_helper(stop: list[bool]) -> None:
    while not stop:  # no call inside: the innermost frame is this one
        pass


def test_the_watch_reports_the_stack_of_the_thread_it_watches():
    """The watch runs beside the code; its report names the function the thread is in and the
    line, and stops when the code reaches a collective."""
    reports: list[dict] = []
    stop: list[bool] = []
    flight = rank_module.Flight(None)
    ready = threading.Event()
    holder: dict = {}

    def body() -> None:
        holder["watch"] = watch = rank_module.SpinWatch(flight, 0.3, False, __file__, reports.append)
        with watch:
            ready.set()
            _spin_in_helper(stop)

    t = threading.Thread(target=body)
    t.start()
    ready.wait(5)
    time.sleep(1.0)
    stop.append(True)
    t.join(5)
    assert reports, "no report after 1 s past a 0.3 s limit"
    report = reports[0][rank_module.SPIN_KEY]
    assert report["n"] == 0 and report["seconds"] >= 0.3 and report["interrupted"] is False
    assert [f["name"] for f in report["stack"]][-2:] == ["body", "_spin_in_helper"]
    assert (
        report["where"].startswith("line ")
        and "in _spin_in_helper (test_spin.py): while not stop:" in (report["where"])
    )


def test_where_text_tells_a_collective_from_python():
    last = {"n": 1, "op": "all_reduce", "group": (0, 1), "gseq": 1, "line": 5, "text": "x", "state": "in"}
    inside = RankRun(0, 0, flight={"last": last, "counts": {(0, 1): 1}, "n": 1})
    spin = {"n": 1, "seconds": 7.25, "limit": 2.0, "where": "line 9: while True:", "stack": []}
    python = RankRun(
        1, 1, flight={"last": {**last, "state": "out"}, "counts": {(0, 1): 1}, "n": 1}, spin=spin
    )
    assert where_text(inside) == "waiting in all_reduce #1 on group [0,1] (line 5: x)"
    assert where_text(python) == (
        "running Python for 7.2 s without reaching a collective (spin_limit 2 s), at line 9: while True: "
        "(last: all_reduce #1 on group [0,1] (line 5: x))"
    )


@pytest.mark.parametrize(
    "options, match",
    [
        ({"spin_limit": 0}, "spin_limit must be a positive number"),
        ({"spin_limit": "10"}, "spin_limit must be a positive number"),
        ({"on_spin": "kill"}, "on_spin must be 'warn'"),
    ],
)
def test_spin_options_are_checked_before_anything_starts(options, match):
    with pytest.raises(ValueError, match=match):
        cluster_module.ClusterBackend("gloo", 2, **options)
