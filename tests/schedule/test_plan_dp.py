"""`zbcompile plan --dp-comm`: the data-parallel reductions' cost by simulation (zbcompile/plan_dp.py), against what
the schedules' shapes say in closed form."""

from __future__ import annotations

import pytest

from zbcompile.__main__ import main
from zbcompile.passes.schedules import generate
from zbcompile.plan_dp import _stream, dp_row, regroup_trailing_ws
from zbcompile.simulate import Costs, simulate


def test_1f1b_hides_nothing_its_reduction_comes_after_the_last_backward():
    """1F1B: each rank's one stage is final at its last action, so every placement adds the full reduction."""
    row = dp_row(generate("1f1b", 2, 8), Costs(), 1.0)
    assert row.end == pytest.approx(row.no_dp + 1.0)
    assert row.placed == row.end and row.groups == row.end


@pytest.mark.parametrize("name", ["zbv", "zb-h1", "v-half"])
def test_placement_and_groups_never_cost_more_than_the_end(name):
    row = dp_row(generate(name, 4, 16), Costs(), 2.0)
    assert row.no_dp <= row.groups <= row.placed + 1e-9 <= row.end + 1e-9
    assert row.groups < row.end   # the trailing W's always hide a share


def test_zbv_closed_form():
    """zbv, p=2, m=8, F=B=W=1, comm 1 per 1F1B stage (1/2 per model stage): rank 0 finishes last with 0W7;
    its stage-3 reduction (1/2) hides behind the tail placed, and the groups of the trailing 0W7 leave only the
    last quarter of stage 0's exposed: 1/8."""
    row = dp_row(generate("zbv", 2, 8), Costs(), 1.0)
    assert row.end == pytest.approx(row.no_dp + 1.0)
    assert row.placed == pytest.approx(row.no_dp + 0.5)
    assert row.groups == pytest.approx(row.no_dp + 0.125)


def test_regrouping_keeps_everything_before_the_trailing_ws():
    s = generate("zbv", 2, 8)
    for old, new in zip(s.ranks, regroup_trailing_ws(s).ranks):
        assert sorted(map(str, old)) == sorted(map(str, new))
        k = next(k for k in range(len(old), 0, -1) if old[k - 1].kind.name != "W")
        assert old[:k] == new[:k]


def test_stream_runs_jobs_in_order_not_before_ready():
    assert _stream([(1.0, 2.0), (1.5, 1.0), (10.0, 0.5)]) == 10.5


def test_cli_compare_prints_every_placement(capsys):
    assert main(["plan", "--compare", "--pp", "2", "-m", "8", "--dp-comm", "1"]) == 0
    out = capsys.readouterr().out
    assert "placed, W groups" in out and "zbv" in out and "hidden" in out


def test_placed_reductions_queue_on_the_ranks_one_stream():
    """zbv, pp=2, m=4, unit costs, T=3 (each of a rank's two V stages reduces half a 1F1B stage: 1.5): from the
    simulated timeline, each rank's reductions start when ready AND when the previous one on its one stream is
    done (hand recurrence); "placed" ends with the last of them or the last action."""
    schedule, costs, comm = generate("zbv", 2, 4), Costs(), 3.0
    result = simulate(schedule, costs)
    want = 0.0
    for row in result.schedule.ranks:
        ready = sorted(max(result.end[a] for a in row if a.stage == s and a.kind.name != "F")
                       for s in {a.stage for a in row})
        t = 0.0
        for r in ready:
            t = max(t, r) + comm / 2
        want = max(want, max(result.end[a] for a in row), t)
    assert dp_row(schedule, costs, comm).placed == pytest.approx(want, abs=1e-9)
