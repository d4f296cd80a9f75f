"""zb-auto: the automatic zero-bubble scheduler under a memory limit.

Checked against independent references: the papers' closed forms and regenerated numbers under unit costs,
the hand-made ZB-H1 / ZB-H2 under measured-looking costs, a brute force over every order on tiny pipelines,
and the shared simulator for timing and memory.
"""

from __future__ import annotations

import itertools

import pytest

from zbcompile.errors import ScheduleError
from zbcompile.passes.schedules import zb_auto as za
from zbcompile.passes.schedules.zb_auto import makespan_lower_bound, zb_auto
from zbcompile.passes.schedules.zb_auto.greedy import greedy_seeds
from zbcompile.passes.schedules.zero_bubble import zb_h1, zb_h2
from zbcompile.ir.schedule import Kind
from zbcompile.simulate import Costs, simulate

UNIT = Costs()
PROFILES = [Costs(f=1, b=1.1, w=0.6, comm=0.05), Costs(f=1, b=2, w=1, comm=0.1)]


def _run(p, m, limit, costs=UNIT):
    schedule = zb_auto(p, m, costs=costs, mem_limit=limit)
    schedule.validate().check_order()
    result = simulate(schedule, costs)
    assert max(result.peak_memory) <= limit + 1e-9, result.peak_memory
    return schedule, result


# ---- structure and contract ----------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m,limit", [(2, 1, 1), (2, 5, 1), (3, 4, 2), (4, 3, 8), (4, 8, 5), (5, 7, 5)])
@pytest.mark.parametrize("costs", [UNIT, PROFILES[0]])
def test_valid_and_within_memory(p, m, limit, costs):
    schedule, _ = _run(p, m, limit, costs)
    assert schedule.name == "zb-auto"
    assert schedule.placement == tuple(range(p))
    assert {a.kind for _, _, a in schedule.actions()} == {Kind.F, Kind.B, Kind.W}


def test_default_limit_is_pp():
    result = simulate(zb_auto(4, 8))
    assert max(result.peak_memory) == 4


def test_fractional_limit_rounds_down():
    assert max(simulate(zb_auto(4, 8, mem_limit=5.7)).peak_memory) <= 5


@pytest.mark.parametrize("limit", [0, 0.5, -3])
def test_limit_below_minimum_says_the_minimum(limit):
    with pytest.raises(ScheduleError, match="minimum of 1"):
        zb_auto(4, 8, mem_limit=limit)


def test_bad_sizes():
    with pytest.raises(ScheduleError):
        zb_auto(1, 8)
    with pytest.raises(ScheduleError):
        zb_auto(4, 0)


def test_per_stage_costs_must_match_stages():
    with pytest.raises(ScheduleError, match="per-stage"):
        zb_auto(4, 8, costs=Costs(per_stage=((1, 1, 1),) * 3))


# ---- the internal timing model is the shared simulator's ---------------------------------------------------
@pytest.mark.parametrize("costs", [UNIT, *PROFILES, Costs(per_stage=((1, 1, 1), (1.2, 2, 0.8), (0.7, 1.5, 1), (1, 3, 2)))])
def test_internal_timing_agrees_with_simulate(costs):
    p, m = 4, 6
    cs = za._Costs.read(costs, p)
    prob = cs.problem(m)
    for limit in (2, 4, 8):
        for score, orders in greedy_seeds(p, m, cs, limit, prob.codes):
            timing = prob.retime(orders)
            assert timing.score == pytest.approx(score)
            result = simulate(za._to_schedule(orders, prob, limit), costs)
            assert timing.makespan == pytest.approx(result.makespan)
            assert timing.bubble == pytest.approx(result.bubble_rate)


def test_retime_reports_deadlock():
    """Rank 1 runs F1 first; rank 0 sends F1 only after its B0, which needs rank 1's B0: a cycle."""
    prob = za._Costs.read(None, 2).problem(2)
    orders = [[prob.codes.code(k, r, mb) for k, mb in ((Kind.F, first), (Kind.F, 1 - first), (Kind.B, 0),
                                                       (Kind.B, 1), (Kind.W, 0), (Kind.W, 1))]
              for r, first in ((0, 0), (1, 1))]
    orders[0][1:3] = orders[0][2], orders[0][1]  # rank 0: F0 B0 F1 ...
    assert prob.retime(orders) is None


# ---- golden numbers under unit costs ------------------------------------------------------------------------
@pytest.mark.parametrize("p,m,rate", [(4, 8, 0.1111), (4, 12, 0.0769), (8, 8, 0.2258), (8, 24, 0.0886)])
def test_zb1p_matches_the_papers_numbers(p, m, rate):
    _, result = _run(p, m, p)
    assert result.bubble_rate == pytest.approx(rate, abs=5e-5)
    assert result.bubble_rate <= (p - 1) / (3 * m + p - 1) + 1e-9


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 12), (8, 16), (8, 24)])
def test_zb2p_has_no_bubble_once_m_reaches_2p(p, m):
    _, result = _run(p, m, 2 * p)
    assert result.bubble_rate == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("p,m", [(3, 5), (4, 8), (6, 10), (8, 24)])
def test_unit_makespan_is_the_lower_bound(p, m):
    """Under unit costs the bound is 3m + p - 1 at limit p, and zb-auto reaches it at every limit >= p."""
    assert makespan_lower_bound(p, m, UNIT, p) == 3 * m + p - 1
    for limit in (p, p + 1, 2 * p):
        assert _run(p, m, limit)[1].makespan == pytest.approx(3 * m + p - 1)


# ---- against the hand-made ZB-H1 / ZB-H2 under uneven costs ----------------------------------------------------
@pytest.mark.parametrize("costs", PROFILES, ids=str)
@pytest.mark.parametrize("p,m", [(4, 8), (4, 12), (8, 16)])
def test_beats_or_ties_handmade(costs, p, m):
    for limit, handmade in ((p, zb_h1), (2 * p, zb_h2)):
        hand = simulate(handmade(p, m), costs)
        _, auto = _run(p, m, limit, costs)
        assert auto.makespan <= hand.makespan + 1e-9, (limit, auto.makespan, hand.makespan)
        assert auto.makespan >= makespan_lower_bound(p, m, costs, limit) - 1e-9


# profiles where W outweighs B, on which the cost-reading greedy and its polish came out slower than ZB-H1's fixed
# order at the same memory (by 1.5% to 2.6%) before the search was seeded with the orders made without the costs
W_HEAVY = [(6, 12, "F=0.92,B=0.91,W=1.07,comm=0.05"), (4, 12, "F=0.34,B=0.4,W=1.45,comm=0.05"),
           (4, 8, "F=1.02,B=1.18,W=1.74,comm=0.05"), (5, 10, "F=0.35,B=1.08,W=1.58,comm=0.3"),
           (8, 16, "F=1.07,B=1.49,W=1.9,comm=0.05")]


@pytest.mark.parametrize("p,m,costs", W_HEAVY)
def test_beats_or_ties_zb_h1_where_w_outweighs_b(p, m, costs):
    """ZB-1p (mem_limit=p) under the given costs is never slower than ZB-H1 (peak p), nor than what zb-auto plans
    for unit costs, each simulated under those costs."""
    costs = Costs.parse(costs)
    _, auto = _run(p, m, p, costs)
    h1 = simulate(zb_h1(p, m), costs)
    assert max(h1.peak_memory) <= p
    assert auto.makespan <= h1.makespan + 1e-9, (auto.makespan, h1.makespan)
    assert auto.makespan <= simulate(zb_auto(p, m, mem_limit=p), costs).makespan + 1e-9


# ---- search beyond the greedy -------------------------------------------------------------------------------
@pytest.mark.parametrize("p,m,limit,costs", [(4, 4, 2, UNIT), (4, 8, 2, UNIT), (3, 5, 2, PROFILES[1])])
def test_search_improves_on_the_greedy(p, m, limit, costs):
    cs = za._Costs.read(costs, p)
    greedy = greedy_seeds(p, m, cs, limit, cs.problem(m).codes)[0][0][0]
    assert _run(p, m, limit, costs)[1].makespan < greedy - 1e-9


def _all_orders(stage, m, limit, codes):
    """Every order of one rank: F before B before W per microbatch, held activations within the limit."""
    def extend(row, done, held):
        if len(row) == 3 * m:
            yield list(row)
            return
        for mb in range(m):
            kind = done[mb]
            if kind == 3 or (kind == 0 and held >= limit):
                continue
            done[mb] += 1
            row.append(codes.code((Kind.F, Kind.B, Kind.W)[kind], stage, mb))
            yield from extend(row, done, held + (1 if kind == 0 else -1 if kind == 2 else 0))
            row.pop()
            done[mb] -= 1
    yield from extend([], [0] * m, 0)


@pytest.mark.parametrize("p,m,limit,costs", [
    (2, 2, 1, UNIT), (2, 2, 2, PROFILES[0]), (3, 2, 1, PROFILES[1]), (3, 2, 2, Costs(f=1, b=1, w=0.5, comm=0.3)),
])
def test_optimal_against_brute_force(p, m, limit, costs):
    prob = za._Costs.read(costs, p).problem(m)
    per_rank = [list(_all_orders(r, m, limit, prob.codes)) for r in range(p)]
    best = min(t.makespan for combo in itertools.product(*per_rank)
               if (t := prob.retime(list(combo))) is not None)
    assert _run(p, m, limit, costs)[1].makespan == pytest.approx(best)


# ---- large instances ---------------------------------------------------------------------------------------------------
def test_p32_m256_reaches_the_zb_h1_closed_form():
    """The size benchmarks/schedule_speed.py times; here only the result is checked."""
    result = simulate(zb_auto(32, 256))
    assert result.bubble_rate == pytest.approx(31 / (3 * 256 + 31))


# pp=4, m=3, mem_limit=2, per-stage (f, b, w): a witness order found by hand, checked below for memory and
# timed by a list scheduler of this file's own (no communication): 18.0
EXACT_COSTS = ((0.5, 0.5, 0.5), (2, 1, 0.25), (2, 1, 1), (0.5, 1, 2))
WITNESS = ["F0 F1 B0 W0 F2 B1 W1 B2 W2", "F0 F1 B0 W0 F2 B1 W1 B2 W2",
           "F0 B0 F1 W0 B1 F2 W1 B2 W2", "F0 B0 W0 F1 B1 W1 F2 B2 W2"]


def _hand_makespan(rows, costs):
    """rows[r]: (kind, microbatch) in rank r's order, stage r on rank r: F after the stage before's F, B after its
    F and the stage after's B, W after its B."""
    p, end, free, pos = len(rows), {}, [0.0] * len(rows), [0] * len(rows)
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(rows[r]):
                kind, mb = rows[r][pos[r]]
                need = {"F": [("F", r - 1, mb)] if r else [],
                        "B": [("F", r, mb)] + ([("B", r + 1, mb)] if r < p - 1 else []), "W": [("B", r, mb)]}[kind]
                if any(d not in end for d in need):
                    break
                end[(kind, r, mb)] = free[r] = max([free[r]] + [end[d] for d in need]) + costs[r]["FBW".index(kind)]
                pos[r] += 1
                moved = True
    assert all(pos[r] == len(rows[r]) for r in range(p))
    return max(end.values())


def test_the_exact_search_reaches_a_hand_found_order_on_a_small_instance():
    """Where p*m is small the branch and bound runs after the greedy and the polish: on this instance they stop
    at 18.5, and the exact search must reach the hand-found 18.0 (a witness: within the limit, every pass once)."""
    rows = [[(a[0], int(a[1:])) for a in w.split()] for w in WITNESS]
    for row in rows:
        held = [0]
        for kind, _ in row:
            held.append(held[-1] + {"F": 1, "B": 0, "W": -1}[kind])
        assert max(held) <= 2 and sorted(row) == sorted((k, mb) for k in "FBW" for mb in range(3))
    witness = _hand_makespan(rows, EXACT_COSTS)
    assert witness == 18.0
    schedule = zb_auto(4, 3, costs=Costs(per_stage=EXACT_COSTS), mem_limit=2)
    got = _hand_makespan([[(a.kind.name, a.microbatch) for a in row] for row in schedule.ranks], EXACT_COSTS)
    assert got <= witness + 1e-9, got


def test_interleave_idles_for_an_extra_pass_ready_within_wait_times_the_base_heads_cost():
    """_interleave's rule: a free rank runs the head of `extra` if ready, else the head of `base`, unless the
    extra head is ready within `wait` times the BASE head's cost (then it idles for it). Rank 0: base [a, b] (cost 1
    each), extra [x] (cost 0.1) needing d, which rank 1 ends at 1.5. At 1, b is ready and x is ready at
    1.5 < 1 + 1 * cost(b): rank 0 idles for x, so its order is a, x, b."""
    from zbcompile.ir.schedule_problem import ActionCodes, ScheduleProblem
    from zbcompile.passes.schedules._interleave import interleave

    codes = ActionCodes(1, 1)
    n = max(codes.size, 4)
    a, b, x, d = range(4)
    deps = [()] * n
    deps[x] = (d,)
    cost = [0.0] * n
    cost[a], cost[b], cost[x], cost[d] = 1.0, 1.0, 0.1, 1.5
    rank_of = [0] * n
    rank_of[d] = 1
    problem = ScheduleProblem(codes, deps, cost, [0.0] * n, rank_of, 0.0)
    assert interleave(problem, base=[[a, b], [d]], extra=[[x], []], wait=1.0)[0] == [a, x, b]
