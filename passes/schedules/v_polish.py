"""Cost-aware polish of a hand-made schedule: bounded hill climbing on the order, under its own peak memory.

    schedule, costs  ->  polish  ->  the same passes, reordered where that shortens the makespan

The hand-made orders (zbv, v-zb) are built for unit costs. With uneven F/B/W times or a hop cost they
leave idle gaps that a few local moves close. The climb (first improvement, like zb-auto's improvement):

    moves      into every idle gap, largest first: the next W, F and B of that rank from later slots;
               then every W one slot later (it may delay a critical B or F); then every pass one slot
               earlier (a swap with its neighbour)
    accepted   when the re-timed (makespan, bubble rate) improves (`_search.better`), and no rank holds
               more activations than the input schedule's peak (the cap: p for zbv)
    timing     `ScheduleProblem.retime`, the simulator's own list scheduling on action codes; an order
               that deadlocks is rejected there

Work is bounded in simulated actions (`_WORK`), never in seconds, so the result is the same on every
machine; above `_MAX_ACTIONS` passes the schedule is returned unchanged. Unit costs, or any uniform F = B = W
with no hop cost (a rescaling of them), return the schedule unchanged as well: the hand-made orders are
built for that model. The result is never worse than the input: a move is only kept when it improves.
"""

from __future__ import annotations

from typing import Any

from zbcompile.ir.schedule import Kind, Schedule, build
from zbcompile.ir.schedule_problem import ScheduleProblem
from zbcompile.ir.costs import Costs, MemoryModel

from ._search import EPS, better, local_moves

__all__ = ["polish"]

_MAX_ACTIONS = 4000
_WORK = 400_000  # simulated actions per polish
_REACH = 6  # slots a critical pass (or the one it waits for) may move


def _as_costs(costs: Any) -> Costs:
    if isinstance(costs, Costs):
        return costs
    per_stage = getattr(costs, "per_stage", None)
    return Costs(costs.f, costs.b, costs.w, getattr(costs, "comm", 0.0), per_stage)


def _unit_like(costs: Costs) -> bool:
    return costs.per_stage is None and costs.comm == 0 and costs.f == costs.b == costs.w


class _Problem:
    """The schedule as a `ScheduleProblem` (codes, dependencies, costs, memory deltas) plus the polish's
    own move generation. `orders` holds the input's per-rank orders as codes."""

    def __init__(self, schedule: Schedule, costs: Costs):
        self.schedule = schedule
        self.problem, self.orders = ScheduleProblem.of_schedule(schedule, costs, MemoryModel())
        self.codes = self.problem.codes
        self.ids = [c for row in self.orders for c in row]  # rank by rank: the tie-break order of the climb
        self.is_w = [False] * self.codes.size
        for c in self.ids:
            self.is_w[c] = self.codes.kind(c) is Kind.W

    def retime(self, orders: list[list[int]]) -> tuple[list[float], float, float] | None:
        """(start per code, makespan, bubble rate) by the simulator's own timing model; None on a deadlock."""
        timing = self.problem.retime(orders)
        return None if timing is None else (timing.start, timing.makespan, timing.bubble)

    def moves(self, orders: list[list[int]], start: list[float]) -> list[tuple[int, int, int]]:
        """Candidate moves (rank, from, to), most promising first (see the module docstring)."""
        cost = self.problem.cost

        def hole(r: int, i: int) -> float:
            row = orders[r]
            return start[row[i]] - (start[row[i - 1]] + cost[row[i - 1]])

        return self.critical_moves(orders, start) + local_moves(orders, hole, self.codes.kind,
                                                                 self.is_w.__getitem__)

    def critical_moves(self, orders: list[list[int]], start: list[float]) -> list[tuple[int, int, int]]:
        """Moves along the critical path: walk back from the action that ends last; where an action waits
        for the pass before it on its rank (not for an input), try it up to `_REACH` slots earlier and that
        pass up to `_REACH` slots later."""
        where = {}
        for r, row in enumerate(orders):
            for k, i in enumerate(row):
                where[i] = (r, k)
        prob = self.problem
        cost, deps, rank_of, comm = prob.cost, prob.deps, prob.rank_of, prob.comm
        ids = self.ids
        last = max(range(len(ids)), key=lambda k: (start[ids[k]] + cost[ids[k]], -k))
        i = ids[last]
        moves: list[tuple[int, int, int]] = []
        while True:
            r, k = where[i]
            if k > 0 and abs(start[orders[r][k - 1]] + cost[orders[r][k - 1]] - start[i]) <= EPS:
                moves += [(r, k, k - d) for d in range(1, min(_REACH, k) + 1)]
                moves += [(r, k - 1, k - 1 + d) for d in range(1, _REACH + 1) if k - 1 + d < len(orders[r])]
                i = orders[r][k - 1]
                continue
            nxt = None
            for d in deps[i]:
                if abs(start[d] + cost[d] + (comm if rank_of[d] != r else 0.0) - start[i]) <= EPS:
                    nxt = d
                    break
            if nxt is None:
                break
            i = nxt
        return moves

    def blocked(self, row: list[int], src: int, dst: int) -> bool:
        """Whether moving row[src] to dst jumps over a same-rank dependency (the order would deadlock)."""
        deps = self.problem.deps
        x = row[src]
        if dst < src:
            need = deps[x]
            return any(row[k] in need for k in range(dst, src))
        return any(x in deps[row[k]] for k in range(src + 1, dst + 1))


def polish(schedule: Schedule, costs: Any, *, work: int = _WORK, max_actions: int = _MAX_ACTIONS) -> Schedule:
    """`schedule` reordered by the bounded climb under `costs` (see the module docstring), or `schedule`
    itself when costs are None or unit-like, the instance is above `max_actions` passes, or nothing helps.

    No rank ever holds more activations than the input's worst rank does.
    """
    if costs is None:
        return schedule
    costs = _as_costs(costs)
    if _unit_like(costs):
        return schedule
    if sum(map(len, schedule.ranks)) > max_actions or any(a.kind is Kind.BW for row in schedule.ranks for a in row):
        return schedule
    prob = _Problem(schedule, costs)
    orders = prob.orders
    cap = max(prob.problem.peak(row) for row in orders)
    timed = prob.retime(orders)
    if timed is None:
        return schedule
    start, makespan, bubble = timed
    score = (makespan, bubble)
    size = len(prob.ids)
    spent, improved = size, False
    while spent + size <= work:
        for r, src, dst in prob.moves(orders, start):
            if spent + size > work:
                break
            row = orders[r]
            if prob.blocked(row, src, dst):
                continue
            row = row[:]
            row.insert(dst, row.pop(src))
            if not prob.problem.fits(row, cap):
                continue
            trial = orders[:r] + [row] + orders[r + 1:]
            spent += size
            t = prob.retime(trial)
            if t is not None and better((t[1], t[2]), score):
                orders, (start, score), improved = trial, (t[0], (t[1], t[2])), True
                break
        else:
            break
    if not improved:
        return schedule
    ranks = [[prob.codes.action(c) for c in row] for row in orders]
    return build(schedule.name, schedule.num_microbatches, schedule.placement, ranks)
