"""Captured steps and the replay-identity check across processes (gloo), pp=2 and pp=4
(tests/distributed/workers/graphs_worker.py).

Per schedule and rank: `zb.compile(cuda_graphs=True)` with the CPU stand-in for the capture API trains 5 steps
(2 eager, capture, 3 replays) equal to single-process eager training within 1e-5, every step with a gradient on
each rank for exactly the parameters it holds that eager grades, the stand-in seeing the protocol's calls in
order; the eager pipeline passes the replay-identity check on the real gloo group (static memory, message order,
no escapes) and trains equally.
"""

from __future__ import annotations

import os

import pytest

from support.dist_cases import GRAPHS_SCHEDULES as SCHEDULES
from support.launch import Launches, pipeline_fixtures
from support.threaded import assert_graded_where_eager_is

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "graphs_worker.py")
run, run_pp2 = pipeline_fixtures(Launches(WORKER))

EAGER = ["side0 waits default", "use side0", "default waits side0"]


@pytest.mark.parametrize("name", SCHEDULES)
def test_captured_steps_and_the_replay_check_on_gloo_equal_eager(run, name):
    pp, results = run
    for rank, res in enumerate(results):
        assert "error" not in res[name], res[name].get("error")
    first = results[0][name]
    for mode in ("captured", "checked"):   # each step, a gradient exactly where eager has one, on its holders
        for k, eager in enumerate(first["eager_graded"]):
            assert_graded_where_eager_is(eager, first["holders"], [res[name][mode]["graded"][k] for res in results],
                                         f"{mode}, step {k}: ")
    for rank, res in enumerate(results):
        got = res[name]
        for mode in ("captured", "checked"):
            assert got[mode]["loss_err"] < 1e-5 and got[mode]["grad_err"] < 1e-5, (rank, mode, got[mode])
        assert got["captured"]["log"] == [*EAGER, *EAGER, "synchronize", "pool", "capture", "synchronize",
                                          "replay", "replay", "replay"], (rank, got["captured"]["log"])
        assert got["checked"]["messages"] > 0
