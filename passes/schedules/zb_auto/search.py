"""zb-auto's search beyond the greedy: hill climbing on single-action moves, and an exact branch and bound on
small instances (see the package docstring). Both work on per-rank code orders of one `ScheduleProblem`,
which times them (`retime`) and checks memory and same-rank order (`fits`, `in_rank_order`).
"""

from __future__ import annotations

from typing import Any

from zbcompile.ir.schedule import Kind
from zbcompile.ir.schedule_problem import ScheduleProblem, Timing

from .._search import EPS, better, local_moves

__all__ = ["improve", "exact"]

F, B, W = 0, 1, 2
_KINDS = (Kind.F, Kind.B, Kind.W)


# ---- local improvement ----------------------------------------------------------------------------------
def _moves(orders: list[list[int]], timing: Timing, prob: ScheduleProblem) -> list[tuple[int, int, int]]:
    """Candidate moves (rank, from, to) for the code orders here (`_search.local_moves`)."""
    start, cost, codes = timing.start, prob.cost, prob.codes

    def hole(r: int, i: int) -> float:
        row = orders[r]
        return start[row[i]] - (start[row[i - 1]] + cost[row[i - 1]])

    return local_moves(orders, hole, codes.kind, lambda code: codes.kind(code) is Kind.W)


def _legal(prob: ScheduleProblem, row: list[int], limit: int) -> bool:
    """Same-rank order rules: B after its F, W after its B, memory under the limit."""
    return prob.fits(row, limit) and prob.in_rank_order(row)


def improve(orders: list[list[int]], prob: ScheduleProblem, limit: int, work: int,
            floor: float) -> tuple[list[list[int]], Timing]:
    """First-improvement hill climbing over single-action moves; stops at a local optimum, out of `work`
    (simulated actions), or at a makespan of `floor` (a lower bound) with no bubble. `orders` must time."""
    size = sum(map(len, orders))
    timing = prob.retime(orders)
    spent = size
    while spent + size <= work and better((floor, 0.0), timing.score):
        for r, src, dst in _moves(orders, timing, prob):
            if spent + size > work:
                break
            row = orders[r][:]
            row.insert(dst, row.pop(src))
            if not _legal(prob, row, limit):
                continue
            trial = orders[:r] + [row] + orders[r + 1:]
            spent += size
            t = prob.retime(trial)
            if t is not None and better(t.score, timing.score):
                orders, timing = trial, t
                break
        else:
            break
    return orders, timing


# ---- exact search ------------------------------------------------------------------------------------------
def exact(prob: ScheduleProblem, p: int, m: int, cs: Any, limit: int, incumbent: float,
          nodes: int) -> tuple[list[list[int]] | None, bool]:
    """Branch and bound over active schedules (Giffler-Thompson branching).

    Returns (orders, proved): orders beating the `incumbent` makespan or None, and whether the tree was
    exhausted within `nodes`, i.e. the result (or the incumbent) is optimal. The search space: F's of a rank in
    microbatch order, W's of a rank oldest first (W's of one rank are interchangeable), B's in any order.

    A node is a partial schedule: per rank the passes placed so far, with their times. Among the passes whose
    inputs are all placed, take the one that could end first; on its rank branch over every ready pass that
    could start before that end (and fits in memory). Bound: per rank, its clock plus its remaining work.
    Active schedules contain an optimal one, so an exhausted tree proves the best found optimal.
    """
    search = _BranchAndBound(prob, p, m, cs, limit, incumbent, nodes)
    search.dfs()
    return search.best_orders, search.budget > 0


class _BranchAndBound:
    """The state of `exact`'s depth-first search: one partial schedule, extended by `place` and restored by
    `unplace` on the way back."""

    def __init__(self, prob: ScheduleProblem, p: int, m: int, cs: Any, limit: int, incumbent: float, nodes: int):
        self.p, self.m, self.limit, self.comm = p, m, limit, cs.comm
        self.codes = prob.codes
        self.cost = [cs.of(r) for r in range(p)]
        self.best, self.best_orders = incumbent, None
        self.budget = nodes
        self.end = [[[-1.0] * m for _ in range(3)] for _ in range(p)]
        self.done = [[0, 0, 0] for _ in range(p)]
        self.wq: list[list[int]] = [[] for _ in range(p)]  # B's done whose W is not placed yet, as microbatches
        self.bq: list[list[int]] = [[] for _ in range(p)]  # F's done whose B is not placed yet
        self.free = [0.0] * p
        self.held = [0] * p
        self.left = [m * sum(self.cost[r]) for r in range(p)]
        self.orders: list[list[int]] = [[] for _ in range(p)]

    def ready_passes(self, r: int) -> list[tuple[float, int, int]]:
        """(earliest start, kind, mb) of each pass of rank r whose inputs are placed."""
        p, end, free, comm = self.p, self.end, self.free, self.comm
        out = []
        nf = self.done[r][F]
        if nf < self.m and self.held[r] < self.limit:
            e = 0.0 if r == 0 else end[r - 1][F][nf]
            if e >= 0:
                out.append((max(free[r], e + (comm if r else 0.0)), F, nf))
        for mb in self.bq[r]:
            e = end[r][F][mb] if r == p - 1 else end[r + 1][B][mb]
            if e >= 0:
                out.append((max(free[r], e + (comm if r < p - 1 else 0.0)), B, mb))
        for mb in self.wq[r][:1]:  # W's are interchangeable on a rank: run them oldest first
            out.append((free[r], W, mb))
        return out

    def bound(self) -> float:
        lb = 0.0
        for r in range(self.p):
            if self.left[r] > 0:
                lb = max(lb, self.free[r] + self.left[r])
        return lb

    def place(self, r: int, kind: int, mb: int, start: float) -> tuple:
        undo = (self.free[r], kind, mb)
        self.free[r] = start + self.cost[r][kind]
        self.end[r][kind][mb] = self.free[r]
        self.left[r] -= self.cost[r][kind]
        self.done[r][kind] += 1
        self.orders[r].append(self.codes.code(_KINDS[kind], r, mb))
        if kind == F:
            self.held[r] += 1
            self.bq[r].append(mb)
        elif kind == B:
            self.bq[r].remove(mb)
            self.wq[r].append(mb)
        else:
            self.held[r] -= 1
            self.wq[r].pop(0)
        return undo

    def unplace(self, r: int, undo: tuple) -> None:
        old_free, kind, mb = undo
        self.left[r] += self.cost[r][kind]
        self.free[r] = old_free
        self.end[r][kind][mb] = -1.0
        self.done[r][kind] -= 1
        self.orders[r].pop()
        if kind == F:
            self.held[r] -= 1
            self.bq[r].remove(mb)
        elif kind == B:
            self.wq[r].remove(mb)
            self.bq[r].append(mb)
            self.bq[r].sort()
        else:
            self.held[r] += 1
            self.wq[r].insert(0, mb)

    def pick(self) -> tuple[float, int] | None:
        """(end, rank) of the ready pass that could end first, or None when nothing is ready."""
        pick = None
        for r in range(self.p):
            for est, kind, mb in self.ready_passes(r):
                fin = est + self.cost[r][kind]
                if pick is None or fin < pick[0] - EPS:
                    pick = (fin, r)
        return pick

    def finish(self) -> None:
        """A leaf: keep the schedule if it is complete and beats the best so far."""
        if all(left <= EPS for left in self.left):
            makespan = max(self.free)
            if makespan < self.best - EPS:
                self.best, self.best_orders = makespan, [row[:] for row in self.orders]

    def dfs(self) -> None:
        if self.budget <= 0:
            return
        self.budget -= 1
        if self.bound() >= self.best - EPS:
            return
        pick = self.pick()
        if pick is None:
            self.finish()
            return
        fin, r = pick
        ready = self.ready_passes(r)
        branches = sorted((est, kind, mb) for est, kind, mb in ready if est < fin - EPS
                          or (est <= fin and self.cost[r][kind] == 0))
        if not branches:
            branches = [min(ready)]
        for est, kind, mb in branches:
            undo = self.place(r, kind, mb, est)
            self.dfs()
            self.unplace(r, undo)
