"""`zbcompile plan --step-boundary`: the synchronous optimizer step against post-validation by simulation of
consecutive iterations (zbcompile/plan_boundary.py), against closed forms of the schedules' shapes."""

from __future__ import annotations

import json

import pytest

from zbcompile.__main__ import main
from zbcompile.passes.schedules import generate
from zbcompile.plan_boundary import _prefix, boundary_row
from zbcompile.simulate import Costs, simulate

P, M = 4, 16


def test_a_rank_start_shifts_the_whole_timing():
    """simulate(rank_start=) with every rank starting at c: every action c later, the makespan c longer."""
    s = generate("zb-h2", P, M)
    base, shifted = simulate(s, Costs()), simulate(s, Costs(), rank_start=[3.5] * P)
    assert all(shifted.start[a] == base.start[a] + 3.5 for a in base.start)
    assert shifted.makespan == base.makespan + 3.5


def test_synchronous_iterations_are_the_makespan_plus_the_boundary():
    """Synchronous: every iteration starts when the last rank has stepped, so in steady state one iteration
    takes the makespan, the all-reduce and the optimizer step."""
    for name in ("1f1b", "zb-h1", "zbv"):
        row = boundary_row(generate(name, P, M), Costs(), opt=1.0, latency=0.1)
        assert row.synchronous == pytest.approx(row.makespan + 1.1)


def test_post_validated_zero_bubble_schedules_run_at_their_work_per_rank():
    """ZB-H2 and ZB-V leave no bubble in steady state once the next iteration's warm-up may start under the
    previous one's tail: an iteration takes m (F + B + W) + the optimizer step, less than one iteration alone."""
    for name in ("zb-h2", "zbv"):
        row = boundary_row(generate(name, P, M), Costs(), opt=1.0)
        assert row.post_validated == pytest.approx(M * 3 + 1.0)
        assert row.post_validated < row.makespan < row.synchronous


def test_1f1b_gains_only_the_all_reduce_its_first_rank_finishes_last():
    """1F1B's rank 0 runs the last backward, so the next iteration cannot start earlier: post-validation saves
    just the synchronous all-reduce (rank 0 waits for no prefix)."""
    row = boundary_row(generate("1f1b", P, M), Costs(), opt=1.0, latency=0.25)
    assert row.synchronous - row.post_validated == pytest.approx(0.25)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "v-half",
                                  "dualpipev", "zb-auto"])
def test_without_latency_post_validation_never_costs_more(name):
    row = boundary_row(generate(name, P, M), Costs(), opt=0.5)
    assert row.post_validated <= row.synchronous + 1e-9


def test_the_prefix_travels_from_rank_0():
    assert _prefix([5.0, 3.0, 9.0, 9.0], 1.0) == [5.0, 6.0, 9.0, 10.0]


def test_plan_cli_step_boundary(capsys):
    assert main(["plan", "--compare", "--pp", str(P), "-m", str(M), "--step-boundary", "1",
                 "--boundary-latency", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "post-validated, per iteration" in text and "zb-h2" in text
    assert main(["plan", "--schedule", "zb-h2", "--pp", str(P), "-m", str(M), "--step-boundary", "1", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    (row,) = got["schedules"]
    assert row["name"] == "zb-h2" and row["post_validated"] == pytest.approx(M * 3 + 1.0)
    assert row["gain"] == pytest.approx(1 - row["post_validated"] / row["synchronous"])
