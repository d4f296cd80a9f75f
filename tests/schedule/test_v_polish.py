"""The cost-aware polish of zbv / v-zb (passes/schedules/v_polish.py)."""

from __future__ import annotations

import pytest

from zbcompile.passes.schedules import generate
from zbcompile.passes.schedules.v_polish import _Problem, polish
from zbcompile.passes.schedules.v_shape import zbv
from zbcompile.simulate import Costs, simulate

PROFILES = [Costs(1, 2, 1, 0.1), Costs(1, 1, 0.5, 0.2), Costs(1, 1.1, 0.6, 0.05)]
SHAPES = [(2, 1), (2, 5), (3, 4), (4, 3), (4, 8), (4, 9)]


def _per_stage(p: int) -> Costs:
    """Uneven costs per V stage (2p of them)."""
    return Costs(f=1, b=1, w=1, comm=0, per_stage=tuple((1 + 0.1 * (s % 3), 1.5, 0.4) for s in range(2 * p)))


@pytest.mark.parametrize("costs,p,m", [(c, p, m) for c in PROFILES for p, m in SHAPES]
                         + [(_per_stage(p), p, m) for p, m in SHAPES], ids=str)
def test_polished_zbv_is_valid_capped_and_never_worse(costs, p, m):
    base, tuned = zbv(p, m), zbv(p, m, costs)
    tuned.validate().check_order()
    assert sorted(a for row in tuned.ranks for a in row) == sorted(a for row in base.ranks for a in row)
    before, after = simulate(base, costs), simulate(tuned, costs)
    assert after.makespan <= before.makespan + 1e-9
    assert max(after.peak_memory) <= max(before.peak_memory) <= p


@pytest.mark.parametrize("name", ["zbv", "v-zb"])
@pytest.mark.parametrize("p,m", [(4, 8), (3, 2)])
def test_unit_costs_keep_the_handcrafted_order(name, p, m):
    plain = generate(name, p, m)
    for costs in (None, Costs(), Costs(2, 2, 2, 0)):
        assert generate(name, p, m, costs=costs).ranks == plain.ranks


def test_polish_improves_the_reported_profile():
    costs = Costs(1, 2, 1, 0.1)
    before = simulate(generate("zbv", 4, 8), costs).makespan
    after = simulate(generate("zbv", 4, 8, costs=costs), costs).makespan
    assert before == pytest.approx(36.6)
    assert after < before - 1e-6
    assert simulate(generate("v-zb", 4, 8, costs=costs), costs).makespan == pytest.approx(after)


def test_polish_is_deterministic():
    costs = Costs(1, 1.1, 0.6, 0.05)
    assert zbv(4, 6, costs).ranks == zbv(4, 6, costs).ranks


def test_large_instances_are_left_alone():
    costs = Costs(1, 2, 1, 0.1)
    base = zbv(4, 8)
    assert polish(base, costs, max_actions=10).ranks == base.ranks


@pytest.mark.parametrize("costs", PROFILES[:3], ids=str)
def test_retime_agrees_with_simulate(costs):
    for schedule in (zbv(4, 8), zbv(3, 2), generate("v-half", 4, 6)):
        prob = _Problem(schedule, costs)
        start, makespan, bubble = prob.retime(prob.orders)
        sim = simulate(schedule, costs)
        assert makespan == pytest.approx(sim.makespan, abs=1e-12)
        assert bubble == pytest.approx(sim.bubble_rate, abs=1e-12)
        assert all(start[prob.codes.of(a)] == pytest.approx(sim.start[a], abs=1e-12) for a in sim.start)


def test_retime_rejects_a_deadlocked_order():
    schedule = zbv(2, 2)
    prob = _Problem(schedule, Costs(1, 2, 1, 0.1))
    orders = [row[:] for row in prob.orders]
    orders[0].reverse()  # a W before its B
    assert prob.retime(orders) is None
