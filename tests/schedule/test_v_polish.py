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


def _makespan_by_hand(schedule, costs: Costs) -> float:
    """The documented timing model (zbcompile/simulate.py's docstring), written out independently of it: each
    rank runs its actions in order; an action starts when its rank is free and every dependency has ended, plus
    `comm` where the dependency ran on another rank. F(s) needs F(s-1), B(s) needs F(s) and B(s+1), W(s) needs
    B(s), all of the same microbatch; each costs its Costs field times p/S (half, for a V's chunks)."""
    S, p = len(schedule.placement), schedule.num_ranks
    dur = {"F": costs.f * p / S, "B": costs.b * p / S, "W": costs.w * p / S}
    end: dict[tuple, float] = {}
    free, nxt = [0.0] * p, [0] * p
    while any(nxt[r] < len(schedule.ranks[r]) for r in range(p)):
        moved = False
        for r, row in enumerate(schedule.ranks):
            while nxt[r] < len(row):
                a = row[nxt[r]]
                kind, s, mb = a.kind.name, a.stage, a.microbatch
                deps = {"F": [("F", s - 1)] if s > 0 else [], "W": [("B", s)],
                        "B": [("F", s)] + ([("B", s + 1)] if s < S - 1 else [])}[kind]
                if any((k, t, mb) not in end for k, t in deps):
                    break
                start = max([free[r]] + [end[(k, t, mb)] + (costs.comm if schedule.placement[t] != r else 0.0)
                                         for k, t in deps])
                end[(kind, s, mb)] = free[r] = start + dur[kind]
                nxt[r] += 1
                moved = True
        assert moved, "the order deadlocks"
    return max(end.values())


def test_polish_improves_the_reported_profile():
    """zbv at p=4, m=8 under F=1, B=2, W=1, comm=0.1: the handcrafted order's makespan is the one the timing model
    gives by hand (36.6: each rank's 32 units of work plus 4.6 of bubble), and the polish beats it, yet not below
    any rank's work, m * (F + B + W)."""
    costs = Costs(1, 2, 1, 0.1)
    before = simulate(generate("zbv", 4, 8), costs).makespan
    after = simulate(generate("zbv", 4, 8, costs=costs), costs).makespan
    assert before == pytest.approx(_makespan_by_hand(generate("zbv", 4, 8), costs))
    assert 8 * (1 + 2 + 1) <= after < before - 1e-6
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
