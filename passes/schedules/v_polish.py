"""Cost-aware polish of a hand-made schedule: bounded hill climbing on the order, under its own peak memory.

    schedule, costs  ->  polish  ->  the same passes, reordered where that shortens the makespan

The hand-made orders (zbv, v-zb) are built for unit costs. With uneven F/B/W times or a hop cost they
leave idle gaps that a few local moves close. The climb (first improvement, like `zb_auto._improve`):

    moves      into every idle gap, largest first: the next W, F and B of that rank from later slots;
               then every W one slot later (it may delay a critical B or F); then every pass one slot
               earlier (a swap with its neighbour)
    accepted   when the re-timed (makespan, bubble rate) improves, `zb_auto._better`, and no rank holds
               more activations than the input schedule's peak (the cap: p for zbv)
    timing     `_retime` below, the list scheduling of `zbcompile.simulate` on integer ids (a test checks
               that both agree); an order that deadlocks is rejected there

Work is bounded in simulated actions (`_WORK`), never in seconds, so the result is the same on every
machine; above `_MAX_ACTIONS` passes the schedule is returned unchanged. Unit costs, or any uniform F = B = W
with no hop cost (a rescaling of them), return the schedule unchanged as well: the hand-made orders are
built for that model. The result is never worse than the input: a move is only kept when it improves.
"""

from __future__ import annotations

from typing import Any

from zbcompile.schedule import Kind, Schedule, build
from zbcompile.simulate import Costs, list_schedule

from .zb_auto import _EPS, _better, local_moves

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
    """The schedule on integer ids: dependencies, costs and memory deltas per action."""

    def __init__(self, schedule: Schedule, costs: Costs):
        self.schedule = schedule
        self.actions = [a for row in schedule.ranks for a in row]
        index = {a: i for i, a in enumerate(self.actions)}
        self.deps = [tuple(index[d] for d in schedule.deps(a)) for a in self.actions]
        table = costs.action_costs(schedule)
        self.cost = [table[a.kind, a.stage] for a in self.actions]
        self.rank_of = [r for r, row in enumerate(schedule.ranks) for _ in row]
        self.delta = [1 if a.kind is Kind.F else -1 if a.kind is Kind.W else 0 for a in self.actions]
        self.is_w = [a.kind is Kind.W for a in self.actions]
        self.comm = costs.comm
        first, self.orders = 0, []
        for row in schedule.ranks:
            self.orders.append(list(range(first, first + len(row))))
            first += len(row)

    def peak(self, row: list[int]) -> int:
        held = top = 0
        for i in row:
            held += self.delta[i]
            if held > top:
                top = held
        return top

    def retime(self, orders: list[list[int]]) -> tuple[list[float], float, float] | None:
        """(start per id, makespan, bubble rate) by the simulator's own timing model; None on a deadlock."""
        cost = self.cost
        start, end, done = list_schedule(orders, self.deps, cost, self.rank_of, self.comm)
        p = len(orders)
        if any(done[r] < len(orders[r]) for r in range(p)):
            return None
        bubble = 0.0
        for row in orders:
            if row:
                busy = sum(cost[i] for i in row)
                span = end[row[-1]] - start[row[0]]
                if span > 0:
                    bubble = max(bubble, 1.0 - busy / span)
        return start, max((end[row[-1]] for row in orders if row), default=0.0), bubble

    def moves(self, orders: list[list[int]], start: list[float]) -> list[tuple[int, int, int]]:
        """Candidate moves (rank, from, to), most promising first (see the module docstring)."""
        kind_of = [a.kind for a in self.actions]
        cost = self.cost

        def hole(r: int, i: int) -> float:
            row = orders[r]
            return start[row[i]] - (start[row[i - 1]] + cost[row[i - 1]])

        return self.critical_moves(orders, start) + local_moves(orders, hole, kind_of.__getitem__,
                                                                 self.is_w.__getitem__)

    def critical_moves(self, orders: list[list[int]], start: list[float]) -> list[tuple[int, int, int]]:
        """Moves along the critical path: walk back from the action that ends last; where an action waits
        for the pass before it on its rank (not for an input), try it up to `_REACH` slots earlier and that
        pass up to `_REACH` slots later."""
        where = {}
        for r, row in enumerate(orders):
            for k, i in enumerate(row):
                where[i] = (r, k)
        cost, deps, rank_of, comm = self.cost, self.deps, self.rank_of, self.comm
        i = max(range(len(cost)), key=lambda j: (start[j] + cost[j], -j))
        moves: list[tuple[int, int, int]] = []
        while True:
            r, k = where[i]
            if k > 0 and abs(start[orders[r][k - 1]] + cost[orders[r][k - 1]] - start[i]) <= _EPS:
                moves += [(r, k, k - d) for d in range(1, min(_REACH, k) + 1)]
                moves += [(r, k - 1, k - 1 + d) for d in range(1, _REACH + 1) if k - 1 + d < len(orders[r])]
                i = orders[r][k - 1]
                continue
            nxt = None
            for d in deps[i]:
                if abs(start[d] + cost[d] + (comm if rank_of[d] != r else 0.0) - start[i]) <= _EPS:
                    nxt = d
                    break
            if nxt is None:
                break
            i = nxt
        return moves

    def blocked(self, row: list[int], src: int, dst: int) -> bool:
        """Whether moving row[src] to dst jumps over a same-rank dependency (the order would deadlock)."""
        x = row[src]
        if dst < src:
            need = self.deps[x]
            return any(row[k] in need for k in range(dst, src))
        return any(x in self.deps[row[k]] for k in range(src + 1, dst + 1))

    def fits(self, row: list[int], cap: int) -> bool:
        held = 0
        for i in row:
            held += self.delta[i]
            if held > cap:
                return False
        return True


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
    cap = max(prob.peak(row) for row in orders)
    timed = prob.retime(orders)
    if timed is None:
        return schedule
    start, makespan, bubble = timed
    score = (makespan, bubble)
    size = len(prob.actions)
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
            if not prob.fits(row, cap):
                continue
            trial = orders[:r] + [row] + orders[r + 1:]
            spent += size
            t = prob.retime(trial)
            if t is not None and _better((t[1], t[2]), score):
                orders, (start, score), improved = trial, (t[0], (t[1], t[2])), True
                break
        else:
            break
    if not improved:
        return schedule
    ranks = [[prob.actions[i] for i in row] for row in orders]
    return build(schedule.name, schedule.num_microbatches, schedule.placement, ranks)
