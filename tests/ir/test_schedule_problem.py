"""The integer-coded schedule problem shared by the simulator and the searches."""

from __future__ import annotations

import pytest

from zbcompile.errors import ScheduleError
from zbcompile.passes.schedules import generate
from zbcompile.ir.schedule import Action, Kind, loop_placement
from zbcompile.ir.schedule_problem import ActionCodes, ScheduleProblem
from zbcompile.simulate import Costs, MemoryModel, simulate


def test_codes_round_trip_and_order() -> None:
    codes = ActionCodes(num_stages=5, num_microbatches=3)
    actions = [Action(k, s, mb) for mb in range(3) for s in range(5) for k in Kind]
    assert [codes.of(a) for a in actions] == list(range(codes.size))
    assert all(codes.action(codes.of(a)) == a and codes.kind(codes.of(a)) is a.kind for a in actions)


@pytest.mark.parametrize("name", ["zb-h1", "1f1b", "zbv"])
def test_chain_agrees_with_the_schedule_rule(name: str) -> None:
    """For split-backward schedules on one pipeline the chain's tables equal what of_schedule reads off."""
    schedule = generate(name, 4, 6)
    costs = Costs(f=1, b=1.1, w=0.6, comm=0.05)
    scale = schedule.num_ranks / schedule.num_stages
    times = [(costs.f * scale, costs.b * scale, costs.w * scale)] * schedule.num_stages
    chain = ScheduleProblem.chain(schedule.num_stages, 6, schedule.placement, times, costs.comm, scale)
    prob, orders = ScheduleProblem.of_schedule(schedule, costs, MemoryModel())
    for c in (c for row in orders for c in row):
        if prob.codes.kind(c) is not Kind.BW:
            assert (chain.deps[c], chain.cost[c], chain.delta[c], chain.rank_of[c]) == \
                   (prob.deps[c], prob.cost[c], prob.delta[c], prob.rank_of[c])
    timing = prob.retime(orders)
    sim = simulate(schedule, costs)
    assert timing.makespan == sim.makespan and timing.bubble == pytest.approx(sim.bubble_rate, abs=1e-12)
    assert [prob.peak(row) for row in orders] == list(sim.peak_memory)


def test_in_rank_order_and_fits() -> None:
    prob = ScheduleProblem.chain(2, 2, loop_placement(2), [(1, 1, 1)] * 2)
    c = prob.codes
    row = [c.code(Kind.F, 0, 0), c.code(Kind.F, 0, 1), c.code(Kind.B, 0, 0), c.code(Kind.W, 0, 0)]
    assert prob.in_rank_order(row) and prob.peak(row) == 2 and prob.fits(row, 2) and not prob.fits(row, 1)
    assert not prob.in_rank_order([row[0], row[3], row[2]])  # W before its B


def test_of_schedule_names_a_broken_dependency() -> None:
    schedule = generate("zb-h1", 2, 2)
    rows = [tuple(a for a in row if a != Action(Kind.F, 0, 1)) for row in schedule.ranks]
    broken = type(schedule)(schedule.name, 2, schedule.placement, tuple(rows))
    with pytest.raises(ScheduleError, match="broken dependency: 0B1 needs 0F1, which no rank runs"):
        ScheduleProblem.of_schedule(broken, Costs(), MemoryModel())
