"""Activation offload under a device-memory budget, multi-process (gloo): every schedule at pp=2 and pp=4.

Each rank's budget is half its planned peak without offload, or the least peak any offload reaches there where
that is more (tests/distributed/workers/offload_worker.py): the planner must offload saved tensors, longest-lived
first, wherever offload can lower a rank's peak at all (not on a last stage whose backward follows each forward).
Checked per schedule and rank: the loss and first-step gradients equal eager training within 1e-5 relative, the
planned device peak fits the budget, the storage tracker's measured peak is within 10% of the plan, and where
offload can lower a rank's peak the budget is below that rank's measured peak without offload and the measured
peak with offload is lower than without.
"""

from __future__ import annotations

import os

import pytest

from support.dist_cases import OFFLOAD_SCHEDULES as SCHEDULES
from support.launch import Launches, pipeline_fixtures

pytestmark = [pytest.mark.dist, pytest.mark.slow]

WORKER = os.path.join(os.path.dirname(__file__), "workers", "offload_worker.py")
run, run_pp2 = pipeline_fixtures(Launches(WORKER))


@pytest.mark.parametrize("name", SCHEDULES)
def test_offload_fits_budget_and_equals_eager(run, name):
    """Against quantities the worker measured or planned, not its budget expression: the plan with offload fits the
    budget the worker used, and so does the storage tracker's measured peak (the resident bytes plus the step's,
    up to the plan's 10% accuracy); where offload can lower a rank's peak, the budget is below the peak that rank
    measured without offload (offload had work to do), and the tracker measures a lower peak with offload than
    without; and every schedule has such a rank."""
    pp, results = run
    lowered = 0
    for rank, res in enumerate(results):
        got = res[name]
        assert "error" not in got, got.get("error")
        assert got["loss_err"] < 1e-5 and got["loss2_err"] < 1e-5 and got["grad_err"] < 1e-5, (rank, got)
        assert got["peak_planned"] <= got["budget"], (rank, got)
        assert abs(got["dynamic_planned"] - got["measured"]) <= 0.10 * got["measured"], (rank, got)
        assert got["resident"] + got["measured"] <= got["budget"] + 0.10 * got["measured"], (rank, got)
        if got["floor"] < got["peak_plain"]:   # offload can lower this rank's peak
            assert got["budget"] < got["resident"] + got["measured_plain"], (rank, got)
            assert got["measured"] < got["measured_plain"], (rank, got)
            assert got["offloaded"] > 0 and got["host"] > 0, (rank, got)
            lowered += 1
    assert lowered, f"{name}: offload had nothing to do on any rank"
