"""ZB-auto: the Zero Bubble paper's automatic scheduler under a memory limit, plus a search on top of it.

One stage per rank (stage s on rank s), actions F, B, W. Memory counts 1F1B-stage activations of one
microbatch: F holds 1, B frees nothing, W frees 1 (the authors' conservative model). The limit is the most a
rank may hold at once: p gives ZB-1p (1F1B's memory), 2p gives ZB-2p.

    costs, limit
      -> greedy      the authors' list scheduler, every combination of its 3 switches, under the limit and
                     under a few tighter caps (a tighter cap sometimes times better with uneven costs)
      -> improve     hill climbing on the best seeds: move one action to another slot of its rank
                     (an idle gap, a neighbour), re-time, keep the move while (makespan, bubble) improves
      -> exact       branch and bound over active schedules on small instances (p*m <= 24), seeded with
                     the best so far; it proves optimality when it finishes inside its node budget
      -> Schedule    validated; its timing is the shared simulator's (list scheduling)

`makespan_lower_bound` (forced idle before the first B and after the last F of each rank) stops the search
as soon as a schedule reaches it; under unit costs the greedy already does at every limit >= p, and on the
measured-looking profiles tried so far (p=4..32) it does at limits p and 2p.

Every stage is bounded by a budget counted in work (simulated actions, search nodes), never in seconds, so the
result is the same on every machine. Above 4000 passes (p=32, m=256 has 24576) only the greedy runs, and
runs that could not differ are skipped: about 0.15 s there.

Timing model (the same as `zbcompile.simulate`): a rank runs its actions in order and an action starts at
max(rank free, dependency end + comm) with comm only on cross-rank edges; F(s, i) needs F(s-1, i); B(s, i)
needs F(s, i) and B(s+1, i); W(s, i) needs B(s, i). The objective is the makespan, ties broken by the
papers' bubble rate (the worst rank's idle share of its own span).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Sequence

from zbcompile.errors import ScheduleError
from zbcompile.schedule import Action, Kind, Schedule, build, loop_placement

from ._common import check_microbatches, check_pp

__all__ = ["zb_auto", "min_memory_limit", "makespan_lower_bound"]

F, B, W = 0, 1, 2
_KINDS = (Kind.F, Kind.B, Kind.W)
_EPS = 1e-9

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


# ---- internal form: per rank a list of codes kind * m + microbatch -------------------------------------------
Orders = list  # list[list[int]], one list per rank (= stage)


@dataclass(frozen=True)
class _Timing:
    """List-scheduling result for coded orders: start of every slot, makespan, bubble rate."""

    starts: tuple[tuple[float, ...], ...]
    makespan: float
    bubble: float

    @property
    def score(self) -> tuple[float, float]:
        return self.makespan, self.bubble


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic `a < b` with a tolerance, so float noise never counts as an improvement."""
    if a[0] < b[0] - _EPS:
        return True
    return abs(a[0] - b[0]) <= _EPS and a[1] < b[1] - _EPS


def _retime(orders: Orders, m: int, cs: _Costs) -> _Timing | None:
    """Time coded orders exactly as `zbcompile.simulate` does; None when the order deadlocks."""
    p = len(orders)
    comm = cs.comm
    end = [[[-1.0] * m for _ in range(3)] for _ in range(p)]  # end[stage][kind][mb], -1 = not yet run
    starts = [[0.0] * len(o) for o in orders]
    free = [0.0] * p
    pos = [0] * p
    waiting: dict[tuple[int, int, int], list[int]] = {}
    ready = list(range(p - 1, -1, -1))
    while ready:
        r = ready.pop()
        row, mine, cost = orders[r], end[r], cs.of(r)
        while pos[r] < len(row):
            kind, mb = divmod(row[pos[r]], m)
            t = free[r]
            if kind == F:
                blocker = None
                if r > 0:
                    e = end[r - 1][F][mb]
                    if e < 0:
                        blocker = (r - 1, F, mb)
                    elif e + comm > t:
                        t = e + comm
            elif kind == B:
                e = mine[F][mb]
                blocker = (r, F, mb) if e < 0 else None
                if blocker is None:
                    t = max(t, e)
                    if r < p - 1:
                        e = end[r + 1][B][mb]
                        if e < 0:
                            blocker = (r + 1, B, mb)
                        elif e + comm > t:
                            t = e + comm
            else:
                e = mine[B][mb]
                blocker = (r, B, mb) if e < 0 else None
                if blocker is None and e > t:
                    t = e
            if blocker is not None:
                waiting.setdefault(blocker, []).append(r)
                break
            starts[r][pos[r]] = t
            free[r] = mine[kind][mb] = t + cost[kind]
            pos[r] += 1
            woken = waiting.pop((r, kind, mb), None)
            if woken:
                ready.extend(woken)
    if any(pos[r] < len(orders[r]) for r in range(p)):
        return None
    bubble = 0.0
    for r, row in enumerate(orders):
        if row:
            cost = cs.of(r)
            busy = sum(cost[c // m] for c in row)
            span = free[r] - starts[r][0]
            if span > 0:
                bubble = max(bubble, 1.0 - busy / span)
    return _Timing(tuple(map(tuple, starts)), max(free, default=0.0), bubble)


def _memory_ok(row: Sequence[int], m: int, limit: int) -> bool:
    held = 0
    for code in row:
        kind = code // m
        if kind == F:
            held += 1
            if held > limit:
                return False
        elif kind == W:
            held -= 1
    return True


# ---- the authors' greedy list scheduler ---------------------------------------------------------------
class _Greedy:
    """One run of the greedy: places passes rank by rank in microbatch rounds, timing each as it goes.

    Switches (the 8 combinations are tried; `asked` records which ones a run read, so a combination that
    differs from a finished run only in switches that run never read is known to repeat it and is skipped):
      early_f   warm-up F's may start while they would end after the first B arrives (else they stop
                once the rank's clock reaches that arrival)
      b_first   a rank 2+ F's ahead of the next one skips its F when the F would delay the next rank's B
      fill_over before an F or B, one more W that overshoots its dependency's arrival is run when the
                idle gap is within this rank's share of the worst bubble so far
    """

    SWITCHES = ("early_f", "b_first", "fill_over")

    def __init__(self, p: int, m: int, cs: _Costs, limit: int, switches: dict[str, bool]):
        self.p, self.m, self.cs, self.limit = p, m, cs, limit
        self.switches = switches
        self.asked: set[str] = set()
        self.cost = [cs.of(r) for r in range(p)]
        self.end_f = [[0.0] * m for _ in range(p)]
        self.end_b = [[0.0] * m for _ in range(p)]
        self.free = [0.0] * p
        self.done = [[0, 0, 0] for _ in range(p)]   # F, B, W placed per rank
        self.held = [0] * p
        self.idle = [0.0] * p                      # idle time after the rank's first F
        self.worst_idle = 0.0
        self.orders: Orders = [[] for _ in range(p)]

    def ask(self, switch: str) -> bool:
        self.asked.add(switch)
        return self.switches[switch]

    def put(self, r: int, kind: int) -> None:
        done = self.done[r]
        mb = done[kind]
        free = start = self.free[r]
        if kind == F:
            if r > 0:
                start = max(start, self.end_f[r - 1][mb] + self.cs.comm)
            end = self.end_f[r][mb] = start + self.cost[r][F]
            self.held[r] += 1
        elif kind == B:
            if r < self.p - 1:
                start = max(start, self.end_b[r + 1][mb] + self.cs.comm)
            end = self.end_b[r][mb] = start + self.cost[r][B]
        else:
            end = start + self.cost[r][W]
            self.held[r] -= 1
        if start > free and done[F]:
            idle = self.idle[r] = self.idle[r] + start - free
            if idle > self.worst_idle:
                self.worst_idle = idle
        self.free[r] = end
        done[kind] += 1
        self.orders[r].append(kind * self.m + mb)

    def has_w(self, r: int) -> bool:
        return self.done[r][W] < self.done[r][B]

    def fill_before(self, r: int, arrival: float) -> None:
        """Run W's while they end before `arrival` (the time the next pass's input lands), then maybe one more."""
        w = self.cs.w[r]
        while self.has_w(r) and self.free[r] + w <= arrival + _EPS:
            self.put(r, W)
        if self.has_w(r) and self.free[r] < arrival - _EPS:
            within_slack = arrival - self.free[r] <= self.worst_idle - self.idle[r] + _EPS
            if not within_slack or self.ask("fill_over"):
                self.put(r, W)

    def run(self) -> Orders:
        p, m = self.p, self.m
        self.warm_up()
        for i in range(1, m):
            issue = [self.wants_f(r) for r in range(p)]
            for r in range(p - 2, -1, -1):
                issue[r] = issue[r] and issue[r + 1]
            for r in range(p):
                if issue[r]:
                    while self.held[r] + 1 > self.limit:
                        self.put(r, W)
                    if r > 0:
                        self.fill_before(r, self.end_f[r - 1][self.done[r][F]] + self.cs.comm)
                    self.put(r, F)
            for r in range(p - 1, -1, -1):
                if r < p - 1:
                    self.fill_before(r, self.end_b[r + 1][i] + self.cs.comm)
                if r == 0 and self.done[0][F] == m:
                    while self.has_w(0):
                        self.put(0, W)
                self.put(r, B)
        for r in range(p):
            while self.has_w(r):
                self.put(r, W)
        return self.orders

    def score(self) -> tuple[float, float]:
        """(makespan, bubble rate) of the placed passes; equal to `_retime` of the orders (a test checks)."""
        bubble = 0.0
        for r in range(self.p):
            first = self.end_f[r][0] - self.cs.f[r]
            span = self.free[r] - first
            busy = self.m * sum(self.cs.of(r))
            if span > 0:
                bubble = max(bubble, 1.0 - busy / span)
        return max(self.free), bubble

    def warm_up(self) -> None:
        """Microbatch 0: F0 everywhere, as many extra F's per rank as fit before B0 comes back, then B0."""
        p, m, cs = self.p, self.m, self.cs
        for r in range(p):
            self.put(r, F)
        extra = [0] * p
        back = self.end_f[p - 1][0] + cs.b[p - 1]  # when B0 of the last stage ends
        for r in range(p - 2, -1, -1):
            clock, held = self.free[r], self.held[r]
            arrival = back + cs.comm
            while 1 + extra[r] < m and held + 1 <= self.limit:
                if (clock + cs.f[r] > arrival + _EPS) if self.ask("early_f") else (clock >= arrival - _EPS):
                    break
                held += 1
                clock += cs.f[r]
                extra[r] += 1
            back = max(clock, arrival) + cs.b[r]
        # Each rank runs fewer extra F's than the one before it (1F1B's staircase), unless both run them all.
        for r in range(1, p):
            cap = extra[r - 1] if extra[r - 1] == m - 1 else max(0, extra[r - 1] - 1)
            extra[r] = min(extra[r], cap)
        for r in range(p):
            for _ in range(extra[r]):
                self.put(r, F)
        for r in range(p - 1, -1, -1):
            self.put(r, B)

    def wants_f(self, r: int) -> bool:
        p, m, cs = self.p, self.m, self.cs
        nf = self.done[r][F]
        if nf >= m:
            return False
        if not (r + 1 < p and nf >= self.done[r + 1][F] + 2) or not self.ask("b_first"):
            return True
        # The next rank's next F then B are what this rank's F could delay.
        next_b_ready = self.free[r + 1] + cs.f[r + 1] + cs.b[r + 1] + cs.comm
        if self.free[r] >= next_b_ready:
            return False
        forced_w = max(0, self.held[r] + 1 - self.limit)
        if self.free[r] + cs.f[r] + forced_w * cs.w[r] <= next_b_ready + _EPS:
            return True
        return next_b_ready - self.free[r] > self.worst_idle - self.idle[r] + _EPS


def _greedy_seeds(p: int, m: int, cs: _Costs, limit: int) -> list[tuple[tuple[float, float], Orders]]:
    """(score, orders) of the greedy under every switch combination, at the limit and, on instances small
    enough, a few tighter caps; distinct orders only, best first."""
    caps = [limit] if 3 * p * m > _SEARCH_MAX_ACTIONS else range(limit, max(0, limit - 4), -1)
    seen, seeds = set(), []
    for cap in caps:
        runs: list[_Greedy] = []
        for values in itertools.product((True, False), repeat=3):
            switches = dict(zip(_Greedy.SWITCHES, values))
            if any(all(run.switches[k] == v for k, v in switches.items() if k in run.asked) for run in runs):
                continue  # it would retrace a finished run step by step
            greedy = _Greedy(p, m, cs, cap, switches)
            orders = greedy.run()
            runs.append(greedy)
            key = tuple(map(tuple, orders))
            if key not in seen:
                seen.add(key)
                seeds.append((greedy.score(), orders))
    seeds.sort(key=lambda seed: seed[0])
    return seeds


# ---- local improvement ----------------------------------------------------------------------------------
def _moves(orders: Orders, timing: _Timing, m: int, cs: _Costs) -> list[tuple[int, int, int]]:
    """Candidate moves (rank, from, to) for the coded orders here (code // m is the kind)."""
    def hole(r: int, i: int) -> float:
        starts, row = timing.starts[r], orders[r]
        return starts[i] - (starts[i - 1] + cs.of(r)[row[i - 1] // m])

    return local_moves(orders, hole, lambda code: code // m, lambda code: code // m == W)


def local_moves(orders, hole, kind, is_w) -> list[tuple[int, int, int]]:
    """Candidate moves (rank, from, to) of a local search over per-rank orders, most promising first.

    Into every idle gap, largest first: the next pass of each kind from later slots of that rank (any of
    them may fill the hole). Then every W one slot later (a W may be in the way of a critical B or F). Then
    every pass one slot earlier. `hole(r, i)` is the idle time before slot i of rank r; `kind(x)` and
    `is_w(x)` classify an order entry. Shared with zbv's polish.
    """
    gaps, moves = [], []
    for r, row in enumerate(orders):
        for i in range(1, len(row)):
            idle = hole(r, i)
            if idle > _EPS:
                gaps.append((-idle, r, i))
    gaps.sort()
    for _, r, i in gaps:
        row, found = orders[r], set()
        for j in range(i + 1, len(row)):
            k = kind(row[j])
            if k not in found:
                found.add(k)
                moves.append((r, j, i))
                if len(found) == 3:
                    break
    for r, row in enumerate(orders):
        for i in range(1, len(row)):
            if is_w(row[i - 1]):
                moves.append((r, i - 1, i))
    for r, row in enumerate(orders):
        for i in range(1, len(row)):
            moves.append((r, i, i - 1))
    return moves


def _legal(row: list[int], m: int, limit: int) -> bool:
    """Same-rank order rules: B after its F, W after its B, memory under the limit."""
    seen_f, seen_b = set(), set()
    held = 0
    for code in row:
        kind, mb = divmod(code, m)
        if kind == F:
            seen_f.add(mb)
            held += 1
            if held > limit:
                return False
        elif kind == B:
            if mb not in seen_f:
                return False
            seen_b.add(mb)
        else:
            if mb not in seen_b:
                return False
            held -= 1
    return True


def _improve(orders: Orders, m: int, cs: _Costs, limit: int, work: int,
             floor: float) -> tuple[Orders, _Timing]:
    """First-improvement hill climbing over single-action moves; stops at a local optimum, out of work, or
    at a makespan of `floor` (a lower bound) with no bubble."""
    size = sum(map(len, orders))
    timing = _retime(orders, m, cs)
    spent = size
    while spent + size <= work and _better((floor, 0.0), timing.score):
        for r, src, dst in _moves(orders, timing, m, cs):
            if spent + size > work:
                break
            row = orders[r][:]
            row.insert(dst, row.pop(src))
            if not _legal(row, m, limit):
                continue
            trial = orders[:r] + [row] + orders[r + 1:]
            spent += size
            t = _retime(trial, m, cs)
            if t is not None and _better(t.score, timing.score):
                orders, timing = trial, t
                break
        else:
            break
    return orders, timing


# ---- exact search ------------------------------------------------------------------------------------------
def _exact(p: int, m: int, cs: _Costs, limit: int, incumbent: float, nodes: int) -> tuple[Orders | None, bool]:
    """Branch and bound over active schedules (Giffler-Thompson branching).

    Returns (orders, proved): orders beating the `incumbent` makespan or None, and whether the tree was
    exhausted within `nodes`, i.e. the result (or the incumbent) is optimal. The search space: F's of a rank in
    microbatch order, W's of a rank oldest first (W's of one rank are interchangeable), B's in any order.

    A node is a partial schedule: per rank the passes placed so far, with their times. Among the passes whose
    inputs are all placed, take the one that could end first; on its rank branch over every ready pass that
    could start before that end (and fits in memory). Bound: per rank, its clock plus its remaining work.
    Active schedules contain an optimal one, so an exhausted tree proves the best found optimal.
    """
    comm = cs.comm
    cost = [cs.of(r) for r in range(p)]
    best = [incumbent, None]
    budget = [nodes]
    end = [[[-1.0] * m for _ in range(3)] for _ in range(p)]
    done = [[0, 0, 0] for _ in range(p)]
    wq = [[] for _ in range(p)]         # B's done whose W is not placed yet, per rank, as microbatches
    bq = [[] for _ in range(p)]         # F's done whose B is not placed yet
    free = [0.0] * p
    held = [0] * p
    left = [m * sum(cost[r]) for r in range(p)]
    orders: Orders = [[] for _ in range(p)]

    def ready_passes(r: int) -> list[tuple[float, int, int]]:
        """(earliest start, kind, mb) of each pass of rank r whose inputs are placed."""
        out = []
        nf = done[r][F]
        if nf < m and held[r] < limit:
            e = 0.0 if r == 0 else end[r - 1][F][nf]
            if e >= 0:
                out.append((max(free[r], e + (comm if r else 0.0)), F, nf))
        for mb in bq[r]:
            e = end[r][F][mb] if r == p - 1 else end[r + 1][B][mb]
            if e >= 0:
                out.append((max(free[r], e + (comm if r < p - 1 else 0.0)), B, mb))
        for mb in wq[r][:1]:  # W's are interchangeable on a rank: run them oldest first
            out.append((free[r], W, mb))
        return out

    def bound() -> float:
        lb = 0.0
        for r in range(p):
            if left[r] > 0:
                lb = max(lb, free[r] + left[r])
        return lb

    def place(r: int, kind: int, mb: int, start: float) -> tuple:
        undo = (free[r], kind, mb)
        free[r] = start + cost[r][kind]
        end[r][kind][mb] = free[r]
        left[r] -= cost[r][kind]
        done[r][kind] += 1
        orders[r].append(kind * m + mb)
        if kind == F:
            held[r] += 1
            bq[r].append(mb)
        elif kind == B:
            bq[r].remove(mb)
            wq[r].append(mb)
        else:
            held[r] -= 1
            wq[r].pop(0)
        return undo

    def unplace(r: int, undo: tuple) -> None:
        old_free, kind, mb = undo
        left[r] += cost[r][kind]
        free[r] = old_free
        end[r][kind][mb] = -1.0
        done[r][kind] -= 1
        orders[r].pop()
        if kind == F:
            held[r] -= 1
            bq[r].remove(mb)
        elif kind == B:
            wq[r].remove(mb)
            bq[r].append(mb)
            bq[r].sort()
        else:
            held[r] += 1
            wq[r].insert(0, mb)

    def dfs() -> None:
        if budget[0] <= 0:
            return
        budget[0] -= 1
        if bound() >= best[0] - _EPS:
            return
        pick = None
        for r in range(p):
            for est, kind, mb in ready_passes(r):
                fin = est + cost[r][kind]
                if pick is None or fin < pick[0] - _EPS:
                    pick = (fin, r)
        if pick is None:
            if all(left[r] <= _EPS for r in range(p)):
                makespan = max(free)
                if makespan < best[0] - _EPS:
                    best[0], best[1] = makespan, [row[:] for row in orders]
            return
        fin, r = pick
        branches = sorted((est, kind, mb) for est, kind, mb in ready_passes(r) if est < fin - _EPS
                          or (est <= fin and cost[r][kind] == 0))
        if not branches:
            branches = [min(ready_passes(r))]
        for est, kind, mb in branches:
            undo = place(r, kind, mb, est)
            dfs()
            unplace(r, undo)

    dfs()
    return best[1], budget[0] > 0


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

    floor = makespan_lower_bound(p, m, costs, limit)
    seeds = _greedy_seeds(p, m, cs, limit)
    best_score, best = seeds[0]
    if 3 * p * m <= _SEARCH_MAX_ACTIONS:
        # At the bound only the bubble can still improve: polish the best seed alone.
        for _, orders in seeds[:1 if best_score[0] <= floor + _EPS else 3]:
            cand, t = _improve(orders, m, cs, limit, _IMPROVE_WORK, floor)
            if _better(t.score, best_score):
                best, best_score = cand, t.score
    if p * m <= _EXACT_MAX_CELLS and best_score[0] > floor + _EPS:
        found, _ = _exact(p, m, cs, limit, best_score[0], _EXACT_NODES)
        if found is not None:  # polish the bubble of the new best; its makespan cannot drop any further
            best, _ = _improve(found, m, cs, limit, _IMPROVE_WORK, floor)
    return _to_schedule(best, p, m, limit)


def _to_schedule(orders: Orders, p: int, m: int, limit: int) -> Schedule:
    """Freeze and check the structure (`build`) and the memory. Every stage above only yields orders that
    time without deadlock (the greedy and the exact search place passes after their inputs; the improvement
    keeps only orders that re-time), so the dependency check is left to the tests."""
    ranks = [[Action(_KINDS[c // m], r, c % m) for c in row] for r, row in enumerate(orders)]
    schedule = build("zb-auto", m, loop_placement(p), ranks)
    over = [r for r, row in enumerate(orders) if not _memory_ok(row, m, limit)]
    if over:
        raise ScheduleError(f"zb-auto: ranks {over} exceed mem_limit={limit} (a bug in this pass; please "
                            f"report it with pp, microbatches, costs and mem_limit)\n{schedule.format_grid()}")
    return schedule
