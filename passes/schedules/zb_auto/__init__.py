"""ZB-auto: the Zero Bubble paper's automatic scheduler under a memory limit, plus a search on top of it.

One stage per rank (stage s on rank s), actions F, B, W. Memory counts 1F1B-stage activations of one
microbatch: F holds 1, B frees nothing, W frees 1 (the authors' conservative model). The limit is the most a
rank may hold at once: p gives ZB-1p (1F1B's memory), 2p gives ZB-2p.

    costs, limit
      -> greedy      the authors' list scheduler, every combination of its 3 switches, under the limit and
                     under a few tighter caps (a tighter cap sometimes times better with uneven costs); with
                     costs given, also ZB-H1's order and the greedy's orders under unit costs, timed under the
                     costs (the cost-reading greedy can miss them where W outweighs B)
      -> improve     hill climbing on the best seeds: move one action to another slot of its rank
                     (an idle gap, a neighbour), re-time, keep the move while (makespan, bubble) improves
      -> exact       branch and bound over active schedules on small instances (p*m <= 24), seeded with
                     the best so far; it proves optimality when it finishes inside its node budget
      -> Schedule    validated; its timing is the shared simulator's (list scheduling)

Layout: this module holds the entry point, the cost reading and the lower bound; `greedy.py` the authors'
list scheduler; `search.py` the improvement and the exact search. Orders are per-rank lists of action
codes of one `zbcompile.ir.schedule_problem.ScheduleProblem` (its `chain` over the loop placement), which also
times them and counts their memory.

`makespan_lower_bound` (forced idle before the first B and after the last F of each rank) stops the search
as soon as a schedule reaches it; under unit costs the greedy already does at every limit >= p, and on the
measured-looking profiles tried so far (p=4..32) it does at limits p and 2p.

Every stage is bounded by a budget counted in work (simulated actions, search nodes), never in seconds, so the
result is the same on every machine. Above 4000 passes (p=32, m=256 has 24576) only the greedy runs, and
runs that could not differ are skipped: about 0.15 s there.

Timing model: `ScheduleProblem.retime`, the simulator's list scheduling, with the dependencies of the kind
table (F(s, i) needs F(s-1, i); B(s, i) needs F(s, i) and B(s+1, i); W(s, i) needs B(s, i)). The objective
is the makespan, ties broken by the papers' bubble rate (the worst rank's idle share of its own span).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from zbcompile.errors import ScheduleError
from zbcompile.ir.schedule import Schedule, build, loop_placement
from zbcompile.ir.schedule_problem import ScheduleProblem

from .._common import check_microbatches, check_pp
from .._search import EPS, better
from ..zero_bubble import zb_h1
from .greedy import greedy_seeds
from .search import exact, improve

__all__ = ["zb_auto", "min_memory_limit", "makespan_lower_bound"]

# Work budgets (see the module docstring). Above _SEARCH_MAX_ACTIONS passes in all, only the authors' 8 greedy
# runs at the limit happen. Improvement: simulated passes across all re-timings of one seed.
# Exact search: nodes of the branch and bound tree; it only runs where a rank holds few passes.
_SEARCH_MAX_ACTIONS = 4000
_IMPROVE_WORK = 150_000
_EXACT_NODES = 60_000
_EXACT_MAX_CELLS = 24  # p * m


def min_memory_limit(pp: int, microbatches: int) -> int:
    """The smallest limit any schedule runs under: 1 (each rank runs F, B, W for one microbatch at a time).

    A rank's first action is an F, which holds one unit until its W; no order avoids that, and with one unit
    the fully sequential order (F0 B0 W0 F1 B1 W1 ... on every rank) is valid.
    """
    return 1


# ---- costs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Costs:
    """Per-stage F/B/W times and the hop time, read off a `zbcompile.simulate.Costs` (or a look-alike)."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float

    @staticmethod
    def read(costs: Any, pp: int) -> _Costs:
        if costs is None:
            return _Costs((1.0,) * pp, (1.0,) * pp, (1.0,) * pp, 0.0)
        per_stage = getattr(costs, "per_stage", None)
        if per_stage is not None:
            if len(per_stage) != pp:
                raise ScheduleError(f"zb-auto: costs give {len(per_stage)} per-stage (f, b, w) triples for "
                                    f"{pp} stages; give one triple per stage or none")
            rows = [tuple(float(x) for x in t) for t in per_stage]
        else:
            rows = [(float(costs.f), float(costs.b), float(costs.w))] * pp
        comm = float(getattr(costs, "comm", 0.0))
        values = [x for row in rows for x in row] + [comm]
        if any(math.isnan(x) or math.isinf(x) or x < 0 for x in values):
            raise ScheduleError(f"zb-auto: costs must be finite and non-negative, got {costs!r}")
        return _Costs(tuple(r[0] for r in rows), tuple(r[1] for r in rows), tuple(r[2] for r in rows), comm)

    def of(self, stage: int) -> tuple[float, float, float]:
        return self.f[stage], self.b[stage], self.w[stage]

    def problem(self, m: int) -> ScheduleProblem:
        """F, B, W of every (stage, microbatch), stage s on rank s, with these times; memory F +1, W -1."""
        p = len(self.f)
        return ScheduleProblem.chain(p, m, loop_placement(p), [self.of(r) for r in range(p)], self.comm)


def makespan_lower_bound(pp: int, microbatches: int, costs: Any = None, mem_limit: float | None = None) -> float:
    """A makespan no schedule under `mem_limit` beats (loop placement, one stage per rank).

    For rank r with n = min(limit, m) activations at most:
      * its first B cannot start before B0 has gone down and back up, at `first_b`; until then it can only
        run forwards (at most n of them, none before F0 reaches it at `head`), so at least
        W_r - min(n f_r, first_b - head) of its work W_r comes after `first_b`;
      * after its last F it holds at most n microbatches, so at most n (b_r + w_r) of work, yet that F's
        microbatch still has to travel down and back and run B and W here (`round_trip`); any excess is idle.
    The bound is the largest of these over ranks. Under unit costs it equals ZB-1p's 3m + p - 1 at limit p.
    """
    p, m = int(pp), int(microbatches)
    cs = _Costs.read(costs, p)
    n = min(m, int(p if mem_limit is None else mem_limit))
    c = cs.comm
    bound = 0.0
    for r in range(p):
        head = sum(cs.f[:r]) + r * c
        first_b = sum(cs.f) + (p - 1) * c + sum(cs.b[r + 1:]) + (p - 1 - r) * c
        work = m * sum(cs.of(r))
        after_first_b = first_b - min(n * cs.f[r], first_b - head) + work
        round_trip = sum(cs.f[r + 1:]) + sum(cs.b[r + 1:]) + 2 * (p - 1 - r) * c + cs.b[r] + cs.w[r]
        if m > n:  # the first B comes before the last F
            bound = max(bound, after_first_b + max(0.0, round_trip - n * (cs.b[r] + cs.w[r])))
        else:
            bound = max(bound, after_first_b, head + m * cs.f[r] + round_trip)
    return bound


# ---- entry point ----------------------------------------------------------------------------------------
def zb_auto(pp: int, microbatches: int, *, costs: Any = None, mem_limit: float | None = None) -> Schedule:
    """The shortest F/B/W schedule this pass finds for `pp` ranks and `microbatches` under `mem_limit`.

    costs      a `zbcompile.simulate.Costs` (or any object with f, b, w, comm and optional per_stage
               (f, b, w) triples); None means unit costs, no comm.
    mem_limit  activations a rank may hold, in 1F1B-stage microbatch units; None means pp (ZB-1p), 2*pp is
               ZB-2p. Fractions round down. Below 1 nothing can run: ScheduleError.
    Returns a validated `Schedule` named "zb-auto" on the loop placement; every rank's held activations stay
    within the limit at every step.
    """
    check_pp("zb-auto", pp)
    check_microbatches("zb-auto", pp, microbatches, 1, "1", "")
    p, m = pp, microbatches
    if mem_limit is None:
        mem_limit = p
    if math.isnan(mem_limit) or mem_limit < min_memory_limit(p, m):
        raise ScheduleError(
            f"zb-auto: mem_limit={mem_limit} is below the minimum of {min_memory_limit(p, m)}: every rank must "
            f"hold at least one F's activations until its W. Use mem_limit >= 1 (pp={p} gives ZB-1p, "
            f"{2 * p} gives ZB-2p)")
    # More than one unit per microbatch can never be used.
    limit = int(min(mem_limit, m))
    cs = _Costs.read(costs, p)
    prob = cs.problem(m)

    floor = makespan_lower_bound(p, m, costs, limit)
    seeds = greedy_seeds(p, m, cs, limit, prob.codes, tighter_caps=3 * p * m <= _SEARCH_MAX_ACTIONS)
    if costs is not None:
        seeds = sorted(seeds + _unit_cost_seeds(p, m, limit, prob), key=lambda seed: seed[0])
    best_score, best = seeds[0]
    if 3 * p * m <= _SEARCH_MAX_ACTIONS:
        # At the bound only the bubble can still improve: polish the best seed alone.
        for _, orders in seeds[:1 if best_score[0] <= floor + EPS else 3]:
            cand, t = improve(orders, prob, limit, _IMPROVE_WORK, floor)
            if better(t.score, best_score):
                best, best_score = cand, t.score
    if p * m <= _EXACT_MAX_CELLS and best_score[0] > floor + EPS:
        found, _ = exact(prob, p, m, cs, limit, best_score[0], _EXACT_NODES)
        if found is not None:  # polish the bubble of the new best; its makespan cannot drop any further
            best, _ = improve(found, prob, limit, _IMPROVE_WORK, floor)
    return _to_schedule(best, prob, limit)


def _unit_cost_seeds(p: int, m: int, limit: int, prob: ScheduleProblem) -> list:
    """(score, orders) under the given costs of the orders made without them: ZB-H1's, and the greedy's under
    unit costs, each where it fits the limit. The greedy reads the costs to order a rank's passes and can miss
    what these fixed orders get (with W costlier than B it came out up to 2.6% slower than ZB-H1 at the same
    memory); seeding the search with them makes zb-auto at least as good as each."""
    unit = greedy_seeds(p, m, _Costs.read(None, p), limit, prob.codes, tighter_caps=False)
    h1 = [[prob.codes.of(a) for a in row] for row in zb_h1(p, m).ranks]
    seeds = []
    for orders in [h1, *(orders for _, orders in unit)]:
        timing = prob.retime(orders) if all(prob.fits(row, limit) for row in orders) else None
        if timing is not None:
            seeds.append((timing.score, orders))
    return seeds


def _to_schedule(orders: list[list[int]], prob: ScheduleProblem, limit: int) -> Schedule:
    """Freeze and check the structure (`build`) and the memory. Every stage above only yields orders that
    time without deadlock (the greedy and the exact search place passes after their inputs; the improvement
    keeps only orders that re-time), so the dependency check is left to the tests."""
    codes = prob.codes
    ranks = [[codes.action(c) for c in row] for row in orders]
    schedule = build("zb-auto", codes.num_microbatches, loop_placement(len(orders)), ranks)
    over = [r for r, row in enumerate(orders) if not prob.fits(row, limit)]
    if over:
        raise ScheduleError(f"zb-auto: ranks {over} exceed mem_limit={limit} (a bug in this pass; please "
                            f"report it with pp, microbatches, costs and mem_limit)\n{schedule.format_grid()}")
    return schedule
